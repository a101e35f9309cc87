-- Commits the draw once its order is in the queue: records the seed, and queues
-- everyone who joined late behind the drawn, in arrival order.
--
-- KEYS: joined, late, seq, queue, admitted, outcome, meta, journal, journal lock,
--       recorded (see RoomKeys)
-- ARGV[1] seed, ARGV[2] how many were drawn, ARGV[3] the place offset of late joiners
--
-- Returns 1 when this call committed it, 0 when it was committed before.
if redis.call("HSETNX", KEYS[7], "seed", ARGV[1]) == 0 then
  return 0
end
redis.call("HSET", KEYS[7], "drawn", ARGV[2])
local late = redis.call("ZRANGE", KEYS[2], 0, -1, "WITHSCORES")
local offset = tonumber(ARGV[3])
for i = 1, #late, 2 do
  local user = late[i]
  -- A drawn user who joined again while the room was being rebuilt keeps
  -- their drawn place.
  if not redis.call("HGET", KEYS[6], user) and not redis.call("ZSCORE", KEYS[5], user)
      and not redis.call("ZSCORE", KEYS[1], user) then
    redis.call("ZADD", KEYS[4], offset + tonumber(late[i + 1]), user)
  end
end
return 1
