-- The draw compares the room's journal with Redis in one aggregate (early joins
-- journalled, rows of another life in Redis): an index holding both columns
-- answers it without reading the rows.
ALTER TABLE waiting_room_journal
    DROP KEY idx_waiting_room_journal_gen,
    ADD KEY idx_waiting_room_journal_kind_gen (activity_id, kind, gen);
