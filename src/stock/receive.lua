-- Receive units lent by a sibling shard, once (split activities).
--
-- KEYS[1] stock, KEYS[2] received (hash transfer id -> units), KEYS[3] epoch,
-- KEYS[4] restock (bumped: units arrived; see reserve.lua)
-- ARGV[1] transfer id, ARGV[2] units, ARGV[3] the lender's epoch
--
-- Returns 1 received now, 0 received before, -2 lent from another build (a
-- rebuild wiped the loan with everything else: nothing to receive), -3 not loaded.
if not redis.call("GET", KEYS[1]) then
  return -3
end
if redis.call("GET", KEYS[3]) ~= ARGV[3] then
  return -2
end
if redis.call("HSETNX", KEYS[2], ARGV[1], ARGV[2]) == 0 then
  return 0
end
redis.call("INCRBY", KEYS[1], ARGV[2])
redis.call("INCR", KEYS[4])
return 1
