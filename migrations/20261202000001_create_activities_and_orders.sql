-- Activities: the source of truth for a sale. `available` is the DB-side count of
-- units not yet taken by orders; the order consumer decrements it under a guard
-- (`WHERE available >= q`), so MySQL itself can never oversell even if Redis is wrong.
-- Identifiers are ASCII by validation and compared case-sensitively
-- (latin1_general_cs, in MySQL and MariaDB alike; a *_bin collation would make
-- drivers see VARBINARY): "Alice" and "alice" are different users.
CREATE TABLE activities (
    id                   VARCHAR(64)  NOT NULL,
    sku                  VARCHAR(128) NOT NULL,
    stock                INT UNSIGNED NOT NULL,
    available            INT          NOT NULL,
    per_user_limit       INT UNSIGNED NOT NULL,
    starts_at            DATETIME(3)  NOT NULL,
    ends_at              DATETIME(3)  NOT NULL,
    payment_timeout_secs INT UNSIGNED NOT NULL,
    paused               BOOLEAN      NOT NULL DEFAULT FALSE,
    created_at           DATETIME(3)  NOT NULL DEFAULT CURRENT_TIMESTAMP(3),
    updated_at           DATETIME(3)  NOT NULL DEFAULT CURRENT_TIMESTAMP(3) ON UPDATE CURRENT_TIMESTAMP(3),
    PRIMARY KEY (id),
    KEY idx_activities_sku_window (sku, starts_at, ends_at),
    KEY idx_activities_ends_at (ends_at),
    CONSTRAINT chk_activities_available CHECK (available >= 0 AND available <= stock),
    CONSTRAINT chk_activities_window CHECK (ends_at > starts_at),
    CONSTRAINT chk_activities_limit CHECK (per_user_limit >= 1)
) ENGINE = InnoDB DEFAULT CHARSET = latin1 COLLATE = latin1_general_cs;

-- One row per SKU, locked FOR UPDATE while an activity is created, so two
-- concurrent creations for the same SKU cannot both pass the overlap check.
CREATE TABLE sku_locks (
    sku VARCHAR(128) NOT NULL,
    PRIMARY KEY (sku)
) ENGINE = InnoDB DEFAULT CHARSET = latin1 COLLATE = latin1_general_cs;

-- Orders: one row per reservation that reached MySQL. UNIQUE(activity_id, user_id)
-- is the last word on "one order per user"; UNIQUE(reservation_id) makes a
-- redelivered message a no-op and lets the consumer and the reconciler arbitrate
-- a reservation's fate through the same key.
CREATE TABLE orders (
    id             BIGINT UNSIGNED NOT NULL AUTO_INCREMENT,
    reservation_id VARCHAR(64)     NOT NULL,
    activity_id    VARCHAR(64)     NOT NULL,
    user_id        VARCHAR(64)     NOT NULL,
    quantity       INT UNSIGNED    NOT NULL,
    status         ENUM ('pending_payment', 'paid', 'cancelled', 'failed') NOT NULL,
    failure_reason VARCHAR(255)    NULL,
    created_at     DATETIME(3)     NOT NULL DEFAULT CURRENT_TIMESTAMP(3),
    expires_at     DATETIME(3)     NULL,
    paid_at        DATETIME(3)     NULL,
    cancelled_at   DATETIME(3)     NULL,
    -- times a message for this (activity, user) arrived again after the first
    redeliveries   INT UNSIGNED    NOT NULL DEFAULT 0,
    -- for failed and cancelled orders: whether the units went back to Redis stock
    -- (the sweeper retries until they have)
    units_returned BOOLEAN         NOT NULL DEFAULT FALSE,
    PRIMARY KEY (id),
    UNIQUE KEY uq_orders_reservation (reservation_id),
    UNIQUE KEY uq_orders_activity_user (activity_id, user_id),
    -- the unpaid-order sweeper scans status = 'pending_payment' AND expires_at < now
    KEY idx_orders_status_expires (status, expires_at),
    KEY idx_orders_unreturned (units_returned, status)
) ENGINE = InnoDB DEFAULT CHARSET = latin1 COLLATE = latin1_general_cs;
