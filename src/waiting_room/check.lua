-- Whether a room is still the one an instance remembers joins of: its
-- generation (see join.lua; "" when it has none), its arrival counter (it only
-- grows before the draw: lower than a number the instance learnt means Redis
-- lost writes) and Redis's clock, in one round trip on the room's slot.
--
-- KEYS: joined, late, seq, queue, admitted, outcome, meta, journal, journal lock
--       (see RoomKeys)
--
-- Returns {generation, counter, seconds, microseconds}.
local t = redis.call("TIME")
local gen = redis.call("HGET", KEYS[7], "gen") or ""
local seq = tonumber(redis.call("GET", KEYS[3]) or "0")
return {gen, seq, t[1], t[2]}
