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

