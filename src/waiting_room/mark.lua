-- Marks joiners MySQL has recorded (see `recorded` in RoomKeys), so that their
-- joining again costs MySQL nothing; only in the room's life ARGV[1] (its
-- generation): a mark that comes after the room was lost or removed writes
-- nothing, and no key outlives the room.
--
-- KEYS: joined, late, seq, queue, admitted, outcome, meta, journal, journal lock,
--       recorded (see RoomKeys)
-- ARGV[1] the room's generation, ARGV[2..] users
--
-- Returns 1 when marked, 0 when the room is another life or gone.
if ARGV[1] == "" or redis.call("HGET", KEYS[7], "gen") ~= ARGV[1] then
  return 0
end
for i = 2, #ARGV do
  redis.call("SADD", KEYS[10], ARGV[i])
end
return 1
