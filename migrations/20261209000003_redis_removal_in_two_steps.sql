-- A sale's Redis state is removed in two steps: `redis_removing` is set first
-- (from then on no build writes it again), then, once its keys are unlinked and
-- a marker left in their place, `redis_removed_at`. A removal cut short (Redis
-- unreachable) is taken up again at the next pass until it is done. The index
-- serves both looks: sales due (not removing, ended long enough ago) and
-- removals not yet done, whatever the number of sales ever held.
ALTER TABLE activities
    ADD COLUMN redis_removing BOOLEAN NOT NULL DEFAULT FALSE,
    DROP KEY idx_activities_retention,
    ADD KEY idx_activities_retention (redis_removing, redis_removed_at, ends_at);
UPDATE activities SET redis_removing = TRUE WHERE redis_removed_at IS NOT NULL;
