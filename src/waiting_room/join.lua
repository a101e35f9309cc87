
-- join.lua (after place.lua): a user joins the waiting room, once whatever the
-- retries, and hears their place in the same call.
--
-- ARGV[1] user id, ARGV[2] lost after (ms: a room neither sealed nor drawn by
--         then was lost with Redis), ARGV[3] starts_at (ms), ARGV[4] the place
--         offset of late joiners (behind every drawn place), ARGV[5] now (ms,
--         the instance's clock, as `status.lua` takes it), ARGV[6] a fresh
--         random token: with Redis's clock before it, the room's generation
--         if this join creates the room
--
-- Returns {1, ticket, "early" | "late", place…, generation} joined now, {0,
-- ticket, "early" | "late", place…, generation} joined before (2 instead of
-- 0: and MySQL is known to have recorded it, see `recorded` in RoomKeys), {-1, "", "", "none", "", -1,
-- -1, ""} the room is being rebuilt (try again shortly); place… is `place`'s
-- four values. The generation names this room's life in Redis: a room Redis
-- lost and a join created again has another (instances that remember joins
-- check it).
local function answer(code, seq, kind)
  local p = place(ARGV[1], tonumber(ARGV[5]))
  local gen = redis.call("HGET", KEYS[7], "gen") or ""
  return {code, seq, kind, p[1], p[2], p[3], p[4], gen}
end

local early = redis.call("ZSCORE", KEYS[1], ARGV[1])
local seq = early or redis.call("ZSCORE", KEYS[2], ARGV[1])
if seq then
  local recorded = redis.call("SISMEMBER", KEYS[10], ARGV[1]) == 1
  return answer(recorded and 2 or 0, seq, early and "early" or "late")
end
-- One clock for every instance: Redis's.
local t = redis.call("TIME")
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local sealed = redis.call("HEXISTS", KEYS[7], "sealed") == 1
if not sealed and now >= tonumber(ARGV[2]) then
  -- Past the draw and nothing of it here: Redis lost the room. Joining now
  -- would hand out arrival numbers again from 1; wait for the rebuild.
  return {-1, "", "", "none", "", -1, -1, ""}
end
seq = redis.call("INCR", KEYS[3])
-- The generation: Redis's clock first, so that a later room's is greater.
redis.call("HSETNX", KEYS[7], "gen", string.format("%010d%06d-%s", tonumber(t[1]), tonumber(t[2]), ARGV[6]))
-- Early only while the draw has not read the joiners yet (`sealed`, set in the
-- same step as that read): a join that runs after the read would be in no
-- draw, and never placed.
if now < tonumber(ARGV[3]) and not sealed then
  redis.call("ZADD", KEYS[1], seq, ARGV[1])
  redis.call("RPUSH", KEYS[8], "early\t" .. ARGV[1] .. "\t" .. seq)
  return answer(1, tostring(seq), "early")
end
-- Late: behind everyone drawn, in arrival order. Before the draw is
-- committed, the commit puts them there. Journalled, so that a room rebuilt
-- after Redis lost it still has them.
redis.call("ZADD", KEYS[2], seq, ARGV[1])
redis.call("RPUSH", KEYS[8], "late\t" .. ARGV[1] .. "\t" .. seq)
if redis.call("HEXISTS", KEYS[7], "seed") == 1 then
  redis.call("ZADD", KEYS[4], tonumber(ARGV[4]) + seq, ARGV[1])
end
return answer(1, tostring(seq), "late")
