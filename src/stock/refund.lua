-- Return a reservation's units to stock, exactly once.
--
-- KEYS[1] stock, KEYS[2] buyers, KEYS[3] pending, KEYS[4] res, KEYS[5] refunded (set),
-- KEYS[6] restock (bumped: units came back; see reserve.lua), KEYS[7] filter (its
-- count of buyers is lowered with a buyer removed; see filter.lua)
-- ARGV[1] reservation id, ARGV[2] user id, ARGV[3] quantity
-- ARGV[4] mode:
--   "undo"    the reservation was withdrawn before it reached anyone (its publish
--             failed, or MySQL recorded its withdrawal): only a reservation still
--             pending and never acknowledged is returned, and the user's purchase
--             right is given back
--   "return"  the order failed or was cancelled: the units go back, the user's
--             purchase right stays spent
--   "drop"    the reservation lost to another order of the same user: only a
--             reservation still pending here is returned (after a rebuild from
--             MySQL its unit is counted already); the right stays spent
--
-- Returns the units returned (> 0), or
--    0  already refunded (a second run changes nothing)
--   -1  nothing to undo: no such pending reservation
--   -2  (undo) it is acknowledged: a 202 was answered, it is not undone
--   -3  not loaded: the stock key is missing; the activity will be rebuilt from
--       MySQL, which is the count that matters, so nothing is lost
if redis.call("SISMEMBER", KEYS[5], ARGV[1]) == 1 then
  return 0
end
if not redis.call("GET", KEYS[1]) then
  return -3
end
if ARGV[4] == "undo" or ARGV[4] == "drop" then
  if not redis.call("ZSCORE", KEYS[3], ARGV[1]) then
    return -1
  end
end
if ARGV[4] == "undo" then
  -- An acknowledged reservation is a promise: it is never undone.
  local detail = redis.call("HGET", KEYS[4], ARGV[1])
  if detail and string.sub(detail, -2) == "|a" then
    return -2
  end
  if redis.call("HGET", KEYS[2], ARGV[2]) == ARGV[1] then
    redis.call("HDEL", KEYS[2], ARGV[2])
    if redis.call("EXISTS", KEYS[7]) == 1 then
      redis.call("BITFIELD", KEYS[7], "INCRBY", "i32", 8, -1)
    end
  end
end
local q = tonumber(ARGV[3])
redis.call("INCRBY", KEYS[1], q)
redis.call("INCR", KEYS[6])
redis.call("SADD", KEYS[5], ARGV[1])
redis.call("ZREM", KEYS[3], ARGV[1])
redis.call("HDEL", KEYS[4], ARGV[1])
return q
