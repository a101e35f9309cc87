//! The reconciler: makes Redis agree with MySQL (the source of truth) again after
//! whatever failed, without ever letting MySQL oversell.
//!
//! For one activity, one pass:
//! 1. **Redis lost the activity** (restart, failover, flush): the activity is paused
//!    automatically (reservations already answer 503). Once every publish that was
//!    in flight at the loss has landed or failed, the activity's own messages still
//!    in the topic are written as orders (the consumer's write, so the consumer
//!    later finds them done), and it is rebuilt from MySQL and resumed. It waits
//!    for nothing else: not for the consumers to reach those messages, nor for the
//!    other sales' backlog. An operator may rebuild at once with the preload
//!    endpoint.
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
//!    when it is safe: the activity's own messages still in the topic are orders
//!    and settled, MySQL did not change while Redis was read, and Redis still
//!    holds what was read (compare-and-set).
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
use crate::orders::{consumer, Decision, Incoming, OrderRepo, OrderWriter};
use crate::stock::{Audit, Fate, PreloadMode, RefundMode, RefundOutcome, StockStore};

const EXPIRED_BATCH: usize = 500;
/// How soon a rebuild that waits (for publishes in flight, or for the broker or
/// MySQL to answer) is tried again.
const REBUILD_RETRY: Duration = Duration::from_millis(250);
/// How long one pass keeps retrying MySQL for the orders it honours.
const HONOUR_TIMEOUT: Duration = Duration::from_secs(10);
/// Pending reservations a drift repair checks against MySQL, at most (with
/// more pending, the repair waits for a quieter pass).
const REPAIR_PENDING_CHECKED: usize = 5_000;
/// Sales whose Redis state is removed in one pass, at most (the others wait for
/// the next).
const REMOVE_BATCH: u32 = 20;
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
    /// A rebuild is due but waits (for publishes in flight at the loss, or for
    /// the broker or MySQL).
    pub rebuild_waiting: bool,
    pub rebuilt: bool,
    pub resumed: bool,
    /// Pending reservations past the deadline, and what became of them.
    pub expired_pending: usize,
    /// Acknowledged reservations the reconciler turned into orders itself.
    pub honoured: usize,
    /// The activity's messages found in the topic, not yet committed by the
    /// consumers, when a rebuild or a repair needed them in MySQL first.
    pub in_flight_messages: usize,
    /// How many of those the reconciler wrote as orders itself (the others were
    /// orders already, or decided otherwise).
    pub in_flight_ordered: usize,
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

/// MySQL's figures a drift was measured against: the activity's stock, the
/// units of its live orders, and the units owed back to Redis.
type Seen = (i64, i64, Vec<(String, u32)>);

/// What a rebuild did.
#[derive(Debug)]
pub enum Rebuild {
    Built(Build),
    /// `Missing` found the activity loaded: nothing to do.
    AlreadyLoaded,
    /// Not safe yet, and why.
    Waiting(String),
    /// The sale ended longer ago than its retention: its state was removed (or
    /// is about to be) and is never built again.
    Removed,
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
/// How long one reading of the topic's uncommitted messages goes on; a longer
/// backlog is read over several passes, each resuming where the last stopped.
const IN_FLIGHT_READ_BUDGET: Duration = Duration::from_secs(2);

#[derive(Clone)]
pub struct Reconciler {
    pub activities: ActivityRepo,
    pub orders: OrderRepo,
    pub stock: StockStore,
    pub kafka: KafkaSettings,
    /// The consumers' lag, read on one long-lived client.
    pub lag_probe: kafka::LagProbe,
    pub pending_deadline: Duration,
    /// How long after its end a sale's Redis state is removed.
    pub retain_after_end: Duration,
    /// The last report of each activity this instance reconciled.
    pub last: Arc<std::sync::Mutex<std::collections::HashMap<String, Report>>>,
    /// When this instance first found each activity lost from Redis.
    pub lost_since: Arc<std::sync::Mutex<std::collections::HashMap<String, Instant>>>,
    /// Per activity being rebuilt, where its reading of the topic stopped (per
    /// partition); the messages before that are written already.
    scans: Arc<
        std::sync::Mutex<std::collections::HashMap<String, std::collections::HashMap<i32, i64>>>,
    >,
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
        retain_after_end: Duration,
    ) -> Self {
        Reconciler {
            activities,
            orders,
            stock,
            lag_probe: kafka::LagProbe::new(kafka.clone()),
            kafka,
            pending_deadline,
            retain_after_end,
            last: Arc::default(),
            lost_since: Arc::default(),
            scans: Arc::default(),
            first_pass: Arc::default(),
        }
    }

