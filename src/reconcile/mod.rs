//! The reconciler: makes Redis agree with MySQL (the source of truth) again after
//! whatever failed, without ever letting MySQL oversell.
//!
//! For one activity, one pass:
//! 1. **Redis lost the activity** (restart, failover, flush): the activity is paused
//!    automatically (reservations already answer 503), and once the consumers have
//!    drained the topic it is rebuilt from MySQL and resumed. An operator may
//!    rebuild at once with the preload endpoint.
//! 2. **Reservations pending past the deadline** have not reached MySQL yet. What
//!    becomes of one depends on its fate in Redis (`stock/fate.lua`):
//!    - *acknowledged*: a `202` was answered, so its message is in the queue and it
//!      must become an order. The reconciler honours it: it writes the order from
//!      Redis's record, through the same lock and unique keys as the consumer, so
//!      the message, whenever it comes, is a duplicate. A slow or stopped consumer
//!      therefore never turns a `202` into anything but an order.
//!    - *pending* (no `202` was answered: the request died, or is still waiting for
//!      the broker): it is marked withdrawing, which forbids any later `202`, and
//!      then MySQL decides: an order if its message got there first, else a
//!      withdrawal, which a late message finds and leaves alone. Its unit and the
//!      user's right go back to Redis.
//!    - *withdrawing* (its request gave up but could not reach MySQL): the same.
//! 3. **Stock drift**: Redis stock + pending units + units owed back (failed or
//!    cancelled orders not yet refunded) + live orders' units must equal the
//!    activity's stock. A difference is reported, and repaired from MySQL only
//!    when it is safe: the consumers have no lag, MySQL did not change while Redis
//!    was read, and Redis still holds what was read (compare-and-set).
//!
//! Every step is idempotent and safe to run on several instances at once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use serde::Serialize;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::activity::{Activity, ActivityCache, ActivityRepo, Build, Window};
use crate::config::KafkaSettings;
use crate::kafka;
use crate::orders::{Decision, Incoming, OrderRepo, OrderWriter};
use crate::stock::{Audit, Fate, PreloadMode, RefundMode, RefundOutcome, StockStore};

const EXPIRED_BATCH: usize = 500;
/// How soon a rebuild that waits for the consumers is tried again.
const REBUILD_RETRY: Duration = Duration::from_millis(250);
/// How long one pass keeps retrying MySQL for the orders it honours.
const HONOUR_TIMEOUT: Duration = Duration::from_secs(10);
/// A transfer between stock shards older than this was left half done by its
/// borrower (a borrower finishes its own within one round trip).
const TRANSFER_GRACE_MS: i64 = 2_000;

/// What one pass found and did, for the operator.
#[derive(Debug, Clone, Default, Serialize, utoipa::ToSchema)]
pub struct Report {
    pub activity_id: String,
    pub checked_at: chrono::DateTime<Utc>,
    /// Messages the consumers have not committed yet; `None` if the broker did not
    /// answer (repairs are then refused).
    pub consumer_lag: Option<i64>,
    /// Whether Redis held the activity when the pass began.
    pub loaded: bool,
    /// Whether Redis held an older build of it than MySQL's last one.
    pub stale: bool,
    pub paused_automatically: bool,
    /// A rebuild is due but waits (for the consumers to drain).
    pub rebuild_waiting: bool,
    pub rebuilt: bool,
    pub resumed: bool,
    /// Pending reservations past the deadline, and what became of them.
    pub expired_pending: usize,
    /// Acknowledged reservations the reconciler turned into orders itself.
    pub honoured: usize,
    /// Unacknowledged reservations the reconciler withdrew.
    pub withdrawn: usize,
    pub already_in_mysql: usize,
    pub superseded: usize,
    /// Reservations MySQL had no units for (incidents).
    pub no_units: usize,
    /// Transfers between stock shards that the reconciler finished.
    pub transfers_finished: u64,
    /// Top-ups MySQL held and Redis did not, added by the reconciler.
    pub topups_finished: u64,
    pub mysql: MysqlFigures,
    pub redis: Option<Audit>,
    /// Redis stock minus what MySQL implies (0 when they agree).
    pub drift: i64,
    pub repaired: bool,
    /// Why something that differs was left alone.
    pub refused: Vec<String>,
}

