-- The turns a waiting room gave, each with its end (ms since the epoch, by the
-- shared clock), copied from the room's journal in Redis with the rest of it. A
-- room rebuilt after Redis lost it settles a turn whose end has passed as
-- `expired`, even when that entry was journalled in the last moment before the
-- loss and never copied: the turn was given, and copied, a whole turn earlier.
-- A table of its own, so that an instance of the last release (which reads
-- every row of `waiting_room_journal` as a join or a settled turn) never sees
-- one. A turn given again after a rebuild keeps the later end.
CREATE TABLE waiting_room_turns (
    activity_id VARCHAR(64) CHARACTER SET latin1 COLLATE latin1_general_cs NOT NULL,
    user_id     VARBINARY(255) NOT NULL,
    ends_at_ms  BIGINT UNSIGNED NOT NULL,
    PRIMARY KEY (activity_id, user_id)
) ENGINE = InnoDB;
