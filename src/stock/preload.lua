-- (Re)build an activity's Redis state from MySQL, as one atomic step.
--
-- KEYS[1] stock, KEYS[2] buyers, KEYS[3] pending, KEYS[4] res, KEYS[5] refunded,
-- KEYS[6] state, KEYS[7] epoch, KEYS[8] lent, KEYS[9] received, KEYS[10] restock
-- (bumped, never reset: the stock was set anew; see reserve.lua), KEYS[11] filter
-- (the buyers' Bloom filter, written anew with its header and a count of 0: see
-- filter.lua)
-- (Runs after filter.lua, which defines filter_add.)
-- (A split activity runs it once per shard, each with its share of the units and
-- of the buyers.)
-- ARGV[1] units still available in MySQL
-- ARGV[2] state ("open" | "paused")
-- ARGV[3] "force" to replace what is there unless it is selling (state "open":
--         the caller pauses it first, so a sale that reopened meanwhile is left
--         alone), "missing" to build only when the activity is not loaded (its
--         stock or state key is gone): a rebuild after a Redis loss can then never
--         wipe reservations made since
-- ARGV[4] the build's epoch (MySQL's count of builds)
-- ARGV[5] n, the number of buyer pairs that follow
-- ARGV[6 .. 5+2n] pairs: user id, reservation id, for every user holding an order
-- ARGV[6+2n ..] reservation ids of failed and cancelled orders: MySQL's available
--         count has their units already, so a late refund of one is a no-op
--
-- KEYS[12] removed: the marker a finished sale's removal leaves (see
-- StockStore::remove); with it, nothing is built
--
-- Returns 1 when built, 0 when "missing" found the activity loaded or "force"
-- found it selling, -1 when the sale's state was removed for good.
-- Running it twice gives the same state.
if redis.call("EXISTS", KEYS[12]) == 1 then
  return -1
end
if ARGV[3] == "missing" and redis.call("EXISTS", KEYS[1]) == 1 and redis.call("EXISTS", KEYS[6]) == 1 then
  return 0
end
if ARGV[3] == "force" and redis.call("GET", KEYS[6]) == "open" then
  return 0
end
redis.call("DEL", KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[8], KEYS[9])
redis.call("SET", KEYS[11], "\2\0\0\0\0")
local n = tonumber(ARGV[5])
for i = 6, 5 + 2 * n, 2 do
  if redis.call("HSET", KEYS[2], ARGV[i], ARGV[i + 1]) == 1 then
    filter_add(KEYS[11], redis.call("HLEN", KEYS[2]) - 1, ARGV[i])
  end
end
for i = 6 + 2 * n, #ARGV do
  redis.call("SADD", KEYS[5], ARGV[i])
end
redis.call("SET", KEYS[1], ARGV[1])
redis.call("SET", KEYS[6], ARGV[2])
redis.call("SET", KEYS[7], ARGV[4])
redis.call("INCR", KEYS[10])
return 1
