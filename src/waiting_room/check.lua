-- Whether a room is still the one an instance remembers joins of, in one
-- round trip on the room's slot: its generation (see join.lua; "" when it has
-- none), its arrival counter, whether the join with the highest number the
-- instance learnt is still there with that number (Redis applies writes in
-- order: if it survived, every earlier join did), the Redis process that
-- answers (a failover or a restart may have lost the last writes) and Redis's
-- clock.
--
-- KEYS: joined, late, seq, queue, admitted, outcome, meta, journal, journal lock,
--       recorded (see RoomKeys)
-- ARGV[1] the user of the last join learnt, ARGV[2] its arrival number ("" and
--         "" when none)
--
-- Returns {generation, counter, 1 | 0 (the last join kept), run_id, seconds,
-- microseconds}.
local t = redis.call("TIME")
local gen = redis.call("HGET", KEYS[7], "gen") or ""
local seq = tonumber(redis.call("GET", KEYS[3]) or "0")
local kept = 1
if ARGV[1] ~= "" then
  local s = redis.call("ZSCORE", KEYS[1], ARGV[1]) or redis.call("ZSCORE", KEYS[2], ARGV[1])
  if not s or tonumber(s) ~= tonumber(ARGV[2]) then
    kept = 0
  end
end
local run_id = string.match(redis.call("INFO", "server"), "run_id:(%x+)") or ""
return {gen, seq, kept, run_id, t[1], t[2]}