/// What a rebuild did.
#[derive(Debug)]
pub enum Rebuild {
    Built(Build),
    /// `Missing` found the activity loaded: nothing to do.
    AlreadyLoaded,
    /// Not safe yet, and why.
    Waiting(String),
}

#[derive(Debug, Clone, Default, Serialize, utoipa::ToSchema)]
pub struct MysqlFigures {
    pub stock: i64,
    pub available: i64,
    pub live_units: i64,
    /// `stock - live_units`; differs from `available` only if MySQL itself is
    /// inconsistent (reported, never repaired automatically).
    pub expected_available: i64,
}

/// Beyond the publish timeout, for the broker's acknowledgement to reach the
/// service and the message's offset to reach the lag.
const PUBLISH_GRACE: Duration = Duration::from_millis(500);
/// How long one reading of the consumers' lag may take.
const LAG_READ_TIMEOUT: Duration = Duration::from_secs(3);

#[derive(Clone)]
pub struct Reconciler {
    pub activities: ActivityRepo,
    pub orders: OrderRepo,
    pub stock: StockStore,
    pub kafka: KafkaSettings,
    /// The consumers' lag, read on one long-lived client.
    pub lag_probe: kafka::LagProbe,
    pub pending_deadline: Duration,
    /// The last report of each activity this instance reconciled.
    pub last: Arc<std::sync::Mutex<std::collections::HashMap<String, Report>>>,
    /// When this instance first found each activity lost from Redis.
    pub lost_since: Arc<std::sync::Mutex<std::collections::HashMap<String, Instant>>>,
    /// Set once `run` has finished its first pass (the consumer lag measured and
    /// every current activity reconciled): `/metrics` waits for it after a start.
    pub first_pass: Arc<tokio::sync::SetOnce<()>>,
}

impl Reconciler {
    pub fn new(
        activities: ActivityRepo,
        orders: OrderRepo,
        stock: StockStore,
        kafka: KafkaSettings,
        pending_deadline: Duration,
    ) -> Self {
        Reconciler {
            activities,
            orders,
            stock,
            lag_probe: kafka::LagProbe::new(kafka.clone()),
            kafka,
            pending_deadline,
            last: Arc::default(),
            lost_since: Arc::default(),
            first_pass: Arc::default(),
        }
    }

    /// The activity is in Redis again: a later loss waits from its own start.
    fn found(&self, activity_id: &str) {
        self.lost_since
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(activity_id);
    }

    /// How long a publish may still be on its way: the publish timeout, and the
    /// time for its acknowledgement to reach the service and its offset the lag.
    fn in_flight(&self) -> Duration {
        self.kafka.publish_timeout() + PUBLISH_GRACE
    }

    /// The consumers' lag, measured once every publish that may have been in
    /// flight when the activity was lost (as this instance first saw it, or now)
    /// has been acknowledged, and is in the lag, or has failed; `None` if the
    /// broker does not answer. The operator's preload waits for it as the
    /// automatic rebuild does (`recover`): a reservation made in the lost state
    /// and acknowledged after the lag was read would reach MySQL after the build
    /// counted its unit as for sale.
    pub async fn lag_once_published(&self, activity_id: &str) -> Option<i64> {
        let since = self
            .lost_since
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(activity_id)
            .copied()
            .unwrap_or_else(Instant::now);
        // Connect (a reading whose answer is unused) while those publishes land,
        // if the probe has no connection yet: the reading that counts is then a
        // few round trips on connections already made.
        let probe = self.lag_probe.clone();
        let connect = tokio::spawn(async move {
            let _ = probe.lag(LAG_READ_TIMEOUT).await;
        });
        tokio::time::sleep_until((since + self.in_flight()).into()).await;
        // The reading must start after the wait, so the connecting one ends first.
        let _ = connect.await;
        self.measure_lag().await
    }

    /// When the run loop should look again at the activities whose rebuild waits
    /// out the publishes in flight at their loss: the earliest moment one of them
    /// may be rebuilt, or `REBUILD_RETRY` from now, whichever comes first.
    fn next_retry(&self) -> Instant {
        let now = Instant::now();
        let in_flight = self.in_flight();
        let lost = self.lost_since.lock().unwrap_or_else(|e| e.into_inner());
        lost.values()
            .map(|since| *since + in_flight)
            .filter(|due| *due > now)
            .fold(now + REBUILD_RETRY, Instant::min)
    }

