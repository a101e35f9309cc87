-- Which life in Redis of a waiting room each journal row was recorded from (the
-- room's generation, set by the join that created it there; NULL for rows
-- recorded before this column). A room whose every row carries its current
-- generation never lost anything to Redis: its draw seals from Redis alone, and
-- only a room that was lost reads its journal back. The index answers "any row of
-- another generation?" without reading the room's rows.
ALTER TABLE waiting_room_journal
    ADD COLUMN gen VARCHAR(64) NULL,
    ADD KEY idx_waiting_room_journal_gen (activity_id, gen);