    /// The activity is in Redis again: a later loss waits from its own start,
    /// and reads the topic from the consumers' committed offsets.
    fn found(&self, activity_id: &str) {
        self.lost_since
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(activity_id);
        self.scans
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(activity_id);
    }

    /// How long a publish may still be on its way: the publish timeout, and the
    /// time for its acknowledgement to reach the service and its offset the lag.
    fn in_flight(&self) -> Duration {
        self.kafka.publish_timeout() + PUBLISH_GRACE
    }

    /// Waits until every publish that may have been in flight when the activity
    /// was lost (as this instance first saw it, or now) has been acknowledged,
    /// and so is in the topic, or has failed. The operator's preload waits for it
    /// as the automatic rebuild does (`recover`): a reservation made in the lost
    /// state and acknowledged after the rebuild read the topic would reach MySQL
    /// after the build counted its unit as for sale.
    pub async fn wait_published(&self, activity_id: &str) {
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
    }

    /// Writes as orders the activity's messages still in the topic: published
    /// before now, not yet committed by the consumers. The same write as the
    /// consumer's, under the same locks and unique keys, then the same settling
    /// in Redis, so the consumer finds each one done when it gets there, and a
    /// message another reconciler or the consumer writes meanwhile is a
    /// duplicate. Only this activity's messages are written; the others' are read
    /// and skipped. A backlog too long for one read (`IN_FLIGHT_READ_BUDGET`) is
    /// read over several calls, each resuming where the last one's messages were
    /// written. Returns whether the topic was read to its end.
    async fn settle_in_flight(
        &self,
        activity: &Activity,
        report: &mut Report,
    ) -> anyhow::Result<bool> {
        let started = Instant::now();
        let from = self
            .scans
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&activity.id)
            .cloned()
            .unwrap_or_default();
        let found = self
            .lag_probe
            .in_flight(&activity.id, from, IN_FLIGHT_READ_BUDGET)
            .await?;
        let read_ms = started.elapsed().as_millis();
        metrics::gauge!("flashsale_consumer_lag_messages").set(found.lag as f64);
        report.consumer_lag = Some(found.lag);
        // A message that cannot be decoded is the consumers' to dead-letter.
        let incoming: Vec<Incoming> = found
            .payloads
            .iter()
            .filter_map(|p| consumer::parse(Some(p)).ok())
            .collect();
        report.in_flight_messages += incoming.len();
        let mut ordered = 0;
        if !incoming.is_empty() {
            let writer = OrderWriter::new(self.orders.clone(), self.stock.clone());
            let honoured = report.honoured;
            honour(&writer, &incoming, report).await?;
            ordered = report.honoured - honoured;
            report.in_flight_ordered += ordered;
            metrics::counter!("flashsale_reconcile_in_flight_orders_total")
                .increment(ordered as u64);
        }
        // Written: a later read of this sale need not read them again.
        self.scans
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(activity.id.clone(), found.next);
        tracing::info!(activity_id = %activity.id, messages = incoming.len(), ordered, read = found.read, lag = found.lag, complete = found.complete, read_ms, took_ms = started.elapsed().as_millis(), "the activity's messages still in the topic are orders");
        Ok(found.complete)
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

    /// Whether the sale ended longer ago than `redis.retain_after_end_secs`, or
    /// its state was removed: it is never loaded into Redis again.
    pub fn past_retention(&self, activity: &Activity) -> bool {
        activity.redis_removing
            || chrono::Duration::from_std(self.retain_after_end)
                .ok()
                .and_then(|retain| activity.ends_at.checked_add_signed(retain))
                .is_some_and(|until| until <= Utc::now())
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
        let lag = self.measure_lag().await;
        self.pass(activity, lag).await
    }

