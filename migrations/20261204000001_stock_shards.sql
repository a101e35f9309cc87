-- One hot SKU past one Redis shard (DESIGN.md, Scale-out): an activity's Redis
-- stock may be split over `stock_shards` hash tags, `flash:{<id>#<k>}`, so that
-- its reservations spread over up to that many Redis Cluster primaries. 1 keeps
-- the one hash tag `flash:{<id>}` every activity had before.
ALTER TABLE activities
    ADD COLUMN stock_shards TINYINT UNSIGNED NOT NULL DEFAULT 1 AFTER per_user_limit;
