-- Units added to an activity during its sale (POST /admin/activities/{id}/stock).
-- A top-up is written here and to the activity's stock in one transaction, then
-- added to Redis once: its id goes into the activity's set of returned units, so a
-- retry, the reconciler finishing it, or a rebuild that already counted it never
-- adds it twice. `applied` is set once Redis holds it.
CREATE TABLE stock_topups (
    id          VARCHAR(64)  NOT NULL,
    activity_id VARCHAR(64)  NOT NULL,
    units       INT UNSIGNED NOT NULL,
    applied     BOOLEAN      NOT NULL DEFAULT FALSE,
    created_at  DATETIME(3)  NOT NULL DEFAULT CURRENT_TIMESTAMP(3),
    PRIMARY KEY (id),
    KEY idx_stock_topups_activity (activity_id, applied)
) ENGINE = InnoDB DEFAULT CHARSET = latin1 COLLATE = latin1_general_cs;
