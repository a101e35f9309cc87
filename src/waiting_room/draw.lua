-- Writes the next part of the drawn order into the queue, so that the front of
-- the line can be admitted while the rest is written: ARGV[7], ARGV[8] … are
-- pairs of a user and their arrival number, placed ARGV[3] + 1, ARGV[3] + 2 …
-- Places are written as one prefix from place 1 on (`written`): a part that
-- would leave a gap writes nothing, and a part written before is not written
-- again, so instances may race and a writer may die at any point. Only the
-- holder of the draw's lease writes (a writer that lost it, for instance to
-- a Redis that restarted empty, writes nothing). The first part records the
-- seed: from then on admissions run (admit.lua). Once every drawn place is
-- written, the late joiners are queued behind, in arrival order, and the draw
-- is `complete`. Users whose turn is settled or held (a room rebuilt after a
-- loss) are left out of the line.
--
-- KEYS: joined, late, seq, queue, admitted, outcome, meta, journal, journal
--       lock (see RoomKeys), the draw's lease
-- ARGV[1] the draw's seed, ARGV[2] how many are drawn, ARGV[3] the place
-- before the first user of this part, ARGV[4] the place offset of late
-- joiners, ARGV[5] lease token, ARGV[6] lease ms, ARGV[7..] user, arrival
-- number, user, arrival number, …
--
-- Returns the places written so far; -1 the room is not sealed (Redis lost
-- it: rebuild first), -2 another seed is written, -3 the lease is lost.
if redis.call("HEXISTS", KEYS[7], "sealed") == 0 then
  return -1
end
if redis.call("GET", KEYS[10]) ~= ARGV[5] then
  return -3
end
redis.call("PEXPIRE", KEYS[10], tonumber(ARGV[6]))
local seed = redis.call("HGET", KEYS[7], "seed")
if seed and seed ~= ARGV[1] then
  return -2
end
local drawn = tonumber(ARGV[2])
if not seed then
  redis.call("HSET", KEYS[7], "seed", ARGV[1], "drawn", drawn)
end
local written = tonumber(redis.call("HGET", KEYS[7], "written") or "0")
if redis.call("HEXISTS", KEYS[7], "complete") == 1 then
  return written
end
local first = tonumber(ARGV[3])
if first > written then
  return written
end
local last_seq = tonumber(redis.call("GET", KEYS[3]) or "0")
for i = 7, #ARGV, 2 do
  local at = first + (i - 5) / 2
  if at > written then
    local user, seq = ARGV[i], tonumber(ARGV[i + 1])
    if not redis.call("ZSCORE", KEYS[1], user) then
      redis.call("ZADD", KEYS[1], seq, user)
    end
    if seq > last_seq then
      last_seq = seq
    end
    if not redis.call("HGET", KEYS[6], user) and not redis.call("ZSCORE", KEYS[5], user) then
      redis.call("ZADD", KEYS[4], at, user)
    end
    written = at
  end
end
redis.call("SET", KEYS[3], last_seq)
redis.call("HSET", KEYS[7], "written", written)
if written < drawn then
  return written
end
-- Every drawn place is written: the late joiners go behind them.
local late = redis.call("ZRANGE", KEYS[2], 0, -1, "WITHSCORES")
local offset = tonumber(ARGV[4])
for i = 1, #late, 2 do
  local user = late[i]
  -- A drawn user who joined again while the room was being rebuilt keeps
  -- their drawn place.
  if not redis.call("HGET", KEYS[6], user) and not redis.call("ZSCORE", KEYS[5], user)
      and not redis.call("ZSCORE", KEYS[1], user) then
    redis.call("ZADD", KEYS[4], offset + tonumber(late[i + 1]), user)
  end
end
redis.call("HSET", KEYS[7], "complete", "1")
return written
