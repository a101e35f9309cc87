//! A finished sale's Redis state is removed `redis.retain_after_end_secs` after
//! its end, for good; everything about it is then answered from MySQL.

use super::{decide, Reconciler};
use crate::activity::Activity;

/// Sales whose Redis state is removed in one pass, at most (the others wait for
/// the next).
const REMOVE_BATCH: u32 = 20;

impl Reconciler {
    /// Removes the Redis state of the sales that ended more than
    /// `retain_after_end` ago, in two steps: marked removing in MySQL first
    /// (from then on no preload or rebuild begins to write it: `rebuild` reads
    /// the mark just before it builds), then each shard's keys unlinked in one
    /// atomic step that leaves a marker no build writes over (`remove.lua`, which
    /// a build that read MySQL before the mark meets in `preload.lua`), then
    /// marked removed. A removal cut short (Redis unreachable) is taken up again
    /// at the next pass, before any new one. While the sale is still looked
    /// after, a removal waits for its pending reservations (the pass that
    /// decides them needs them), and a waiting room's for its loop to be done
    /// with it (its last turns run out: a turn and a minute past the end) and
    /// for its journal to be copied to MySQL (its polls are answered from the
    /// journal once the state is gone). Nothing else brings a removed state back: the reconciler
    /// rebuilds only open sales, and the scripts a late message or a lapse runs
    /// write nothing where the stock key is missing. One sale that fails is
    /// logged and skipped. Returns how many sales it removed.
    pub async fn remove_ended(&self) -> anyhow::Result<usize> {
        let Some(cutoff) = chrono::Duration::from_std(self.retain_after_end)
            .ok()
            .and_then(|retain| self.stock.clock().now().checked_sub_signed(retain))
        else {
            return Ok(0);
        };
        let due = self
            .activities
            .due_for_removal(cutoff, REMOVE_BATCH)
            .await?;
        let mut removed = 0;
        for a in due {
            match self.remove_one(&a).await {
                Ok(true) => removed += 1,
                Ok(false) => {}
                Err(err) => {
                    tracing::warn!(error = %format!("{err:#}"), activity_id = %a.id, "removing the ended sale's Redis state failed; next pass");
                }
            }
        }
        Ok(removed)
    }

    /// One sale of `remove_ended`; whether it was removed now.
    pub(super) async fn remove_one(&self, a: &Activity) -> anyhow::Result<bool> {
        let now = self.stock.clock().now();
        let looked_after = a.ends_at + crate::activity::LOOKED_AFTER > now;
        let room = a.admission == crate::activity::Admission::WaitingRoom;
        if room && !a.redis_removing {
            // A journal not yet copied to MySQL would go with the keys: the
            // removal waits for it, however long ago the sale ended.
            let uncopied = self.stock.room_journal_len(a).await?;
            if uncopied > 0 {
                tracing::warn!(activity_id = %a.id, uncopied, "an ended room's journal is not copied to MySQL yet; its Redis state waits");
                return Ok(false);
            }
        }
        let room_busy = room && a.ends_at + self.room_after_end >= now;
        match decide::removal(a.redis_removing, looked_after, room_busy) {
            decide::Removal::Wait => return Ok(false),
            decide::Removal::IfNothingPending => {
                let snapshot = self.stock.snapshot(&a.id, a.stock_shards).await?;
                if snapshot.pending > 0 {
                    tracing::info!(activity_id = %a.id, pending = snapshot.pending, "an ended sale's Redis state waits for its pending reservations before it is removed");
                    return Ok(false);
                }
            }
            decide::Removal::Remove => {}
        }
        if !a.redis_removing {
            self.activities.mark_removing(&a.id).await?;
        }
        let keys = self.stock.remove(&a.id, a.stock_shards).await?;
        self.activities.mark_removed(&a.id).await?;
        self.found(&a.id);
        self.last
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&a.id);
        metrics::counter!("flashsale_activities_removed_total").increment(1);
        tracing::info!(activity_id = %a.id, keys, ends_at = %a.ends_at, "the ended sale's Redis state was removed");
        Ok(true)
    }
}
