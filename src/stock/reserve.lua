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
-- KEYS[9] filter    (string)   the buyers' Bloom filter (see filter.lua): the
--                   buyer is added in the same step as to `buyers`
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
-- filter.lua, verbatim (this script is also run on its own, by the benchmark;
-- a unit test keeps the copy exact):
-- The buyers' filter: a Bloom filter of the users in `buyers`, kept by every
-- script that records a buyer (prefixed to preload.lua and confirm.lua, copied
-- into reserve.lua), so that a shut sold-out gate can tell "certainly not a
-- buyer" from memory without copying the buyers out of Redis.
--
-- The key (string) is a header, then layers of bits. The header is a format byte,
-- 2 when the filter was written by a build (preload.lua; a filter recreated by
-- anything else, or by a version with another layout, lacks it), then the count
-- of buyers added (a signed 32-bit integer, big-endian), bumped in the same
-- BITFIELD call that sets a buyer's bits and lowered by the scripts that remove a
-- buyer (refund.lua, lower.lua). A gate trusts the filter only when the count
-- equals HLEN of `buyers`, read in the same atomic step (filter_read.lua): a
-- buyer recorded by code that sets no bits (an older version during a rolling
-- deploy) makes them differ. Layer i holds buyers
-- number FILTER_BASE * (2^i - 1) to FILTER_BASE * (2^(i+1) - 1) - 1 of the shard
-- (their count in `buyers` when recorded) in FILTER_BITS bits per buyer, so it
-- grows with the units sold, never with the users who asked. A buyer sets
-- FILTER_HASHES bits of its layer: h1 + j * h2 modulo the layer's size, h1 and
-- h2 (made odd) the first two 32-bit words of sha1(user id), big-endian. Bits
-- are never cleared (a refunded buyer stays "maybe": a false positive, which
-- only sends that user to Redis). `src/stock/filter.rs` reads it the same way.
local FILTER_HEADER_BITS = 40
local FILTER_BASE = 1024
local FILTER_BITS = 16
local FILTER_HASHES = 8
local FILTER_LAYERS = 16

local function filter_add(key, n, user)
  local off, cap, layer = FILTER_HEADER_BITS, FILTER_BASE, 0
  while n >= cap and layer < FILTER_LAYERS - 1 do
    n = n - cap
    off = off + cap * FILTER_BITS
    cap = cap * 2
    layer = layer + 1
  end
  local size = cap * FILTER_BITS
  local h = redis.sha1hex(user)
  local h1 = tonumber(string.sub(h, 1, 8), 16)
  local h2 = tonumber(string.sub(h, 9, 16), 16)
  if h2 % 2 == 0 then
    h2 = h2 + 1
  end
  local args = {"INCRBY", "i32", 8, 1}
  for j = 0, FILTER_HASHES - 1 do
    local bit = off + (h1 + j * h2) % size
    args[#args + 1] = "SET"
    args[#args + 1] = "u1"
    args[#args + 1] = string.format("%d", bit)
    args[#args + 1] = 1
  end
  redis.call("BITFIELD", key, unpack(args))
end

-- State, stock and restock count in one read.
local now = redis.call("MGET", KEYS[5], KEYS[1], KEYS[8])
local state, stock, restock = now[1], now[2], now[3]
if not state or not stock then
  return {-3, "", 0}
end
if ARGV[5] and redis.call("GET", KEYS[7]) == ARGV[7]
   and redis.call("HSETNX", KEYS[6], ARGV[5], ARGV[6]) == 1 then
  stock = redis.call("INCRBY", KEYS[1], ARGV[6])
  restock = redis.call("INCR", KEYS[8])
end
-- A buyer is told what they hold even while the sale is paused: a retry whose
-- first answer was lost must learn of its reservation, not read "nothing held".
local existing = redis.call("HGET", KEYS[2], ARGV[1])
if existing then
  return {0, existing, 0}
end
if state == "paused" then
  return {-4, "", 0}
end
local q = tonumber(ARGV[2])
if tonumber(stock) < q then
  return {-1, tostring(stock), tonumber(restock or "0")}
end
redis.call("DECRBY", KEYS[1], q)
redis.call("HSET", KEYS[2], ARGV[1], ARGV[3])
filter_add(KEYS[9], redis.call("HLEN", KEYS[2]) - 1, ARGV[1])
redis.call("ZADD", KEYS[3], ARGV[4], ARGV[3])
redis.call("HSET", KEYS[4], ARGV[3], ARGV[1] .. "|" .. ARGV[2] .. "|p")
return {1, ARGV[3], 0}
