//! The operators' stock sequences, below HTTP: preloading a sale's Redis state
//! from MySQL, and adding units to a sale (MySQL first, then Redis). The admin
//! handlers call them and map what they answer to a status.

use std::sync::Arc;

use tokio::sync::Notify;

use crate::activity::{Activity, ActivityRepo, Build, TopUpError, Window};
use crate::reconcile::{Rebuild, Reconciler};
use crate::stock::{PreloadMode, RefundOutcome, StockStore};

/// How a preload ended.
#[derive(Debug)]
pub enum Preload {
    /// Redis was rebuilt from MySQL.
    Built(Build),
    /// Loaded, open and not paused: reservations keep arriving.
    Open,
    /// Not safe yet (the sale's messages in the topic could not be read or
    /// written as orders), and why.
    Draining(String),
    /// The sale reopened while it was being preloaded.
    Reopened,
    /// The sale ended longer ago than `redis.retain_after_end_secs`: its Redis
    /// state was removed, or is about to be, and it is never loaded again.
    Removed,
    /// Another build of the sale is under way, on this instance or another.
    Busy,
}

/// Why a preload could not be tried or finished.
#[derive(Debug, thiserror::Error)]
pub enum PreloadError {
    /// Redis did not answer the first look at the sale.
    #[error(transparent)]
    Redis(#[from] redis::RedisError),
    /// The rebuild failed (Redis or MySQL unreachable, or worse).
    #[error(transparent)]
    Rebuild(anyhow::Error),
}

/// The parts the sequences use: activities in MySQL, the stock in Redis, the
/// reconciler (whose rebuild a preload is, and whose probe reads the consumers'
/// lag) and the reconciler's wake-up.
#[derive(Clone)]
pub struct Stocking {
    activities: ActivityRepo,
    stock: StockStore,
    reconciler: Reconciler,
    reconcile_now: Arc<Notify>,
}

impl Stocking {
    pub fn new(
        activities: ActivityRepo,
        stock: StockStore,
        reconciler: Reconciler,
        reconcile_now: Arc<Notify>,
    ) -> Self {
        Stocking {
            activities,
            stock,
            reconciler,
            reconcile_now,
        }
    }

    /// (Re)builds the Redis state from MySQL, as safely as the automatic rebuild
    /// (`Reconciler::rebuild`), after the same wait for publishes in flight when
    /// Redis lost an activity loaded before (up to the publish timeout and half a
    /// second). An activity that is not loaded is loaded whatever its window; a
    /// loaded one is refused while it is open and not paused.
    pub async fn preload(&self, activity: &Activity) -> Result<Preload, PreloadError> {
        let id = &activity.id;
        if self.reconciler.past_retention(activity) {
            return Ok(Preload::Removed);
        }
        let live = self.stock.snapshot(id, activity.stock_shards).await?;
        let loaded = live.loaded();
        let paused = activity.paused || live.state.as_deref() == Some("paused");
        if loaded && activity.window(self.stock.clock().now()) == Window::Open && !paused {
            return Ok(Preload::Open);
        }
        // Only an activity that was loaded before can have messages in the topic.
        // If Redis lost it (whole or some shards), or holds an older build than
        // the last one written (a failover to a replica that missed the writes
        // since: the reservations made in the newer state are not in it),
        // publishes still on their way are waited out first, as the automatic
        // rebuild does: their reservations are gone with the state, and only the
        // topic will hold them, which the rebuild writes as orders before it
        // reads MySQL. Over a loaded (paused) state that is current no wait is
        // needed: the rebuild withdraws every reservation not yet acknowledged
        // before it reads MySQL, so a late acknowledgement finds it withdrawn and
        // its message makes no order.
        let stale = live
            .epoch
            .is_some_and(|epoch| epoch < activity.redis_built_epoch);
        if activity.redis_epoch > 0 && (!loaded || stale) {
            self.reconciler.wait_published(id).await;
        }
        let Some(lock) = self
            .activities
            .build_lock(id, std::time::Duration::ZERO)
            .await
            .map_err(|e| PreloadError::Rebuild(e.into()))?
        else {
            return Ok(Preload::Busy);
        };
        let mut report = crate::reconcile::Report::default();
        let rebuilt = self
            .reconciler
            .rebuild(activity, PreloadMode::Force, &mut report)
            .await;
        lock.release().await;
        let rebuilt = rebuilt.map_err(PreloadError::Rebuild)?;
        Ok(match rebuilt {
            Rebuild::Built(build) => {
                tracing::info!(activity_id = %id, stock = build.available, buyers = build.buyers.len(), epoch = build.epoch, "activity preloaded");
                Preload::Built(build)
            }
            Rebuild::Waiting(why) => {
                tracing::warn!(activity_id = %id, %why, "preload deferred");
                Preload::Draining(why)
            }
            Rebuild::AlreadyLoaded => Preload::Reopened,
            Rebuild::Removed => Preload::Removed,
        })
    }

    /// N more units, during a sale too: MySQL first (stock, available and the
    /// top-up's record in one transaction), then Redis once
    /// (`StockStore::top_up`); if Redis cannot take it now, the reconciler adds it
    /// on its next pass, and a rebuild counts it from MySQL. The activity as
    /// MySQL now holds it.
    pub async fn top_up(&self, id: &str, units: u32) -> Result<Activity, TopUpError> {
        let (activity, key) = self.activities.top_up(id, units).await?;
        match self
            .stock
            .top_up(id, activity.stock_shards, &key, units)
            .await
        {
            Ok(RefundOutcome::NotLoaded) => {
                tracing::info!(activity_id = %id, units, "topped up in MySQL; the activity is not loaded");
            }
            Ok(_) => {
                if let Err(err) = self.activities.topup_applied(&key).await {
                    tracing::warn!(error = %err, activity_id = %id, "top-up not marked applied; the reconciler will");
                }
            }
            Err(err) => {
                tracing::warn!(error = %err, activity_id = %id, units, "top-up not yet in Redis; the reconciler adds it");
                self.reconcile_now.notify_one();
            }
        }
        tracing::info!(activity_id = %id, units, stock = activity.stock, "activity topped up");
        Ok(activity)
    }
}