    /// The activity as MySQL holds it now; one that was there a moment ago and
    /// is gone is an error.
    async fn reread(&self, id: &str) -> anyhow::Result<Activity> {
        self.activities
            .get(id)
            .await?
            .ok_or_else(|| anyhow::anyhow!("activity {id} vanished"))
    }

    /// The last report this instance made for an activity.
    pub fn last_report(&self, activity_id: &str) -> Option<Report> {
        let last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        last.get(activity_id).cloned()
    }

    fn remember(&self, report: &Report) {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        if last.len() > 1_000 {
            last.clear();
        }
        last.insert(report.activity_id.clone(), report.clone());
    }

    pub async fn reconcile(&self, activity_id: &str) -> anyhow::Result<Report> {
        let activity = self
            .activities
            .get(activity_id)
            .await?
            .ok_or_else(|| anyhow::anyhow!("no activity {activity_id}"))?;
        self.reconcile_activity(&activity).await
    }

    pub async fn reconcile_activity(&self, activity: &Activity) -> anyhow::Result<Report> {
        metrics::counter!("flashsale_reconcile_runs_total").increment(1);
        let mut report = Report {
            activity_id: activity.id.clone(),
            checked_at: Utc::now(),
            ..Report::default()
        };
        // MySQL's record of the builds first, then Redis: a build recorded before
        // Redis is read is in what Redis shows, unless Redis went back in time.
        let fresh = self.reread(&activity.id).await?;
        // Redis, then the lag: a rebuild needs every message published before the
        // loss was seen to have reached MySQL.
        let snapshot = self
            .stock
            .snapshot(&activity.id, activity.stock_shards)
            .await?;
        // Redis had lost the activity by the time it answered (if it had): the
        // wait for publishes in flight at the loss counts from here, and a lag
        // read after it began counts every publish acknowledged before.
        let lag_measured = Instant::now();
        report.consumer_lag = self.measure_lag().await;
        report.loaded = snapshot.loaded();
        if !report.loaded {
            // A split activity with some shards lost: the others still sell and
            // hold reservations, so it is rebuilt whole, as over a stale state.
            let mode = if snapshot.partly_loaded() {
                PreloadMode::Force
            } else {
                PreloadMode::Missing
            };
            self.recover(&fresh, mode, lag_measured, &mut report)
                .await?;
            return Ok(report);
        }
        // A state older than MySQL's last build written: a primary that went back
        // in time (a failover to a replica that missed the build). Rebuilt like a
        // loss. (A build begun elsewhere that wrote nothing is no sign of it.)
        if let Some(epoch) = snapshot.epoch {
            let mysql_epoch = fresh.redis_built_epoch;
            if epoch < mysql_epoch {
                report.stale = true;
                metrics::counter!("flashsale_redis_stale_state_total").increment(1);
                tracing::error!(incident = true, activity_id = %activity.id, epoch, mysql_epoch, "Redis holds an older build of the activity");
                self.recover(&fresh, PreloadMode::Force, lag_measured, &mut report)
                    .await?;
                return Ok(report);
            }
        }
        self.found(&activity.id);
        if fresh.auto_paused {
            // Paused automatically, yet the state is whole and current: a build
            // whose own resume failed (MySQL refused it after Redis was written).
            // Redis is looked at once more, after that pause was read, so a loss
            // since then keeps it; then both switches open, as after a rebuild.
            let again = self
                .stock
                .snapshot(&activity.id, activity.stock_shards)
                .await?;
            let current = again.loaded()
                && again
                    .epoch
                    .is_some_and(|epoch| epoch >= fresh.redis_built_epoch);
            if current && self.activities.auto_resume(&activity.id).await? {
                report.resumed = true;
                self.stock
                    .set_paused(&activity.id, activity.stock_shards, false)
                    .await?;
                tracing::warn!(activity_id = %activity.id, "the activity is whole in Redis again; resumed it");
            }
        }
        self.decide_expired(activity, &mut report).await?;
        report.transfers_finished = self
            .stock
            .finish_transfers(
                &activity.id,
                activity.stock_shards,
                Utc::now().timestamp_millis() - TRANSFER_GRACE_MS,
            )
            .await?;
        report.topups_finished = self.finish_topups(activity).await?;
        self.audit(activity, &mut report).await?;
        self.remember(&report);
        Ok(report)
    }

