-- Compare an activity's Redis stock with what MySQL implies, and optionally repair it.
--
-- KEYS[1] stock, KEYS[2] pending, KEYS[3] res, KEYS[4] refunded, KEYS[5] lent,
-- KEYS[6] received, KEYS[7] restock (bumped when a repair raises the stock)
-- ARGV[1] the activity's total stock
-- ARGV[2] units held by live orders in MySQL (pending_payment + paid)
-- ARGV[3] mode: "read", or "repair" to set the stock to the expected value, only
--         if stock and pending units still equal ARGV[4] and ARGV[5] (compare-and-set)
-- ARGV[4], ARGV[5] (repair only) the stock and pending units the read saw
-- ARGV[6..] pairs: reservation id, units, of failed or cancelled orders whose units
--         MySQL does not yet know to be back in Redis
--
-- Everything Redis knows is read here in one atomic step:
--   expected = total - live - pending units - units owed back (not yet refunded)
--              - units lent to sibling shards + units received from them
-- (For one shard of a split activity the caller passes as "total - live" what the
-- whole activity's count leaves for this shard once its siblings are counted.)
-- Returns {loaded (0/1), stock, pending units, owed units, expected, repaired (0/1),
--          units lent, units received}.
local stock = redis.call("GET", KEYS[1])
if not stock then
  return {0, 0, 0, 0, 0, 0, 0, 0}
end
stock = tonumber(stock)
local pending = 0
for _, rid in ipairs(redis.call("ZRANGE", KEYS[2], 0, -1)) do
  local detail = redis.call("HGET", KEYS[3], rid)
  if detail then
    -- "user|units|fate", read from the end: a user id may hold "|%d" itself.
    pending = pending + tonumber(string.match(detail, "|(%d+)|%a$") or string.match(detail, "|(%d+)$"))
  end
end
local owed = 0
for i = 6, #ARGV, 2 do
  if redis.call("SISMEMBER", KEYS[4], ARGV[i]) == 0 then
    owed = owed + tonumber(ARGV[i + 1])
  end
end
local lent = 0
for _, v in ipairs(redis.call("HVALS", KEYS[5])) do
  lent = lent + tonumber(string.match(v, "^(%d+)"))
end
local received = 0
for _, v in ipairs(redis.call("HVALS", KEYS[6])) do
  received = received + tonumber(v)
end
local expected = tonumber(ARGV[1]) - tonumber(ARGV[2]) - pending - owed - lent + received
local repaired = 0
if ARGV[3] == "repair" and stock ~= expected
   and stock == tonumber(ARGV[4]) and pending == tonumber(ARGV[5]) and expected >= 0 then
  redis.call("SET", KEYS[1], expected)
  if expected > stock then
    redis.call("INCR", KEYS[7])
  end
  repaired = 1
end
return {1, stock, pending, owed, expected, repaired, lent, received}
