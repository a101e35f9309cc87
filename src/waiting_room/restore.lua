-- Part of a room rebuilt after Redis lost it, before it is sealed and its draw
-- is written: the joiners (early ones too, for a room lost before its draw),
-- the settled turns (a user who reserved, a turn that ran out, a turn given
-- whose end has passed by Redis's clock), as MySQL recorded them (the
-- journal, the orders). The draw then leaves settled users out of the line,
-- and the commit queues the late joiners behind the drawn again. Running
-- this twice changes nothing.
--
-- KEYS: joined, late, seq, queue, admitted, outcome, meta, journal, journal lock,
--       recorded (see RoomKeys)
-- ARGV[1..] triples: user, `early` | `late` | `admitted` | `reserved` |
--           `expired`, arrival number (early and late) or the turn's end in
--           ms (admitted); other kinds are ignored
--
-- Returns 0 when the draw was committed before (nothing written), 1 otherwise.
if redis.call("HEXISTS", KEYS[7], "seed") == 1 then
  return 0
end
local last_seq = tonumber(redis.call("GET", KEYS[3]) or "0")
local t = redis.call("TIME")
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i = 1, #ARGV, 3 do
  local user, what = ARGV[i], ARGV[i + 1]
  if what == "early" or what == "late" then
    -- From MySQL: recorded (joining again costs it nothing).
    redis.call("SADD", KEYS[10], user)
  end
  if what == "early" then
    local seq = tonumber(ARGV[i + 2])
    if not redis.call("ZSCORE", KEYS[1], user) and not redis.call("ZSCORE", KEYS[2], user) then
      redis.call("ZADD", KEYS[1], seq, user)
    end
    if seq > last_seq then
      last_seq = seq
    end
  elseif what == "late" then
    local seq = tonumber(ARGV[i + 2])
    -- The recorded arrival number wins over one given while the room was
    -- being rebuilt.
    if not redis.call("ZSCORE", KEYS[1], user) then
      redis.call("ZADD", KEYS[2], seq, user)
    end
    if seq > last_seq then
      last_seq = seq
    end
  elseif what == "admitted" then
    -- A turn given before the loss, ending at ARGV[i + 2]: by now run out
    -- unless its user reserved (a turn still running is given again whole).
    if tonumber(ARGV[i + 2]) <= now and not redis.call("HGET", KEYS[6], user) then
      redis.call("HSET", KEYS[6], user, "expired")
    end
  elseif (what == "reserved" or what == "expired") and redis.call("HGET", KEYS[6], user) ~= "reserved" then
    redis.call("HSET", KEYS[6], user, what)
  end
end
redis.call("SET", KEYS[3], last_seq)
return 1
