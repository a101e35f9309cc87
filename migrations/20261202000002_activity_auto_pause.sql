-- Set when the service paused an activity by itself (its Redis state was lost), so
-- that it resumes by itself once rebuilt; an operator's pause is never undone.
ALTER TABLE activities ADD COLUMN auto_paused BOOLEAN NOT NULL DEFAULT FALSE AFTER paused;
