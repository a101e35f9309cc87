-- MySQL refused a reservation for lack of units: drop it, and lower the stock to
-- what MySQL still has, never raise it (refunding would resell a unit MySQL does
-- not have).
--
-- KEYS[1] stock, KEYS[2] buyers, KEYS[3] pending, KEYS[4] res, KEYS[5] refunded
-- ARGV[1] reservation id, ARGV[2] user id
-- ARGV[3] MySQL's available units when it refused (committed, under the lock)
-- ARGV[4] (split activities) the units the sibling shards still hold, stock and
--         pending, as read just before: they are MySQL's too
--
-- The cap is MySQL's available minus the units of reservations still pending here
-- (each will take its units from MySQL). Reservations MySQL already holds but not
-- yet confirmed here are counted twice, so the cap can be low, never high; the
-- reconciler's drift repair raises it once the consumers are drained.
-- Returns how many units the stock was lowered by, or -1 when already done.
if redis.call("SISMEMBER", KEYS[5], ARGV[1]) == 1 then
  return -1
end
redis.call("SADD", KEYS[5], ARGV[1])
redis.call("ZREM", KEYS[3], ARGV[1])
redis.call("HDEL", KEYS[4], ARGV[1])
if redis.call("HGET", KEYS[2], ARGV[2]) == ARGV[1] then
  redis.call("HDEL", KEYS[2], ARGV[2])
end
local stock = redis.call("GET", KEYS[1])
if not stock then
  return 0
end
stock = tonumber(stock)
local pending = 0
for _, rid in ipairs(redis.call("ZRANGE", KEYS[3], 0, -1)) do
  local detail = redis.call("HGET", KEYS[4], rid)
  if detail then
    pending = pending + tonumber(string.match(detail, "|(%d+)"))
  end
end
local cap = math.max(tonumber(ARGV[3]) - pending - tonumber(ARGV[4] or "0"), 0)
if stock > cap then
  redis.call("SET", KEYS[1], cap)
  return stock - cap
end
return 0
