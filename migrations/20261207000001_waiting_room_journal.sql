-- What a waiting room Redis lost needs back beyond its draw: joiners (early and
-- late, with their arrival numbers) and settled turns (`reserved`, `expired`). Copied from
-- the room's journal in Redis in batches; a rebuilt room reads it before its
-- draw is written again.
CREATE TABLE waiting_room_journal (
    activity_id VARCHAR(64)                         NOT NULL,
    user_id     VARCHAR(64)                         NOT NULL,
    kind        ENUM('early', 'late', 'reserved', 'expired') NOT NULL,
    joined_seq  BIGINT UNSIGNED                     NULL,
    recorded_at DATETIME(3)                         NOT NULL,
    PRIMARY KEY (activity_id, user_id, kind)
) ENGINE = InnoDB;
