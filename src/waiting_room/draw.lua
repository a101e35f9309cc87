-- Puts part of the draw's order in the queue: ARGV[3], ARGV[4] … are pairs of a
-- user and their arrival number, placed ARGV[2] + 1, ARGV[2] + 2 … The order
-- comes from MySQL, where the draw is recorded first, so every instance writes
-- the same places: running this twice changes nothing. A room rebuilt after
-- Redis lost it gets its joiners back too; users whose turn is settled or held
-- are left out of the line.
--
-- KEYS: joined, late, seq, queue, admitted, outcome, meta, journal, journal lock,
--       recorded (see RoomKeys)
-- ARGV[1] the draw's seed, ARGV[2] the place before the first user,
-- ARGV[3..] user, arrival number, user, arrival number, …
--
-- Returns 0 when the draw was committed before (nothing written), 1 otherwise.
if redis.call("HEXISTS", KEYS[7], "seed") == 1 then
  return 0
end
local first = tonumber(ARGV[2])
local last_seq = tonumber(redis.call("GET", KEYS[3]) or "0")
for i = 3, #ARGV, 2 do
  local user, seq = ARGV[i], tonumber(ARGV[i + 1])
  -- The draw is recorded in MySQL first: every drawn user is recorded.
  redis.call("SADD", KEYS[10], user)
  if not redis.call("ZSCORE", KEYS[1], user) then
    redis.call("ZADD", KEYS[1], seq, user)
  end
  if seq > last_seq then
    last_seq = seq
  end
  if not redis.call("HGET", KEYS[6], user) and not redis.call("ZSCORE", KEYS[5], user) then
    redis.call("ZADD", KEYS[4], first + (i - 1) / 2, user)
  end
end
redis.call("SET", KEYS[3], last_seq)
return 1
