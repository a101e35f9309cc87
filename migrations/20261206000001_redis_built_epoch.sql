-- The number of the last build of an activity's Redis state that was written
-- whole (`redis_epoch` counts every build begun, written or not). A Redis that
-- holds an older build than this went back in time (a failover that lost
-- writes); one that holds an older build than `redis_epoch` may only have lost a
-- race with another instance's build, which wrote nothing.
ALTER TABLE activities ADD COLUMN redis_built_epoch INT UNSIGNED NOT NULL DEFAULT 0;
UPDATE activities SET redis_built_epoch = redis_epoch;
