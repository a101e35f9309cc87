-- When an ended sale's Redis state was removed (`redis.retain_after_end_secs`
-- after its end); NULL while it may still be there. A removed sale is never
-- loaded again: everything about it is answered from MySQL. The index serves the
-- reconciler's look for sales due for removal, which reads only those not yet
-- removed whatever the number of sales ever held.
ALTER TABLE activities
    ADD COLUMN redis_removed_at DATETIME(3) NULL,
    ADD KEY idx_activities_retention (redis_removed_at, ends_at);
