-- Read a shard's buyers' filter for a sold-out gate, if it can be trusted.
--
-- KEYS[1] filter (see filter.lua), KEYS[2] buyers
--
-- Returns {1, filter} when its header has the format byte of a build (2) and its
-- count of buyers equals HLEN of `buyers` (every buyer there was added with its
-- bits), else {0, ""}: only the 5 header bytes are read, so a sale without a
-- usable filter costs a few bytes, not the whole filter.
local head = redis.call("GETRANGE", KEYS[1], 0, 4)
if #head < 5 or string.byte(head, 1) ~= 2 then
  return {0, ""}
end
local b1, b2, b3, b4 = string.byte(head, 2, 5)
local count = ((b1 * 256 + b2) * 256 + b3) * 256 + b4
if count >= 2147483648 then
  count = count - 4294967296
end
if count ~= redis.call("HLEN", KEYS[2]) then
  return {0, ""}
end
return {1, redis.call("GET", KEYS[1])}
