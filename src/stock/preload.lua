-- (Re)build an activity's Redis state from MySQL, as one atomic step.
--
-- KEYS[1] stock, KEYS[2] buyers, KEYS[3] pending, KEYS[4] res, KEYS[5] refunded, KEYS[6] state
-- ARGV[1] units still available in MySQL
-- ARGV[2] state ("open" | "paused")
-- ARGV[3..] pairs: user id, reservation id, for every user holding an order
--
-- Everything of the activity is replaced; running it twice gives the same state.
redis.call("DEL", KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6])
for i = 3, #ARGV, 2 do
  redis.call("HSET", KEYS[2], ARGV[i], ARGV[i + 1])
end
redis.call("SET", KEYS[1], ARGV[1])
redis.call("SET", KEYS[6], ARGV[2])
return tonumber(ARGV[1])
