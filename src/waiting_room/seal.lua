-- Seals the early joiners and reads them, in one step: from here on every join
-- is late (join.lua), so the draw that follows sees each early joiner and no
-- join slips in between its read and its commit.
--
-- KEYS: joined, late, seq, queue, admitted, outcome, meta, journal, journal lock
--       (see RoomKeys)
--
-- Returns the early joiners with their arrival numbers (ZRANGE WITHSCORES).
redis.call("HSET", KEYS[7], "sealed", "1")
return redis.call("ZRANGE", KEYS[1], 0, -1, "WITHSCORES")
