-- Settles a user's turn once their reservation was accepted (`202`): their
-- place among the admitted frees up for the next user in line. Settled even
-- when the turn ran out while the reservation was in flight, or the user is
-- back in line: they hold a reservation, and are a buyer from now on.
--
-- KEYS: joined, late, seq, queue, admitted, outcome, meta, journal, journal lock,
--       recorded (see RoomKeys)
-- ARGV[1] user id
--
-- Returns 1 when this call settled it, 0 when it was settled before.
redis.call("ZREM", KEYS[5], ARGV[1])
-- Out of the line, everyone behind moves up: counted in the room's mark (see
-- status.lua).
if redis.call("ZREM", KEYS[4], ARGV[1]) == 1 then
  redis.call("HINCRBY", KEYS[7], "left", 1)
end
if redis.call("HGET", KEYS[6], ARGV[1]) == "reserved" then
  return 0
end
redis.call("HSET", KEYS[6], ARGV[1], "reserved")
redis.call("RPUSH", KEYS[8], "reserved\t" .. ARGV[1])
return 1
