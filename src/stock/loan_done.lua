-- Mark a loan between stock shards received, on its lender (split activities).
--
-- KEYS[1] lent (hash transfer id -> "units|to|ms|epoch[|done]"), KEYS[2] epoch
-- ARGV[1] transfer id, ARGV[2] the loan's record as read, ARGV[3] the epoch it was
--         lent in
--
-- Only while the lender is still the build it lent from and still holds the very
-- record that was read: a rebuild in between wiped the loan with everything else
-- and counted its units from MySQL, so writing it back would make a loan nobody
-- receives (the audit would count its units in transit forever, and the drift
-- repair would take them out of the stock).
-- Returns 1 marked now, 0 left alone (another build, or the record changed).
if (redis.call("GET", KEYS[2]) or "") ~= ARGV[3] then
  return 0
end
if redis.call("HGET", KEYS[1], ARGV[1]) ~= ARGV[2] then
  return 0
end
redis.call("HSET", KEYS[1], ARGV[1], ARGV[2] .. "|done")
return 1
