-- Move a pending reservation to its next fate, as one atomic step.
--
-- KEYS[1] res (hash reservation id -> "user_id|quantity|fate")
-- ARGV[1] reservation id
-- ARGV[2] "ack": its message is in the queue and the client is about to get a 202;
--               from now on nobody may withdraw it (the reconciler honours it)
--         "withdraw": it is being withdrawn (its publish failed or timed out, or
--               the reconciler found it stale); from now on no 202 may be answered
--               for it, and MySQL decides between its order and its withdrawal
--
-- Exactly one of the two ever succeeds for a reservation. Returns
--    1  done (or already in that fate)
--    0  refused: it is already in the other fate
--   -1  unknown: no such pending reservation (decided already, or Redis lost it)
local detail = redis.call("HGET", KEYS[1], ARGV[1])
if not detail then
  return -1
end
local head, fate = string.match(detail, "^(.*)|(%a)$")
if not fate then
  -- Written before fates existed: pending.
  head, fate = detail, "p"
end
local want = "w"
if ARGV[2] == "ack" then
  want = "a"
end
if fate == want then
  return 1
end
if fate ~= "p" then
  return 0
end
redis.call("HSET", KEYS[1], ARGV[1], head .. "|" .. want)
return 1