    /// Redis does not hold the activity (`Missing`), or holds an older build of it
    /// (`Force`): pause it, and rebuild it from MySQL once every published
    /// reservation has reached MySQL.
    ///
    /// A reservation made in the lost state may still be waiting for the broker:
    /// acknowledged after the lag was measured, its order would reach MySQL after
    /// the build counted the units, and the rebuilt stock would hand its unit out
    /// again. So the lag that allows a build must have been measured at least a
    /// publish timeout after this instance first saw the loss; by then every such
    /// publish was acknowledged (and is in the lag) or failed.
    async fn recover(
        &self,
        activity: &Activity,
        mode: PreloadMode,
        lag_measured: Instant,
        report: &mut Report,
    ) -> anyhow::Result<()> {
        if activity.window(Utc::now()) != Window::Open {
            // Not selling: nothing to protect; the operator preloads before the start.
            return Ok(());
        }
        let since = *self
            .lost_since
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(activity.id.clone())
            .or_insert(lag_measured);
        let in_flight = self.in_flight();
        if !activity.paused {
            report.paused_automatically = self
                .activities
                .auto_pause(&activity.id, activity.redis_built_epoch)
                .await?;
            if report.paused_automatically {
                tracing::warn!(activity_id = %activity.id, "Redis lost the activity; paused it");
                metrics::counter!("flashsale_activity_auto_paused_total").increment(1);
            }
        }
        let lag = if lag_measured.saturating_duration_since(since) >= in_flight {
            report.consumer_lag
        } else {
            None
        };
        if lag.is_none() && report.consumer_lag.is_some() {
            report.rebuild_waiting = true;
            report.refused.push(format!(
                "rebuild waits out publishes that were in flight when the loss was seen ({in_flight:?})"
            ));
            return Ok(());
        }
        match self.rebuild(activity, mode, lag).await? {
            Rebuild::Waiting(why) => {
                report.rebuild_waiting = true;
                report.refused.push(format!("rebuild {why}"));
                return Ok(());
            }
            Rebuild::Built(build) => {
                report.rebuilt = true;
                tracing::warn!(activity_id = %activity.id, available = build.available, buyers = build.buyers.len(), "activity rebuilt from MySQL");
                metrics::counter!("flashsale_activity_rebuilt_total").increment(1);
            }
            Rebuild::AlreadyLoaded => {}
        }
        let fresh = self.reread(&activity.id).await?;
        if fresh.auto_paused || !fresh.paused {
            report.resumed = self.activities.auto_resume(&activity.id).await?;
            // Whoever built the state, it should now be open.
            self.stock
                .set_paused(&activity.id, activity.stock_shards, false)
                .await?;
        }
        Ok(())
    }

    /// (Re)builds an activity's Redis state from MySQL, the one way both the
    /// automatic recovery and the operator's preload do it:
    /// - an activity that was ever loaded may have messages in the queue whose
    ///   orders MySQL does not hold yet; the build waits until the consumers have
    ///   drained it (`lag`, measured by the caller after Redis was found lost);
    /// - a forced build over a loaded state first decides every pending
    ///   reservation (acknowledged ones become orders, the rest are withdrawn), so
    ///   nothing acknowledged is forgotten and nothing is counted twice;
    /// - MySQL is read in one locked snapshot, and the units of failed and
    ///   cancelled orders are recorded as returned in the new state, so a late
    ///   refund of one is a no-op.
    pub async fn rebuild(
        &self,
        activity: &Activity,
        mode: PreloadMode,
        lag: Option<i64>,
    ) -> anyhow::Result<Rebuild> {
        let fresh = self.reread(&activity.id).await?;
        if fresh.redis_epoch > 0 {
            match lag {
                Some(0) => {}
                Some(n) => {
                    return Ok(Rebuild::Waiting(format!(
                        "waits for the consumers to drain the queue ({n} messages left)"
                    )))
                }
                None => {
                    return Ok(Rebuild::Waiting(
                        "waits: the consumers' lag is unknown".into(),
                    ))
                }
            }
        }
        if mode == PreloadMode::Force {
            // No new reservation while the pending ones are decided and the state
            // is replaced; `preload.lua` leaves alone a sale reopened meanwhile.
            self.stock
                .set_paused(&activity.id, activity.stock_shards, true)
                .await?;
        }
        let built = self.replace_state(&fresh, mode).await;
        if mode == PreloadMode::Force && !matches!(built, Ok(Rebuild::Built(_))) {
            // Put the switch back as MySQL has it.
            if let Err(err) = self
                .stock
                .set_paused(&activity.id, activity.stock_shards, fresh.paused)
                .await
            {
                tracing::warn!(error = %err, activity_id = %activity.id, "could not restore the live switch");
            }
        }
        let built = built?;
        if !matches!(built, Rebuild::Waiting(_)) {
            // The state is whole again, whoever wrote it: a later loss is timed
            // from its own first sight, never from this one's.
            self.found(&activity.id);
        }
        Ok(built)
    }

