-- Settles an admitted user's turn once their reservation was accepted (`202`):
-- their place among the admitted frees up for the next user in line. A user
-- told `sold_out` while holding a turn goes back to the front of the line
-- instead: the answer may come from a moment's view (a sibling shard seen dry
-- a few milliseconds ago), and units may come back; the room gives them the
-- next turn that a unit allows.
--
-- KEYS: joined, late, seq, queue, admitted, outcome, meta, journal, journal lock
--       (see RoomKeys)
-- ARGV[1] user id, ARGV[2] `reserved` or `sold_out`
--
-- Returns 1 when the user held a turn, 0 otherwise (nothing changes).
if redis.call("ZREM", KEYS[5], ARGV[1]) == 0 then
  return 0
end
if ARGV[2] == "reserved" then
  redis.call("HSET", KEYS[6], ARGV[1], "reserved")
  redis.call("RPUSH", KEYS[8], "reserved\t" .. ARGV[1])
else
  redis.call("ZADD", KEYS[4], 0, ARGV[1])
end
return 1
