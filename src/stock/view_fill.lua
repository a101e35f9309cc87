-- Caches the view of a user's order that a poll just read from MySQL, only if
-- nothing changed since the poll read its token (view_read.lua): the same build
-- of the state (a rebuild starts the cache anew), and the same even version (an
-- order that began to change since, or is changing, is not cached). A view read
-- before a change and cached after it is therefore never served.
--
-- KEYS[1] stock, KEYS[2] views, KEYS[3] epoch (the user's home shard)
-- ARGV[1] user id, ARGV[2] the token ("<epoch>|<version>"), ARGV[3] the view
--
-- Returns 1 when cached, 0 when left alone. Writes nothing into a state that is
-- not loaded (lost, or removed after the sale's retention).
if redis.call("EXISTS", KEYS[1]) == 0 then
  return 0
end
local version = redis.call("HGET", KEYS[2], "v:" .. ARGV[1]) or "0"
if tonumber(version) % 2 ~= 0 then
  return 0
end
if (redis.call("GET", KEYS[3]) or "") .. "|" .. version ~= ARGV[2] then
  return 0
end
redis.call("HSET", KEYS[2], "o:" .. ARGV[1], ARGV[2] .. "\n" .. ARGV[3])
return 1