    async fn replace_state(
        &self,
        activity: &Activity,
        mode: PreloadMode,
    ) -> anyhow::Result<Rebuild> {
        if mode == PreloadMode::Force {
            let mut report = Report::default();
            // Everything pending up to now (and a little beyond, for clock skew).
            let until = Utc::now().timestamp_millis() + 60_000;
            self.decide_pending(activity, until, &mut report).await?;
        }
        let build = self
            .activities
            .build_snapshot(&activity.id)
            .await?
            .ok_or_else(|| anyhow::anyhow!("activity {} vanished", activity.id))?;
        let built = self
            .stock
            .preload(&activity.id, activity.stock_shards, &build, mode)
            .await?;
        if built {
            self.activities
                .record_build(&activity.id, build.epoch)
                .await?;
            // Read again at once now that the build is recorded: an automatic
            // pause that landed since `activity` was read (an instance that
            // looked at Redis before this build wrote it) is lifted here, not
            // left to nobody. A pause taken later carries this build's epoch.
            let now = self.reread(&activity.id).await?;
            if !build.paused && now.auto_paused {
                self.activities.auto_resume(&activity.id).await?;
            }
            // The build is written whatever happens here: a unit not returned
            // now is missing from Redis, which the drift repair finds and adds.
            if let Err(err) = self.return_late_lapses(activity, &build).await {
                tracing::warn!(error = %err, activity_id = %activity.id, "could not return the lapses cancelled during the rebuild; left to the drift repair");
            }
        }
        Ok(if built {
            Rebuild::Built(build)
        } else {
            Rebuild::AlreadyLoaded
        })
    }

    /// Returns to the state just written the units of orders cancelled after the
    /// build's snapshot (a payment that lapsed meanwhile). The sweeper cancelled
    /// such an order after the snapshot was read, so its unit is not in the
    /// build's stock; and it may have returned the unit before the build was
    /// written (into the state the build replaced, or to a Redis that had lost
    /// the activity), where the build wiped it. Read only now, after the write:
    /// a lapse cancelled later still is refunded by the sweeper into this state.
    /// Each refund is once per reservation in this state, so this and the
    /// sweeper's never both count; a newer build that read the lapse holds it
    /// among its returned units, and this is a no-op there.
    async fn return_late_lapses(&self, activity: &Activity, build: &Build) -> anyhow::Result<()> {
        let counted: std::collections::HashSet<&str> =
            build.returned.iter().map(String::as_str).collect();
        for order in self.orders.cancelled(&activity.id).await? {
            if counted.contains(order.reservation_id.as_str()) {
                continue;
            }
            let outcome = self
                .stock
                .refund(
                    &activity.id,
                    &order.reservation_id,
                    &order.user_id,
                    order.quantity,
                    RefundMode::Return,
                )
                .await?;
            if let RefundOutcome::Returned { units } = outcome {
                tracing::info!(activity_id = %activity.id, reservation_id = %order.reservation_id, units, "a lapse cancelled during the rebuild returned to the new state");
                metrics::counter!("flashsale_units_returned_total", "why" => "rebuild")
                    .increment(u64::from(units));
            }
        }
        Ok(())
    }

    async fn decide_expired(&self, activity: &Activity, report: &mut Report) -> anyhow::Result<()> {
        let deadline_ms = self.pending_deadline.as_millis().min(i64::MAX as u128) as i64;
        self.decide_pending(
            activity,
            Utc::now().timestamp_millis() - deadline_ms,
            report,
        )
        .await
    }

