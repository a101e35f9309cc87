-- status.lua (after place.lua): a user's place, in one round trip, with the
-- room's generation (see join.lua; "" when it has none) and what else moves a
-- waiting user's place: the users admitted, the users who left the line
-- otherwise (settle.lua), and whether the room is closed. Together they are
-- the room's mark (see unmoved.rs), read in the same atomic call as the place;
-- and whether the room is drawn.
--
-- ARGV[1] user id, ARGV[2] now (ms)
local p = place(ARGV[1], tonumber(ARGV[2]))
local meta = redis.call("HMGET", KEYS[7], "gen", "admitted", "left", "closed", "seed")
p[5] = meta[1] or ""
p[6] = tonumber(meta[2] or "0")
p[7] = tonumber(meta[3] or "0")
p[8] = meta[4] and 1 or 0
-- Whether Redis holds a drawn room (a room rebuilt after a loss is drawn
-- again, and may have no generation until a late join).
p[9] = meta[5] and 1 or 0
return p
