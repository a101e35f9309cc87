-- Reserve units for one user in one activity, as one atomic step.
--
-- KEYS[1] stock     (string, integer)   units Redis may still hand out
-- KEYS[2] buyers    (hash user -> reservation id)   purchase rights spent
-- KEYS[3] pending   (zset reservation id, score = reserved-at ms)   not yet in MySQL
-- KEYS[4] res       (hash reservation id -> "user_id|quantity|fate")   reservation details;
--                   fate: "p" published or not yet known, "a" acknowledged (a 202 was
--                   answered: it must become an order), "w" being withdrawn (see fate.lua)
-- KEYS[5] state     (string "open" | "paused")
-- KEYS[6] received  (hash transfer id -> units)   units received from sibling shards
-- KEYS[7] epoch     (string)   which build from MySQL this state is
-- KEYS[8] restock   (counter)  bumped whenever units are added to `stock`: a
--                   sold-out answer carries it, so an instance that keeps the
--                   sale shut in memory knows when to look again
-- ARGV[1] user id, ARGV[2] quantity (>= 1), ARGV[3] new reservation id, ARGV[4] now (ms)
-- ARGV[5], ARGV[6], ARGV[7] (optional, split activities) a transfer from a sibling
--         shard to receive first: its id, its units, the lender's epoch. Received
--         once whatever the retries, and only into the same build it was lent
--         from (a rebuild in between wiped the loan with everything else).
--
-- Returns {code, value, restock}:
--   { 1, reservation_id }  reserved
--   { 0, reservation_id }  this user already holds a reservation (the existing id)
--   {-1, units left, restock }  sold out here (fewer units left than asked for)
--   {-3, "" }              not loaded: a key is missing; never read as "sold out"
--   {-4, "" }              paused
local state = redis.call("GET", KEYS[5])
if not state then
  return {-3, "", 0}
end
local stock = redis.call("GET", KEYS[1])
if not stock then
  return {-3, "", 0}
end
if ARGV[5] and redis.call("GET", KEYS[7]) == ARGV[7]
   and redis.call("HSETNX", KEYS[6], ARGV[5], ARGV[6]) == 1 then
  stock = redis.call("INCRBY", KEYS[1], ARGV[6])
  redis.call("INCR", KEYS[8])
end
if state == "paused" then
  return {-4, "", 0}
end
local existing = redis.call("HGET", KEYS[2], ARGV[1])
if existing then
  return {0, existing, 0}
end
local q = tonumber(ARGV[2])
if tonumber(stock) < q then
  return {-1, tostring(stock), tonumber(redis.call("GET", KEYS[8]) or "0")}
end
redis.call("DECRBY", KEYS[1], q)
redis.call("HSET", KEYS[2], ARGV[1], ARGV[3])
redis.call("ZADD", KEYS[3], ARGV[4], ARGV[3])
redis.call("HSET", KEYS[4], ARGV[3], ARGV[1] .. "|" .. ARGV[2] .. "|p")
return {1, ARGV[3], 0}
