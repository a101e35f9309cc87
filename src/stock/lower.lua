-- MySQL refused a reservation for lack of units: drop it, and lower the stock to
-- what MySQL still has, never raise it (refunding would resell a unit MySQL does
-- not have).
--
-- KEYS[1] stock, KEYS[2] buyers, KEYS[3] pending, KEYS[4] res, KEYS[5] refunded,
-- KEYS[6] lent, KEYS[7] received, KEYS[8] filter (its count of buyers is lowered
-- with a buyer removed; see filter.lua)
-- ARGV[1] reservation id, ARGV[2] user id
-- ARGV[3] MySQL's available units when it refused (committed, under the lock)
-- ARGV[4] (split activities) the units the sibling shards account for, as read
--         just before: stock, pending, owed back and lent minus received (see
--         audit.lua); they are MySQL's too
-- ARGV[5..] pairs: reservation (or top-up) id, units, of what MySQL counts in its
--         available units and Redis is still owed on this shard (lapses and
--         failures not yet refunded, top-ups not yet added), read after ARGV[3]
--
-- The cap is MySQL's available minus every unit this shard is still to account
-- for besides its stock: reservations pending here (each will take its units
-- from MySQL), units owed back here (each refund adds them to the stock later),
-- and units lent minus received (a unit in transit lands in some shard's stock).
-- Reservations MySQL already holds but not yet confirmed here are counted twice,
-- and an owed unit read after ARGV[3] may not be in it yet, so the cap can be
-- low, never high; the reconciler's drift repair raises it once no
-- reservation pending here is an order MySQL holds and Redis has not settled.
-- Returns how many units the stock was lowered by, or -1 when already done.
-- A state that is not loaded (lost, or removed after the sale's retention) is
-- left as it is, with no key written: a rebuild reads MySQL, and a removed sale
-- stays removed.
local stock = redis.call("GET", KEYS[1])
if not stock then
  return 0
end
if redis.call("SISMEMBER", KEYS[5], ARGV[1]) == 1 then
  return -1
end
redis.call("SADD", KEYS[5], ARGV[1])
redis.call("ZREM", KEYS[3], ARGV[1])
redis.call("HDEL", KEYS[4], ARGV[1])
if redis.call("HGET", KEYS[2], ARGV[2]) == ARGV[1] then
  redis.call("HDEL", KEYS[2], ARGV[2])
  if redis.call("EXISTS", KEYS[8]) == 1 then
    redis.call("BITFIELD", KEYS[8], "INCRBY", "i32", 8, -1)
  end
end
stock = tonumber(stock)
local pending = 0
for _, rid in ipairs(redis.call("ZRANGE", KEYS[3], 0, -1)) do
  local detail = redis.call("HGET", KEYS[4], rid)
  if detail then
    -- "user|units|fate", read from the end: a user id may hold "|%d" itself.
    pending = pending + tonumber(string.match(detail, "|(%d+)|%a$") or string.match(detail, "|(%d+)$"))
  end
end
local owed = 0
for i = 5, #ARGV, 2 do
  if redis.call("SISMEMBER", KEYS[5], ARGV[i]) == 0 then
    owed = owed + tonumber(ARGV[i + 1])
  end
end
local lent = 0
for _, v in ipairs(redis.call("HVALS", KEYS[6])) do
  lent = lent + tonumber(string.match(v, "^(%d+)"))
end
local received = 0
for _, v in ipairs(redis.call("HVALS", KEYS[7])) do
  received = received + tonumber(v)
end
local cap = math.max(tonumber(ARGV[3]) - pending - owed - lent + received - tonumber(ARGV[4] or "0"), 0)
if stock > cap then
  redis.call("SET", KEYS[1], cap)
  return stock - cap
end
return 0
