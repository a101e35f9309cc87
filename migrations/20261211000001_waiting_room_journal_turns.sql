-- Turns given (`admitted`, with the turn's end in ms in `joined_seq`), so that a
-- room rebuilt after Redis lost it knows a turn that ran out even when the
-- `expired` entry was journalled in the last moment before the loss and never
-- copied: the turn was given (and copied) a whole turn earlier. Appending a
-- value to the ENUM changes no row.
ALTER TABLE waiting_room_journal
    MODIFY kind ENUM('early', 'late', 'reserved', 'expired', 'admitted') NOT NULL;
