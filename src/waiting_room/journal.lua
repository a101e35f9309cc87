-- The journal's oldest entries, for the one instance that copies them to MySQL
-- now: it takes the lock (ARGV[1], for ARGV[2] ms) or gets nothing. With
-- ARGV[3] = "trim" instead, the holder drops the first ARGV[4] entries it
-- copied and lets the lock go; a holder whose lock ran out (another instance
-- may have copied and dropped the same entries) drops nothing.
--
-- KEYS: joined, late, seq, queue, admitted, outcome, meta, journal, journal lock,
--       recorded (see RoomKeys)
-- ARGV[1] token, ARGV[2] lock ms, ARGV[3] "take" | "trim", ARGV[4] how many
--
-- Returns the entries taken (take), or {n} the entries dropped (trim).
if ARGV[3] == "trim" then
  if redis.call("GET", KEYS[9]) ~= ARGV[1] then
    return {0}
  end
  redis.call("LTRIM", KEYS[8], tonumber(ARGV[4]), -1)
  redis.call("DEL", KEYS[9])
  return {tonumber(ARGV[4])}
end
if redis.call("LLEN", KEYS[8]) == 0 then
  return {}
end
if not redis.call("SET", KEYS[9], ARGV[1], "NX", "PX", tonumber(ARGV[2])) then
  return {}
end
return redis.call("LRANGE", KEYS[8], 0, tonumber(ARGV[4]) - 1)
