-- The waiting room (API.md version 2): an activity may admit its buyers through
-- a fair, stock-aware queue instead of first come, first served.
ALTER TABLE activities
    ADD COLUMN admission ENUM ('open', 'waiting_room') NOT NULL DEFAULT 'open' AFTER stock_shards,
    ADD COLUMN waiting_room_secs INT UNSIGNED NOT NULL DEFAULT 600 AFTER admission;

-- The draw at `starts_at`: its seed, and for every user who joined before it,
-- their arrival number and the position the draw gave them. An auditor replays
-- the draw from the seed and the users in arrival order; a Redis lost after the
-- draw gets the same order back from here.
CREATE TABLE waiting_room_draws (
    activity_id VARCHAR(64)     NOT NULL PRIMARY KEY,
    seed        BIGINT UNSIGNED NOT NULL,
    joined      INT UNSIGNED    NOT NULL,
    drawn_at    DATETIME(3)     NOT NULL
) ENGINE = InnoDB;

CREATE TABLE waiting_room_entries (
    activity_id VARCHAR(64)  NOT NULL,
    position    INT UNSIGNED NOT NULL,
    user_id     VARCHAR(64)  NOT NULL,
    joined_seq  BIGINT UNSIGNED NOT NULL,
    PRIMARY KEY (activity_id, position),
    UNIQUE KEY uq_waiting_room_user (activity_id, user_id)
) ENGINE = InnoDB;
