-- Puts part of the draw's order in the queue (ARGV[3] …, places ARGV[2] + 1 …).
-- The order comes from MySQL, where the draw is recorded first, so every
-- instance writes the same places: running this twice changes nothing. Users
-- whose turn is settled already (a queue rebuilt after Redis lost it) are left out.
--
-- KEYS: joined, late, seq, queue, admitted, outcome, meta (see RoomKeys)
-- ARGV[1] the draw's seed, ARGV[2] the place before the first user, ARGV[3..] users
--
-- Returns 0 when the draw was committed before (nothing written), 1 otherwise.
if redis.call("HEXISTS", KEYS[7], "seed") == 1 then
  return 0
end
local first = tonumber(ARGV[2])
for i = 3, #ARGV do
  local user = ARGV[i]
  if not redis.call("HGET", KEYS[6], user) and not redis.call("ZSCORE", KEYS[5], user) then
    redis.call("ZADD", KEYS[4], first + i - 2, user)
  end
end
return 1