    /// Decides every reservation pending since before `before_ms`: acknowledged
    /// ones become orders, the others are withdrawn (see the module's notes).
    async fn decide_pending(
        &self,
        activity: &Activity,
        before_ms: i64,
        report: &mut Report,
    ) -> anyhow::Result<()> {
        let writer = OrderWriter::new(self.orders.clone(), self.stock.clone());
        let mut oldest_seen: Option<String> = None;
        loop {
            let expired = self
                .stock
                .expired_pending(
                    &activity.id,
                    activity.stock_shards,
                    before_ms,
                    EXPIRED_BATCH,
                )
                .await?;
            let Some(oldest) = expired.first().map(|p| p.reservation_id.clone()) else {
                return Ok(());
            };
            if oldest_seen.as_ref() == Some(&oldest) {
                // Settling made no progress (Redis refusing writes): next pass.
                return Ok(());
            }
            oldest_seen = Some(oldest);
            let full = expired.len() >= EXPIRED_BATCH;
            report.expired_pending += expired.len();
            let (acked, unacked): (Vec<_>, Vec<_>) = expired
                .into_iter()
                .partition(|p| p.fate == Fate::Acknowledged);
            let to_incoming = |p: crate::stock::PendingReservation| Incoming {
                reservation_id: p.reservation_id,
                activity_id: activity.id.clone(),
                user_id: p.user_id,
                quantity: p.units,
            };
            let acked: Vec<Incoming> = acked.into_iter().map(to_incoming).collect();
            if !acked.is_empty() {
                honour(&writer, &acked, report).await?;
            }
            let unacked: Vec<Incoming> = unacked.into_iter().map(to_incoming).collect();
            if !unacked.is_empty() {
                withdraw(&writer, &unacked, report).await?;
            }
            if !full {
                return Ok(());
            }
        }
    }

    /// Adds to Redis the top-ups MySQL holds and Redis may not (their request
    /// failed between the two); each is added once whoever tries.
    async fn finish_topups(&self, activity: &Activity) -> anyhow::Result<u64> {
        let mut added = 0;
        for (key, units) in self.activities.unapplied_topups(&activity.id).await? {
            match self
                .stock
                .top_up(&activity.id, activity.stock_shards, &key, units)
                .await?
            {
                RefundOutcome::Returned { .. } => {
                    added += 1;
                    self.activities.topup_applied(&key).await?;
                }
                RefundOutcome::AlreadyRefunded => self.activities.topup_applied(&key).await?,
                _ => {}
            }
        }
        Ok(added)
    }

    /// Every MySQL figure the audit needs, fresh: (stock, available, units in
    /// live orders, units owed to Redis).
    async fn mysql_figures(
        &self,
        activity_id: &str,
    ) -> Result<(i64, i64, i64, Vec<(String, u32)>), sqlx::Error> {
        let fresh = self
            .activities
            .get(activity_id)
            .await?
            .ok_or(sqlx::Error::RowNotFound)?;
        let live = self.orders.live_units(activity_id).await?;
        // Top-ups not yet in Redis among them, like refunds.
        let owed = self.orders.owed_to_redis(activity_id).await?;
        Ok((
            i64::from(fresh.stock),
            i64::from(fresh.available),
            live,
            owed,
        ))
    }

    async fn audit(&self, activity: &Activity, report: &mut Report) -> anyhow::Result<()> {
        // Every MySQL figure fresh, and read before Redis (as the stale check
        // reads the builds): a change MySQL commits after this read is either
        // already in Redis too, and the second read below sees it and refuses, or
        // not yet in Redis, which is no drift. The caller's `activity` may come
        // from an instance's cache, a second old: a top-up's units in its `stock`
        // would be missing, and the new units in Redis would read as drift and be
        // "repaired" away.
        let (total, available, live, owed) = self.mysql_figures(&activity.id).await?;
        report.mysql = MysqlFigures {
            stock: total,
            available,
            live_units: live,
            expected_available: total - live,
        };
        if available != total - live {
            report.refused.push(format!(
                "MySQL's available count ({available}) differs from stock minus live orders ({}); left for an operator",
                total - live
            ));
        }
        let shards = activity.stock_shards;
        let audit = self
            .stock
            .audit(&activity.id, shards, total, live, &owed)
            .await?;
        report.redis = Some(audit.clone());
        if !audit.loaded {
            return Ok(());
        }
        report.drift = audit.stock - audit.expected;
        metrics::gauge!("flashsale_activity_drift_units", "activity_id" => activity.id.clone())
            .set(report.drift as f64);
        if report.drift == 0 {
            return Ok(());
        }
        metrics::counter!("flashsale_reconcile_drift_found_total").increment(1);
        tracing::warn!(activity_id = %activity.id, drift = report.drift, ?audit, "Redis stock differs from MySQL");
        self.repair(activity, (total, live, &owed), &audit, report)
            .await
    }

