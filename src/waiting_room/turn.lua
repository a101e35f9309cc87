-- Whether a user may reserve now: admitted and within their turn, or already
-- settled `reserved` (they then hear `already_reserved` from the reserve script).
--
-- KEYS: joined, late, seq, queue, admitted, outcome, meta, journal, journal lock,
--       recorded (see RoomKeys)
-- ARGV[1] user id, ARGV[2] now (ms)
--
-- Returns 1 (may reserve), 2 (their turn ran out: they may still hold a
-- reservation made in it, answered after its end) or 0 (not admitted).
local outcome = redis.call("HGET", KEYS[6], ARGV[1])
if outcome == "reserved" then
  return 1
elseif outcome == "expired" then
  return 2
end
local until_ms = redis.call("ZSCORE", KEYS[5], ARGV[1])
if until_ms then
  if tonumber(until_ms) >= tonumber(ARGV[2]) then
    return 1
  end
  -- Ran out, not yet settled by the admission step.
  return 2
end
return 0
