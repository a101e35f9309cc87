-- The operators' audit trail: one row per admin request that changes something
-- (create, preload, pause, resume, reconcile, top-up), refused ones too, written
-- after the action with its answer. Reads are not recorded.
CREATE TABLE admin_audit (
    id          BIGINT UNSIGNED                   NOT NULL AUTO_INCREMENT,
    -- When the answer was known (UTC, milliseconds).
    at          DATETIME(3)                       NOT NULL,
    -- The operator's name; `admin_token` for the shared token.
    operator    VARCHAR(64)                       NOT NULL,
    via         ENUM('shared', 'named', 'jwt')    NOT NULL,
    action      VARCHAR(32)                       NOT NULL,
    activity_id VARCHAR(64)                       NULL,
    -- The request's x-request-id, as in the logs.
    request_id  VARCHAR(128)                      NULL,
    -- Method, path and body as sent (cut at 2,000 characters).
    request     TEXT                              NOT NULL,
    status      SMALLINT UNSIGNED                 NOT NULL,
    -- The error code of a refused action; NULL when it succeeded.
    code        VARCHAR(64)                       NULL,
    -- The error message, or the answer's body (cut at 1,000 characters).
    summary     TEXT                              NOT NULL,
    elapsed_ms  INT UNSIGNED                      NOT NULL,
    PRIMARY KEY (id),
    KEY admin_audit_by_activity (activity_id, id)
) ENGINE = InnoDB;
