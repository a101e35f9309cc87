-- One admission step: turns that ran out are settled `expired`; then as many
-- users as there are units left, minus those admitted already, are admitted in
-- queue order (each turn journalled with its end). While no unit can come back the room is closed: everyone still
-- waiting is told `sold_out` (see status.lua). That is not final: once units
-- come back (a top-up, a lapse refunded, a repair) the next step reopens it and
-- the line moves on from where it stood.
--
-- KEYS: joined, late, seq, queue, admitted, outcome, meta, journal, journal lock,
--       recorded (see RoomKeys)
-- ARGV[1] now (ms), ARGV[2] units left, ARGV[3] "1" when no unit can come back,
-- ARGV[4] admitted until (ms) for those admitted now, ARGV[5] the sale's end
-- (ms): from then on, by Redis's clock, the room stays closed (`ended`)
--
-- Returns {admitted and unsettled, admitted now, expired now, the room's mark
-- after the step: generation, admitted total, left total, 1 when closed (see
-- status.lua), and the Redis process that ran it (its run_id)}; the
-- generation is "" before the draw is committed.
local function mark(reply)
  local meta = redis.call("HMGET", KEYS[7], "gen", "admitted", "left", "closed")
  reply[4] = meta[1] or ""
  reply[5] = tonumber(meta[2] or "0")
  reply[6] = tonumber(meta[3] or "0")
  reply[7] = meta[4] and 1 or 0
  reply[8] = string.match(redis.call("INFO", "server"), "run_id:(%x+)") or ""
  return reply
end
if redis.call("HEXISTS", KEYS[7], "seed") == 0 then
  return {0, 0, 0, "", 0, 0, 0, ""}
end
local gone = redis.call("ZRANGEBYSCORE", KEYS[5], "-inf", "(" .. ARGV[1])
for _, user in ipairs(gone) do
  redis.call("ZREM", KEYS[5], user)
  redis.call("HSET", KEYS[6], user, "expired")
  redis.call("RPUSH", KEYS[8], "expired\t" .. user)
end
if #gone > 0 then
  redis.call("HINCRBY", KEYS[7], "expired", #gone)
end
local outstanding = redis.call("ZCARD", KEYS[5])
local t = redis.call("TIME")
if tonumber(t[1]) * 1000 >= tonumber(ARGV[5]) then
  redis.call("HSET", KEYS[7], "ended", "1")
end
if ARGV[3] == "1" or redis.call("HEXISTS", KEYS[7], "ended") == 1 then
  redis.call("HSET", KEYS[7], "closed", "1")
  return mark({outstanding, 0, #gone})
end
redis.call("HDEL", KEYS[7], "closed")
local room = tonumber(ARGV[2]) - outstanding
local admitted = 0
if room > 0 then
  local next = redis.call("ZPOPMIN", KEYS[4], room)
  for i = 1, #next, 2 do
    -- A user settled already (by an instance's restore that ran after the
    -- one that queued them, while a lost room was rebuilt) gets no turn.
    if redis.call("HEXISTS", KEYS[6], next[i]) == 0 then
      redis.call("ZADD", KEYS[5], ARGV[4], next[i])
      -- Journalled with its end: a rebuilt room knows the turn ran out even
      -- if its `expired` entry is lost with Redis before it is copied.
      redis.call("RPUSH", KEYS[8], "admitted\t" .. next[i] .. "\t" .. ARGV[4])
      admitted = admitted + 1
    end
  end
  if admitted > 0 then
    redis.call("HINCRBY", KEYS[7], "admitted", admitted)
  end
end
return mark({outstanding + admitted, admitted, #gone})
