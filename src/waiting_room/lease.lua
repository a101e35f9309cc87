-- The draw's lease: taken when free (or held by this token already) and
-- renewed, so one instance at a time writes and records a draw, and another
-- takes over within the lease when it dies; let go once the draw is done or
-- stopped.
--
-- KEYS[1] the draw's lease
-- ARGV[1] token, ARGV[2] lease ms, ARGV[3] "take" (take it when free),
-- "renew" (only renew it) or "release"
--
-- Returns 1 held by this token now (released: it was), 0 held by another (or
-- lost).
local holder = redis.call("GET", KEYS[1])
if ARGV[3] == "release" then
  if holder == ARGV[1] then
    redis.call("DEL", KEYS[1])
    return 1
  end
  return 0
end
if holder == ARGV[1] or (not holder and ARGV[3] == "take") then
  redis.call("SET", KEYS[1], ARGV[1], "PX", tonumber(ARGV[2]))
  return 1
end
return 0
