-- One decision per reservation (DESIGN.md, invariant 3).
--
-- A reservation that reached Redis is decided exactly once, under the activity's
-- row lock, by whichever party comes first: the consumer that sees its message
-- (an order, or a failed row when MySQL has no units), or the party that withdraws
-- it before it reached anyone (the request whose publish failed or timed out, the
-- reconciler). A withdrawal is a row here; a late message for it finds the row and
-- writes nothing, so a timed-out publish never becomes both an order and a refund.
CREATE TABLE withdrawals (
    reservation_id VARCHAR(64)  NOT NULL,
    activity_id    VARCHAR(64)  NOT NULL,
    user_id        VARCHAR(64)  NOT NULL,
    quantity       INT UNSIGNED NOT NULL,
    reason         VARCHAR(255) NOT NULL,
    created_at     DATETIME(3)  NOT NULL DEFAULT CURRENT_TIMESTAMP(3),
    PRIMARY KEY (reservation_id),
    KEY idx_withdrawals_activity (activity_id)
) ENGINE = InnoDB DEFAULT CHARSET = latin1 COLLATE = latin1_general_cs;

-- A failed row no longer spends the user's purchase right: the one-per-user key
-- covers live and cancelled orders only (a lapse keeps the right spent), so a user
-- whose reservation failed can buy again.
ALTER TABLE orders
    ADD COLUMN holder VARCHAR(64) AS (IF(status = 'failed', NULL, user_id)) STORED AFTER user_id,
    DROP INDEX uq_orders_activity_user,
    ADD UNIQUE KEY uq_orders_activity_holder (activity_id, holder),
    ADD KEY idx_orders_activity_user (activity_id, user_id);

-- How many times the activity's Redis state was (re)built from MySQL. 0: never
-- loaded, so no message for it can be in the queue and a first preload needs no
-- drained consumers. Activities that exist already may have been loaded: 1.
ALTER TABLE activities ADD COLUMN redis_epoch INT UNSIGNED NOT NULL DEFAULT 0 AFTER auto_paused;
UPDATE activities SET redis_epoch = 1;
