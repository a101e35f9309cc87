-- Settles an admitted user's turn once the reserve script has answered: their
-- place among the admitted frees up for the next user in line.
--
-- KEYS: joined, late, seq, queue, admitted, outcome, meta (see RoomKeys)
-- ARGV[1] user id, ARGV[2] `reserved` or `sold_out`
--
-- Returns 1 when the user held a turn, 0 otherwise (nothing changes).
if redis.call("ZREM", KEYS[5], ARGV[1]) == 1 then
  redis.call("HSET", KEYS[6], ARGV[1], ARGV[2])
  return 1
end
return 0
