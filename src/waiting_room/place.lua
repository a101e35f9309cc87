-- A user's place in the waiting room: the function `place` that `status.lua`
-- and `join.lua` both call (each script is this file followed by its own).
--
-- KEYS: joined, late, seq, queue, admitted, outcome, meta, journal, journal lock,
--       recorded (see RoomKeys)
--
-- place(user, now ms) returns {state, ticket, users ahead (-1: not drawn yet or
-- not waiting), admitted until ms (-1: not admitted)}; state "none" when never
-- joined.
local function place(user, now)
  local seq = redis.call("ZSCORE", KEYS[1], user) or redis.call("ZSCORE", KEYS[2], user)
  if not seq then
    return {"none", "", -1, -1}
  end
  local outcome = redis.call("HGET", KEYS[6], user)
  if outcome == "reserved" then
    return {"admitted", seq, -1, -1}
  elseif outcome then
    return {outcome, seq, -1, -1}
  end
  local until_ms = redis.call("ZSCORE", KEYS[5], user)
  if until_ms then
    if tonumber(until_ms) < now then
      return {"expired", seq, -1, -1}
    end
    return {"admitted", seq, -1, tonumber(until_ms)}
  end
  if redis.call("HEXISTS", KEYS[7], "closed") == 1 then
    return {"sold_out", seq, -1, -1}
  end
  local rank = redis.call("ZRANK", KEYS[4], user)
  if rank then
    return {"waiting", seq, rank, -1}
  end
  return {"waiting", seq, -1, -1}
end
