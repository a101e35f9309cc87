//! The in-memory copy of the activities, refreshed from MySQL in the background.
//!
//! The hot path reads only this: an unknown SKU, a sale not yet open or already
//! ended is answered without touching Redis or MySQL. The snapshot is an `Arc`
//! swapped whole under a std `RwLock`; readers hold the lock only to clone the `Arc`,
//! never across an `.await`, so a blocking lock is right here.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio_util::sync::CancellationToken;

use super::definition::{Activity, Window};
use super::repo::ActivityRepo;

/// How long after its end the reconciler and the waiting room's loop keep
/// looking at a sale.
pub const LOOKED_AFTER: chrono::Duration = chrono::Duration::hours(1);
/// How long an ended activity stays visible (to answer `ended` rather than 404).
const KEEP_ENDED: chrono::Duration = chrono::Duration::days(7);
/// How often the cache is read again while a current activity is paused
/// automatically (see `run_refresher`).
pub const AUTO_PAUSED_REFRESH: Duration = Duration::from_millis(100);

#[derive(Default)]
struct Snapshot {
    /// Activities of each SKU, sorted by start.
    by_sku: HashMap<String, Vec<Arc<Activity>>>,
    by_id: HashMap<String, Arc<Activity>>,
}

#[derive(Clone)]
pub struct ActivityCache {
    repo: ActivityRepo,
    snapshot: Arc<RwLock<Arc<Snapshot>>>,
}

impl ActivityCache {
    pub fn new(repo: ActivityRepo) -> Self {
        ActivityCache {
            repo,
            snapshot: Arc::new(RwLock::new(Arc::new(Snapshot::default()))),
        }
    }

    fn current(&self) -> Arc<Snapshot> {
        // A poisoned lock means a writer panicked between two whole-Arc swaps; the
        // value inside is still a complete snapshot.
        self.snapshot
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Reloads every activity that has not ended (or ended recently) from MySQL.
    pub async fn refresh(&self) -> Result<(), sqlx::Error> {
        let rows = self.repo.list_recent(Utc::now() - KEEP_ENDED).await?;
        let mut next = Snapshot::default();
        for a in rows {
            let a = Arc::new(a);
            next.by_id.insert(a.id.clone(), a.clone());
            next.by_sku.entry(a.sku.clone()).or_default().push(a);
        }
        for list in next.by_sku.values_mut() {
            list.sort_by_key(|a| a.starts_at);
        }
        *self.snapshot.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(next);
        Ok(())
    }

    /// The activity a client means by this SKU now: the open one, else the next to
    /// open, else the one that ended last.
    pub fn for_sku(&self, sku: &str, now: DateTime<Utc>) -> Option<Arc<Activity>> {
        let snap = self.current();
        let list = snap.by_sku.get(sku)?;
        if let Some(open) = list.iter().find(|a| a.window(now) == Window::Open) {
            return Some(open.clone());
        }
        if let Some(next) = list.iter().find(|a| a.window(now) == Window::Upcoming) {
            return Some(next.clone());
        }
        list.last().cloned()
    }

    /// Activities the reconciler looks after: started, not ended for more than
    /// `LOOKED_AFTER` (late messages and payments still move their figures), and
    /// whose Redis state was not removed.
    pub fn current_activities(&self, now: DateTime<Utc>) -> Vec<Arc<Activity>> {
        self.current()
            .by_id
            .values()
            .filter(|a| a.starts_at <= now && a.ends_at + LOOKED_AFTER > now && !a.redis_removing)
            .cloned()
            .collect()
    }

    /// Activities with a waiting room that is open to joiners, or whose sale has
    /// not ended for more than `LOOKED_AFTER`.
    pub fn waiting_rooms(&self, now: DateTime<Utc>) -> Vec<Arc<Activity>> {
        self.current()
            .by_id
            .values()
            .filter(|a| {
                a.admission == super::definition::Admission::WaitingRoom
                    && a.joins_from() <= now
                    && a.ends_at + LOOKED_AFTER > now
                    && !a.redis_removing
            })
            .cloned()
            .collect()
    }

    pub fn by_id(&self, id: &str) -> Option<Arc<Activity>> {
        self.current().by_id.get(id).cloned()
    }

    /// Refreshes every `interval` until cancelled; a failed refresh keeps the last
    /// snapshot and is retried on the next tick. While a current activity is
    /// paused automatically (Redis lost it and it is being rebuilt), every
    /// [`AUTO_PAUSED_REFRESH`]: the rebuild resumes it in MySQL, and every
    /// instance serves again within that of the resume, not within `interval`.
    pub async fn run_refresher(self, interval: Duration, shutdown: CancellationToken) {
        loop {
            if let Err(err) = self.refresh().await {
                tracing::warn!(error = %err, "activity cache refresh failed; keeping the last copy");
            }
            let rebuilding = self
                .current_activities(Utc::now())
                .iter()
                .any(|a| a.auto_paused);
            let wait = if rebuilding {
                AUTO_PAUSED_REFRESH.min(interval)
            } else {
                interval
            };
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }
}
