-- A user joins the waiting room: once, whatever the retries; the answer
-- carries their place too, so a join is one script call (place.lua is
-- prepended).
--
-- KEYS: joined, late, seq, queue, admitted, outcome, meta, journal, journal lock
--       (see RoomKeys)
-- ARGV[1] user id, ARGV[2] lost after (ms: a room neither sealed nor drawn by
--         then was lost with Redis), ARGV[3] starts_at (ms), ARGV[4] the place
--         offset of late joiners (behind every drawn place), ARGV[5] now (ms,
--         the instance's clock, as status.lua takes it)
--
-- Returns {1, "early" | "late", place…} joined now, {0, "", place…} joined
-- before, {-1, "", "none", …} the room is being rebuilt (try again shortly);
-- place… is place.lua's answer.
local user = ARGV[1]
local now_ms = tonumber(ARGV[5])
local function with(code, kind, p)
  return {code, kind, p[1], p[2], p[3], p[4], p[5], p[6], p[7]}
end
if redis.call("ZSCORE", KEYS[1], user) or redis.call("ZSCORE", KEYS[2], user) then
  return with(0, "", place(user, now_ms))
end
-- One clock for every instance: Redis's.
local t = redis.call("TIME")
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local sealed = redis.call("HEXISTS", KEYS[7], "sealed") == 1
if not sealed and now >= tonumber(ARGV[2]) then
  -- Past the draw and nothing of it here: Redis lost the room. Joining now
  -- would hand out arrival numbers again from 1; wait for the rebuild.
  return {-1, "", "none", "", -1, -1, "", 0, 0}
end
-- This room's generation in Redis: a room rebuilt after a loss has another,
-- so no instance answers from what it learnt of the lost one.
redis.call("HSETNX", KEYS[7], "gen", t[1] .. "." .. t[2])
local seq = redis.call("INCR", KEYS[3])
-- Early only while the draw has not read the joiners yet (`sealed`, set in the
-- same step as that read): a join that runs after the read would be in no
-- draw, and never placed.
if now < tonumber(ARGV[3]) and not sealed then
  redis.call("ZADD", KEYS[1], seq, user)
  redis.call("RPUSH", KEYS[8], "early\t" .. user .. "\t" .. seq)
  return with(1, "early", place(user, now_ms))
end
-- Late: behind everyone drawn, in arrival order. Until every drawn place is
-- written, the draw's last chunk puts them there (draw.lua). Journalled, so
-- that a room rebuilt after Redis lost it still has them.
redis.call("ZADD", KEYS[2], seq, user)
redis.call("RPUSH", KEYS[8], "late\t" .. user .. "\t" .. seq)
if redis.call("HEXISTS", KEYS[7], "complete") == 1 then
  redis.call("ZADD", KEYS[4], tonumber(ARGV[4]) + seq, user)
end
return with(1, "late", place(user, now_ms))
