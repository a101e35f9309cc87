-- Clear the pending marks of reservations MySQL now holds as orders, and adopt any
-- order this Redis state does not know.
--
-- KEYS[1] stock, KEYS[2] buyers, KEYS[3] pending, KEYS[4] res
-- ARGV triples: reservation id, user id, quantity, for each order MySQL committed
--
-- An order whose user is not marked with its reservation here means Redis lost
-- the reservation (a failover to a replica that missed the write, or a rebuild
-- read before the order was committed): its unit is counted as for sale again.
-- The order is adopted: the buyer is marked and its units leave the stock (never
-- below 0), so Redis does not sell what MySQL has already given away.
--
-- Returns the number of orders adopted (0 in the normal case).
local loaded = redis.call("GET", KEYS[1])
local adopted = 0
for i = 1, #ARGV, 3 do
  local rid, user, q = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  redis.call("ZREM", KEYS[3], rid)
  redis.call("HDEL", KEYS[4], rid)
  if loaded and redis.call("HGET", KEYS[2], user) ~= rid then
    redis.call("HSET", KEYS[2], user, rid)
    local stock = tonumber(redis.call("GET", KEYS[1]))
    local take = math.min(stock, q)
    if take > 0 then
      redis.call("DECRBY", KEYS[1], take)
    end
    adopted = adopted + 1
  end
end
return adopted
