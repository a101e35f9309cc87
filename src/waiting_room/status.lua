-- A user's place in the waiting room, in one round trip (place.lua is
-- prepended).
--
-- KEYS: joined, late, seq, queue, admitted, outcome, meta, journal, journal lock
--       (see RoomKeys)
-- ARGV[1] user id, ARGV[2] now (ms)
--
-- Returns place.lua's answer.
return place(ARGV[1], tonumber(ARGV[2]))
