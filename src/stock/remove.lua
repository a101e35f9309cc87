-- Removes one shard's Redis state of a finished sale for good, as one atomic
-- step: every key unlinked (freed off Redis's main thread), and in their place a
-- marker that keeps any build from writing them again (preload.lua checks it).
-- A build that ran before this is removed with the rest; one that runs after
-- finds the marker and writes nothing.
--
-- KEYS[1] the marker; KEYS[2..] every key of the shard (and, on shard 0, the
-- waiting room's)
-- ARGV[1] how long the marker stays (seconds; longer than any build takes)
--
-- Returns how many keys there were.
local removed = 0
if #KEYS > 1 then
  removed = redis.call("UNLINK", unpack(KEYS, 2))
end
redis.call("SET", KEYS[1], "1", "EX", ARGV[1])
return removed