    /// One activity's pass, with the consumers' lag as the caller read it (for
    /// the report: no decision rests on it).
    async fn pass(&self, activity: &Activity, consumer_lag: Option<i64>) -> anyhow::Result<Report> {
        metrics::counter!("flashsale_reconcile_runs_total").increment(1);
        let mut report = Report {
            activity_id: activity.id.clone(),
            checked_at: Utc::now(),
            consumer_lag,
            ..Report::default()
        };
        // MySQL's record of the builds first, then Redis: a build recorded before
        // Redis is read is in what Redis shows, unless Redis went back in time.
        let fresh = self.reread(&activity.id).await?;
        let snapshot = self
            .stock
            .snapshot(&activity.id, activity.stock_shards)
            .await?;
        // Redis had lost the activity by the time it answered (if it had): the
        // wait for publishes in flight at the loss counts from here.
        let lost_seen = Instant::now();
        report.loaded = snapshot.loaded();
        if !report.loaded {
            // A split activity with some shards lost: the others still sell and
            // hold reservations, so it is rebuilt whole, as over a stale state.
            let mode = if snapshot.partly_loaded() {
                PreloadMode::Force
            } else {
                PreloadMode::Missing
            };
            self.recover(&fresh, mode, lost_seen, &mut report).await?;
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
                self.recover(&fresh, PreloadMode::Force, lost_seen, &mut report)
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
    /// reservation of it has reached MySQL.
    ///
    /// A reservation made in the lost state may still be waiting for the broker:
    /// acknowledged after the rebuild read the topic, its order would reach MySQL
    /// after the build counted the units, and the rebuilt stock would hand its
    /// unit out again. So the rebuild reads the topic at least a publish timeout
    /// after this instance first saw the loss; by then every such publish was
    /// acknowledged (and is in the topic, below the end offsets the rebuild
    /// reads) or failed.
    async fn recover(
        &self,
        activity: &Activity,
        mode: PreloadMode,
        lost_seen: Instant,
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
            .or_insert(lost_seen);
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
        if lost_seen.saturating_duration_since(since) < in_flight {
            report.rebuild_waiting = true;
            report.refused.push(format!(
                "rebuild waits out publishes that were in flight when the loss was seen ({in_flight:?})"
            ));
            return Ok(());
        }
        match self.rebuild(activity, mode, report).await? {
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
            Rebuild::AlreadyLoaded | Rebuild::Removed => {}
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
    ///   orders MySQL does not hold yet; they are written as orders first
    ///   (`settle_in_flight`), whatever the consumers' backlog. The caller waited
    ///   out the publishes in flight when Redis was found lost (`wait_published`),
    ///   or Redis holds the activity and the forced build withdraws what was not
    ///   acknowledged (below);
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
        report: &mut Report,
    ) -> anyhow::Result<Rebuild> {
        let fresh = self.reread(&activity.id).await?;
        // Read again here, just before the build: a sale removed (or due) since
        // the caller looked is never brought back.
        if self.past_retention(&fresh) {
            return Ok(Rebuild::Removed);
        }
        if fresh.redis_epoch > 0 {
            match self.settle_in_flight(&fresh, report).await {
                Ok(true) => {}
                Ok(false) => {
                    return Ok(Rebuild::Waiting(format!(
                        "waits: the topic is still being read for the activity's messages (the consumers' backlog is {} messages)",
                        report.consumer_lag.unwrap_or_default()
                    )))
                }
                Err(err) => {
                    return Ok(Rebuild::Waiting(format!(
                        "waits: the activity's messages still in the topic are not all orders yet ({err:#})"
                    )))
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
        } else if self.past_retention(&self.reread(&activity.id).await?) {
            // Left alone for the marker of a removal that began meanwhile.
            Rebuild::Removed
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

    /// Compares Redis with MySQL, and repairs a drift when it is safe. A
    /// reservation the consumers wrote to MySQL and have not settled in Redis
    /// yet is counted by MySQL's live units and by Redis's pending units at
    /// once, which reads as drift that is not: so a repair waits while any
    /// reservation pending in Redis (read after the audit) is an order in
    /// MySQL. One settled in between changes the pending units the repair's
    /// compare-and-set checks, and one written in between changes the live
    /// units MySQL is read for again. A message of the sale still in the topic
    /// needs no wait: its reservation is pending in Redis (counted once), or
    /// decided in MySQL already (its message a duplicate, or superseded).
    async fn audit(&self, activity: &Activity, report: &mut Report) -> anyhow::Result<()> {
        let Some((figures, audit)) = self.measure_drift(activity, report).await? else {
            return Ok(());
        };
        if audit.pending_units != 0 {
            let pending = self
                .stock
                .expired_pending(
                    &activity.id,
                    activity.stock_shards,
                    i64::MAX,
                    REPAIR_PENDING_CHECKED,
                )
                .await?;
            if pending.len() >= REPAIR_PENDING_CHECKED {
                report.refused.push(format!(
                    "repair refused: {} or more reservations pending in Redis; next pass",
                    pending.len()
                ));
                return Ok(());
            }
            let ids: Vec<String> = pending.into_iter().map(|p| p.reservation_id).collect();
            let unsettled = self.orders.count_orders_of(&ids).await?;
            if unsettled > 0 {
                report.refused.push(format!(
                    "repair refused: {unsettled} reservations pending in Redis are orders in MySQL, not settled yet; next pass"
                ));
                return Ok(());
            }
        }
        self.repair(activity, figures, &audit, report).await
    }

    /// MySQL's figures and Redis's audit, and the drift between them into the
    /// report; `None` when there is nothing to repair (no drift, or not loaded).
    async fn measure_drift(
        &self,
        activity: &Activity,
        report: &mut Report,
    ) -> anyhow::Result<Option<(Seen, Audit)>> {
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
            return Ok(None);
        }
        report.drift = audit.stock - audit.expected;
        metrics::gauge!("flashsale_activity_drift_units", "activity_id" => activity.id.clone())
            .set(report.drift as f64);
        if report.drift == 0 {
            return Ok(None);
        }
        metrics::counter!("flashsale_reconcile_drift_found_total").increment(1);
        tracing::warn!(activity_id = %activity.id, drift = report.drift, ?audit, "Redis stock differs from MySQL");
        Ok(Some(((total, live, owed), audit)))
    }

    /// Repairs the drift `audit` found, unless MySQL's figures (`seen`: stock,
    /// live units, owed units) or Redis changed since they were read.
    async fn repair(
        &self,
        activity: &Activity,
        (total, live, owed): Seen,
        audit: &Audit,
        report: &mut Report,
    ) -> anyhow::Result<()> {
        let owed = owed.as_slice();
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
            let ticked = tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => true,
                _ = tokio::time::sleep_until(retry.into()), if rebuild_waiting => false,
                _ = wake.notified() => false,
            };
            rebuild_waiting = false;
            // The lag is measured at every pass, with or without a current
            // activity, so its gauge (and the alert on it) is there from the
            // first pass after a start.
            let lag = self.measure_lag().await;
            let started = Instant::now();
            let now = Utc::now();
            let lost: std::collections::HashSet<String> = self
                .lost_since
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .keys()
                .cloned()
                .collect();
            let mut passed = 0u32;
            for activity in cache.current_activities(now) {
                match self.due(&activity, ticked, &lost, now).await {
                    Ok(true) => {}
                    Ok(false) => continue,
                    Err(err) => {
                        tracing::warn!(error = %err, activity_id = %activity.id, "reconcile look failed");
                        continue;
                    }
                }
                passed += 1;
                match self.pass(&activity, lag).await {
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
            metrics::gauge!("flashsale_reconcile_pass_activities").set(f64::from(passed));
            metrics::histogram!("flashsale_reconcile_pass_seconds")
                .record(started.elapsed().as_secs_f64());
            if ticked {
                if let Err(err) = self.remove_ended().await {
                    tracing::warn!(error = %err, "looking for ended sales to remove from Redis failed; next pass");
                }
            }
            // Only the first set counts; later ones change nothing.
            let _ = self.first_pass.set(());
        }
    }

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
    /// with it. Nothing else brings a removed state back: the reconciler
    /// rebuilds only open sales, and the scripts a late message or a lapse runs
    /// write nothing where the stock key is missing. One sale that fails is
    /// logged and skipped. Returns how many sales it removed.
    pub async fn remove_ended(&self) -> anyhow::Result<usize> {
        let Some(cutoff) = chrono::Duration::from_std(self.retain_after_end)
            .ok()
            .and_then(|retain| Utc::now().checked_sub_signed(retain))
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
    async fn remove_one(&self, a: &Activity) -> anyhow::Result<bool> {
        if !a.redis_removing {
            if a.ends_at + crate::activity::LOOKED_AFTER > Utc::now() {
                if a.admission == crate::activity::Admission::WaitingRoom {
                    return Ok(false);
                }
                let snapshot = self.stock.snapshot(&a.id, a.stock_shards).await?;
                if snapshot.pending > 0 {
                    tracing::info!(activity_id = %a.id, pending = snapshot.pending, "an ended sale's Redis state waits for its pending reservations before it is removed");
                    return Ok(false);
                }
            }
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

    /// Whether an activity needs a full pass now, after one look at Redis (no
    /// MySQL): a sale that lost its state (or that this instance saw lost)
    /// always; otherwise only at the interval's tick (a rebuild's retry and
    /// the API's wake-up are for lost sales), and then an open sale always, an
    /// ended one only while a reservation of it is pending (nothing else of an
    /// ended sale needs the reconciler: a lost one is not rebuilt, a late
    /// message or lapse is the consumer's and the sweeper's). So the pass costs
    /// what the live sales cost, however many ended in the last hour.
    async fn due(
        &self,
        activity: &Activity,
        ticked: bool,
        lost: &std::collections::HashSet<String>,
        now: chrono::DateTime<Utc>,
    ) -> anyhow::Result<bool> {
        if lost.contains(&activity.id) {
            return Ok(true);
        }
        let open = activity.window(now) == Window::Open;
        if !ticked && !open {
            return Ok(false);
        }
        let snapshot = self
            .stock
            .snapshot(&activity.id, activity.stock_shards)
            .await?;
        Ok(match (open, snapshot.loaded()) {
            (true, false) => true,
            (true, true) => ticked,
            (false, _) => snapshot.pending > 0,
        })
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
