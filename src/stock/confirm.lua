-- Clear the pending marks of reservations MySQL now holds as orders, and adopt any
-- order this Redis state does not know.
-- (Runs after filter.lua, which defines filter_add.)
--
-- KEYS[1] stock, KEYS[2] buyers, KEYS[3] pending, KEYS[4] res, KEYS[5] filter (the
-- buyers' Bloom filter: an adopted buyer is added to it, see filter.lua), KEYS[6]
-- restock (bumped when a buyer is adopted: an instance keeping the sale shut in
-- memory reads the filter again, so the adopted buyer is not told sold_out)
-- ARGV triples: reservation id, user id, quantity, for each order MySQL committed
--
-- An order whose user is not marked with its reservation here means Redis lost
-- the reservation (a failover to a replica that missed the write, or a rebuild
-- read before the order was committed): its unit is counted as for sale again.
-- The order is adopted: the buyer is marked and its units leave the stock (never
-- below 0), so Redis does not sell what MySQL has already given away.
--
-- A batch costs the same few commands whatever its size: one ZREM, one HDEL and
-- one HMGET for every CHUNK orders; only an adoption (rare) costs more.
--
-- Returns the number of orders adopted (0 in the normal case).
local CHUNK = 1000
local loaded = redis.call("GET", KEYS[1])
local adopted = 0
for first = 1, #ARGV, 3 * CHUNK do
  local last = math.min(#ARGV, first + 3 * CHUNK - 1)
  local rids, users = {}, {}
  for i = first, last, 3 do
    rids[#rids + 1] = ARGV[i]
    users[#users + 1] = ARGV[i + 1]
  end
  redis.call("ZREM", KEYS[3], unpack(rids))
  redis.call("HDEL", KEYS[4], unpack(rids))
  if loaded then
    local held = redis.call("HMGET", KEYS[2], unpack(users))
    for j = 1, #rids do
      local rid, user, q = rids[j], users[j], tonumber(ARGV[first + 3 * (j - 1) + 2])
      -- Read again before adopting: an order repeated in the batch was adopted
      -- by its first copy already.
      if held[j] ~= rid and redis.call("HGET", KEYS[2], user) ~= rid then
        if redis.call("HSET", KEYS[2], user, rid) == 1 then
          filter_add(KEYS[5], redis.call("HLEN", KEYS[2]) - 1, user)
        end
        redis.call("INCR", KEYS[6])
        local stock = tonumber(redis.call("GET", KEYS[1]))
        local take = math.min(stock, q)
        if take > 0 then
          redis.call("DECRBY", KEYS[1], take)
        end
        adopted = adopted + 1
      end
    end
  end
end
return adopted
