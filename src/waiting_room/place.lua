-- place(user, now): where a user stands, with the room's counters read in the
-- same step, so that an instance can answer this user's later polls from
-- memory while those counters have not moved (see view.rs). Shared by
-- status.lua and join.lua (prepended to each).
--
-- KEYS: joined, late, seq, queue, admitted, outcome, meta, journal, journal lock
--       (see RoomKeys)
--
-- Returns {state, arrival number, users ahead (-1: not placed yet or not
-- waiting), admitted until ms (-1: not admitted), the room's generation,
-- turns given so far, places moved otherwise}; state "none" when never joined.
local function place(user, now)
  local m = redis.call("HMGET", KEYS[7], "gen", "admitted", "moved", "closed")
  local gen, given, moved = m[1] or "", tonumber(m[2] or "0"), tonumber(m[3] or "0")
  local function answer(state, seq, ahead, until_ms)
    return {state, seq, ahead, until_ms, gen, given, moved}
  end
  local seq = redis.call("ZSCORE", KEYS[1], user) or redis.call("ZSCORE", KEYS[2], user)
  if not seq then
    return answer("none", "", -1, -1)
  end
  local outcome = redis.call("HGET", KEYS[6], user)
  if outcome == "reserved" then
    return answer("admitted", seq, -1, -1)
  elseif outcome then
    return answer(outcome, seq, -1, -1)
  end
  local until_ms = redis.call("ZSCORE", KEYS[5], user)
  if until_ms then
    if tonumber(until_ms) < now then
      return answer("expired", seq, -1, -1)
    end
    return answer("admitted", seq, -1, tonumber(until_ms))
  end
  if m[4] then
    return answer("sold_out", seq, -1, -1)
  end
  local rank = redis.call("ZRANK", KEYS[4], user)
  if rank then
    return answer("waiting", seq, rank, -1)
  end
  return answer("waiting", seq, -1, -1)
end
