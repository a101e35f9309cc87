
-- status.lua (after place.lua): a user's place, in one round trip, and the
-- room's generation (see join.lua; "" when it has none).
--
-- ARGV[1] user id, ARGV[2] now (ms)
local p = place(ARGV[1], tonumber(ARGV[2]))
p[5] = redis.call("HGET", KEYS[7], "gen") or ""
return p
