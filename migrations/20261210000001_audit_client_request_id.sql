-- The audit trail's request_id is the service's own id (as in the logs and the
-- answer's x-request-id); the X-Request-Id a client sent, if any, is kept beside
-- it (1 to 128 visible ASCII characters; anything else is not kept). Entries
-- written before this column have NULL here, and their request_id may be a
-- client's value.
ALTER TABLE admin_audit
    ADD COLUMN client_request_id VARCHAR(128) NULL AFTER request_id;
