-- What Redis can answer of a user's reservation status without MySQL
-- (`GET /flash/{sku}/reservation`): a reservation still pending, or the view of
-- the user's order that an earlier poll cached, if the order has not changed
-- since.
--
-- KEYS[1] stock, KEYS[2] buyers, KEYS[3] pending, KEYS[4] views, KEYS[5] epoch
-- (the user's home shard)
-- ARGV[1] user id
--
-- `views` holds, per user, `v:<user>` (the view's version: bumped to odd when
-- the order begins to change, to even when the change is committed; see
-- view_change.lua) and `o:<user>` ("<epoch>|<version>\n<view>", written by
-- view_fill.lua).
--
-- Returns {kind, value, token}:
--   {"pending", reservation id, ""}   the reservation still waits for MySQL
--   {"view", cached view, token}      the order's view, unchanged since cached
--   {"miss", reservation id or "", token}   ask MySQL; `token` ("<epoch>|<version>",
--                                      "" when the state is not loaded) is what
--                                      view_fill.lua checks before it caches
local rid = redis.call("HGET", KEYS[2], ARGV[1])
if rid and redis.call("ZSCORE", KEYS[3], rid) then
  return {"pending", rid, ""}
end
if redis.call("EXISTS", KEYS[1]) == 0 then
  return {"miss", rid or "", ""}
end
local version = redis.call("HGET", KEYS[4], "v:" .. ARGV[1]) or "0"
local token = (redis.call("GET", KEYS[5]) or "") .. "|" .. version
if tonumber(version) % 2 == 0 then
  local cached = redis.call("HGET", KEYS[4], "o:" .. ARGV[1])
  if cached then
    local at = string.find(cached, "\n", 1, true)
    if at and string.sub(cached, 1, at - 1) == token then
      return {"view", string.sub(cached, at + 1), token}
    end
  end
end
return {"miss", rid or "", token}