    /// Repairs the drift `audit` found, unless the consumers still have lag or
    /// MySQL's figures (`seen`: stock, live units, owed units) or Redis changed
    /// since they were read.
    async fn repair(
        &self,
        activity: &Activity,
        (total, live, owed): (i64, i64, &[(String, u32)]),
        audit: &Audit,
        report: &mut Report,
    ) -> anyhow::Result<()> {
        if report.consumer_lag != Some(0) {
            report
                .refused
                .push("repair refused: the consumers still have lag".into());
            return Ok(());
        }
        let (total_again, _, live_again, owed_again) = self.mysql_figures(&activity.id).await?;
        if total_again != total || live_again != live || owed_again != owed {
            report
                .refused
                .push("repair refused: MySQL changed during the check; next pass".into());
            return Ok(());
        }
        let repaired = self
            .stock
            .repair(
                &activity.id,
                activity.stock_shards,
                total,
                live,
                owed,
                audit,
            )
            .await?;
        report.repaired = repaired.repaired;
        if repaired.repaired {
            metrics::counter!("flashsale_reconcile_drift_repaired_total").increment(1);
            tracing::warn!(activity_id = %activity.id, from = audit.stock, to = audit.expected, "Redis stock repaired from MySQL");
        } else {
            report
                .refused
                .push("repair refused: Redis changed during the check; next pass".into());
        }
        Ok(())
    }

    /// Runs a pass over every current activity each `interval`, or at once when
    /// `wake` is notified (the API saw an activity missing from Redis).
    pub async fn run(
        self,
        cache: ActivityCache,
        interval: Duration,
        wake: Arc<Notify>,
        shutdown: CancellationToken,
    ) {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // A sale paused for a rebuild that waits for the consumers is retried
        // every second, not at the next interval: it is not selling meanwhile.
        let mut rebuild_waiting = false;
        loop {
            let retry = self.next_retry();
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {}
                _ = tokio::time::sleep_until(retry.into()), if rebuild_waiting => {}
                _ = wake.notified() => {}
            }
            rebuild_waiting = false;
            // The lag is measured at every pass, with or without a current
            // activity, so its gauge (and the alert on it) is there from the
            // first pass after a start.
            self.measure_lag().await;
            for activity in cache.current_activities(Utc::now()) {
                match self.reconcile_activity(&activity).await {
                    Ok(r) if r.rebuild_waiting => {
                        rebuild_waiting = true;
                        tracing::info!(report = ?r, "reconcile pass; the rebuild waits");
                    }
                    Ok(r)
                        if r.drift != 0
                            || r.withdrawn > 0
                            || r.honoured > 0
                            || r.rebuilt
                            || r.transfers_finished > 0
                            || !r.refused.is_empty() =>
                    {
                        tracing::info!(report = ?r, "reconcile pass");
                    }
                    Ok(_) => {}
                    Err(err) => {
                        tracing::warn!(error = %err, activity_id = %activity.id, "reconcile pass failed");
                    }
                }
            }
            // Only the first set counts; later ones change nothing.
            let _ = self.first_pass.set(());
        }
    }

    /// The consumer group's lag into `flashsale_consumer_lag_messages`; a broker
    /// that does not answer leaves the gauge as it was (and says so in the log).
    pub async fn measure_lag(&self) -> Option<i64> {
        match self.lag_probe.lag(LAG_READ_TIMEOUT).await {
            Ok(lag) => {
                metrics::gauge!("flashsale_consumer_lag_messages").set(lag as f64);
                Some(lag)
            }
            Err(err) => {
                tracing::warn!(error = %err, "consumer lag unknown");
                None
            }
        }
    }
}

