-- A user's order changes in MySQL: the view a poll cached is dropped, and the
-- version moves so that no poll caches what it read before the change.
--
-- KEYS[1] stock, KEYS[2] views (the user's home shard)
-- ARGV[1] user id
-- ARGV[2] "begin" before the change (the version becomes odd: nothing is cached
--         until the change ends) or "end" once it is committed (the version
--         becomes even again, past every token read before; an "end" with no
--         "begin" moves it by two)
--
-- A "begin" whose "end" never comes (the instance died, Redis failed between
-- the two) leaves the version odd: that user's polls ask MySQL, never a stale
-- view. Writes nothing into a state that is not loaded: nothing is cached there.
-- Returns the new version, or -1 when not loaded.
if redis.call("EXISTS", KEYS[1]) == 0 then
  return -1
end
local field = "v:" .. ARGV[1]
local version = tonumber(redis.call("HGET", KEYS[2], field) or "0")
if ARGV[2] == "begin" then
  if version % 2 == 0 then
    version = version + 1
  end
elseif version % 2 == 1 then
  version = version + 1
else
  version = version + 2
end
redis.call("HSET", KEYS[2], field, version)
redis.call("HDEL", KEYS[2], "o:" .. ARGV[1])
return version
