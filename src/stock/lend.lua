-- Lend units to a sibling shard whose stock ran dry (split activities), as one
-- atomic step on the lender: the units leave its stock and are recorded as lent.
--
-- KEYS[1] stock, KEYS[2] lent (hash transfer id -> "units|to|ms|epoch", the
-- lender's epoch when lent; "|done" appended once received), KEYS[3] epoch,
-- KEYS[4] restock (see reserve.lua)
-- ARGV[1] transfer id, ARGV[2] units wanted, ARGV[3] the borrowing shard, ARGV[4] now (ms)
--
-- The borrower then receives them (`reserve.lua` with the transfer, or
-- `receive.lua` when the reconciler finishes a transfer its borrower left half
-- done). A unit is in exactly one place at every step: in a stock, or lent and
-- not yet received; the audit counts each shard as stock + pending + lent -
-- received, which no transfer changes.
--
-- Returns {units lent (0: none to lend), lender's epoch, lender's restock count},
-- or {-3, ""} when not loaded.
local stock = redis.call("GET", KEYS[1])
if not stock then
  return {-3, "", 0}
end
local epoch = redis.call("GET", KEYS[3]) or ""
local existing = redis.call("HGET", KEYS[2], ARGV[1])
if existing then
  return {tonumber(string.match(existing, "^(%d+)")), epoch, 0}
end
local n = math.min(tonumber(stock), tonumber(ARGV[2]))
if n <= 0 then
  return {0, epoch, tonumber(redis.call("GET", KEYS[4]) or "0")}
end
redis.call("DECRBY", KEYS[1], n)
redis.call("HSET", KEYS[2], ARGV[1], n .. "|" .. ARGV[3] .. "|" .. ARGV[4] .. "|" .. epoch)
return {n, epoch, 0}