impl Report {
    /// Counts what MySQL decided for reservations the reconciler meant to become
    /// `wanted`; returns how many did (the others are tallied here).
    fn tally(&mut self, decisions: &[Decision], wanted: &Decision) -> usize {
        let mut got = 0;
        for d in decisions {
            match d {
                d if d == wanted => got += 1,
                Decision::Superseded => self.superseded += 1,
                Decision::Refused { .. } => self.no_units += 1,
                _ => self.already_in_mysql += 1,
            }
        }
        got
    }

    /// A few lines for a terminal.
    pub fn summary(&self) -> String {
        let mut s = format!(
            "activity {}: {}\n",
            self.activity_id,
            if self.loaded {
                "loaded in Redis"
            } else {
                "NOT loaded in Redis"
            }
        );
        if let Some(a) = &self.redis {
            s.push_str(&format!(
                "  redis stock {} (expected {}), pending units {}, owed back {}\n",
                a.stock, a.expected, a.pending_units, a.owed_units
            ));
        }
        s.push_str(&format!(
            "  mysql stock {}, available {}, live units {}\n",
            self.mysql.stock, self.mysql.available, self.mysql.live_units
        ));
        s.push_str(&format!(
            "  expired pending {}: honoured {}, withdrawn {}, already in MySQL {}, superseded {}, no units {}\n",
            self.expired_pending,
            self.honoured,
            self.withdrawn,
            self.already_in_mysql,
            self.superseded,
            self.no_units
        ));
        let lag = self
            .consumer_lag
            .map_or_else(|| "unknown".to_owned(), |l| l.to_string());
        s.push_str(&format!(
            "  drift {}, repaired {}, consumer lag {lag}",
            self.drift, self.repaired
        ));
        if self.paused_automatically || self.rebuilt || self.resumed {
            s.push_str(&format!(
                "\n  paused automatically {}, rebuilt {}, resumed {}",
                self.paused_automatically, self.rebuilt, self.resumed
            ));
        }
        for r in &self.refused {
            s.push_str(&format!("\n  note: {r}"));
        }
        s
    }
}

/// Makes orders of acknowledged reservations: the consumer's own write, one
/// batch, then one by one if MySQL refuses some as bad data (those are withdrawn
/// and reported), so one bad reservation never blocks the others. MySQL errors
/// are retried for a while, then left for the next pass.
async fn honour(
    writer: &OrderWriter,
    acked: &[Incoming],
    report: &mut Report,
) -> anyhow::Result<()> {
    let deadline = CancellationToken::new();
    let timer = {
        let deadline = deadline.clone();
        tokio::spawn(async move {
            tokio::time::sleep(HONOUR_TIMEOUT).await;
            deadline.cancel();
        })
    };
    let written = writer.write(acked, &deadline).await;
    timer.abort();
    let (decisions, refused) = written.ok_or_else(|| {
        anyhow::anyhow!("MySQL did not take the honoured orders within {HONOUR_TIMEOUT:?}")
    })?;
    for (i, reason) in refused {
        if let Some(m) = acked.get(i) {
            tracing::error!(incident = true, reservation_id = %m.reservation_id, %reason, "an acknowledged reservation's order was refused as bad data");
        }
    }
    let honoured = report.tally(&decisions, &Decision::Ordered);
    report.honoured += honoured;
    metrics::counter!("flashsale_reconcile_honoured_reservations_total").increment(honoured as u64);
    writer.settle(acked, &decisions).await;
    Ok(())
}

/// Withdraws reservations never acknowledged: they never become orders.
async fn withdraw(
    writer: &OrderWriter,
    unacked: &[Incoming],
    report: &mut Report,
) -> anyhow::Result<()> {
    let decided = writer
        .withdraw(
            unacked,
            "withdrawn by the reconciler before it reached an order",
        )
        .await?;
    let decisions: Vec<Decision> = decided.into_iter().map(|(_, d)| d).collect();
    let withdrawn = report.tally(&decisions, &Decision::Withdrawn);
    report.withdrawn += withdrawn;
    metrics::counter!("flashsale_reconcile_withdrawn_reservations_total")
        .increment(withdrawn as u64);
    Ok(())
}
