-- Seals the early joiners once the draw is due by Redis's clock: from here on
-- every join is late (join.lua), so the joiners read after this (a page at a
-- time: a million in one reply would stall Redis for seconds) are every early
-- joiner, and no join slips in between that read and the draw's commit. The arrival counter is raised to what MySQL knows was given (a room
-- rebuilt after a loss), so no ticket is given twice.
--
-- KEYS: joined, late, seq, queue, admitted, outcome, meta, journal, journal lock,
--       recorded (see RoomKeys)
-- ARGV[1] the draw is due at (ms), ARGV[2] the highest arrival number recorded
--
-- Returns {"due"}, or {"early"} before then.
if redis.call("HEXISTS", KEYS[7], "sealed") == 0 then
  local t = redis.call("TIME")
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  if now < tonumber(ARGV[1]) then
    return {"early"}
  end
  redis.call("HSET", KEYS[7], "sealed", "1")
end
local recorded = tonumber(ARGV[2])
if tonumber(redis.call("GET", KEYS[3]) or "0") < recorded then
  redis.call("SET", KEYS[3], recorded)
end
return {"due"}
