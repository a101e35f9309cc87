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
//!    when it is safe: no reservation pending in Redis is an order in MySQL not
//!    settled yet, MySQL did not change while Redis was read, and Redis still
//!    holds what was read (compare-and-set).
//!
//! 4. **Retention**: a finished sale's state is removed from Redis for good
//!    `redis.retain_after_end_secs` after its end.
//!
//! Every step is idempotent and safe to run on several instances at once.
//!
//! Layout: this file holds the reconciler, its report and its loop; each step
//! is a file of its own (`rebuild`, `pending`, `drift`, `retention`), and what
//! each step decides is a pure function in `decide`, tested without Redis or
//! MySQL.

mod decide;
mod drift;
mod pending;
mod rebuild;
mod retention;

pub use rebuild::Rebuild;

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use serde::Serialize;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::activity::{Activity, ActivityCache, ActivityRepo, Window};
use crate::config::KafkaSettings;
use crate::kafka;
use crate::orders::{Decision, OrderRepo};
use crate::stock::{Audit, PreloadMode, StockStore};

/// A transfer between stock shards older than this was left half done by its
/// borrower (a borrower finishes its own within one round trip).
const TRANSFER_GRACE_MS: i64 = 2_000;

/// What one pass found and did, for the operator.
#[derive(Debug, Clone, Default, Serialize, utoipa::ToSchema)]
pub struct Report {
    pub activity_id: String,
    pub checked_at: chrono::DateTime<Utc>,
    /// Messages the consumers have not committed yet, all sales together (for
    /// the operator: no decision rests on it); `None` if the broker did not
    /// answer.
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

#[derive(Debug, Clone, Default, Serialize, utoipa::ToSchema)]
pub struct MysqlFigures {
    pub stock: i64,
    pub available: i64,
    pub live_units: i64,
    /// `stock - live_units`; differs from `available` only if MySQL itself is
    /// inconsistent (reported, never repaired automatically).
    pub expected_available: i64,
}

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
    /// How long after its end a sale's Redis state is removed.
    pub retain_after_end: Duration,
    /// How long after its end a waiting room's loop still steps it (its last
    /// turns run out): its state is not removed before.
    pub room_after_end: chrono::Duration,
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
    /// Lifts `activity`'s automatic pause (read by the caller) when Redis, read
    /// now, after that pause was read, holds the activity whole and current
    /// (no older build than the last recorded), and opens the live switch. A
    /// loss seen since the pause was read keeps it.
    pub(crate) async fn lift_if_whole(&self, activity: &Activity) -> anyhow::Result<bool> {
        let again = self
            .stock
            .snapshot(&activity.id, activity.stock_shards)
            .await?;
        let current = again.loaded()
            && again
                .epoch
                .is_some_and(|epoch| epoch >= activity.redis_built_epoch);
        if current && self.activities.auto_resume(&activity.id).await? {
            self.stock
                .set_paused(&activity.id, activity.stock_shards, false)
                .await?;
            return Ok(true);
        }
        Ok(false)
    }

    pub fn new(
        activities: ActivityRepo,
        orders: OrderRepo,
        stock: StockStore,
        kafka: KafkaSettings,
        pending_deadline: Duration,
        retain_after_end: Duration,
        turn: Duration,
    ) -> Self {
        Reconciler {
            activities,
            orders,
            stock,
            lag_probe: kafka::LagProbe::new(kafka.clone()),
            kafka,
            pending_deadline,
            retain_after_end,
            room_after_end: crate::waiting_room::loop_after_end(turn),
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
            checked_at: self.stock.clock().now(),
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
        match decide::state(
            report.loaded,
            snapshot.partly_loaded(),
            snapshot.epoch,
            fresh.redis_built_epoch,
        ) {
            decide::State::Lost(mode) => {
                self.recover(&fresh, mode, lost_seen, &mut report).await?;
                return Ok(report);
            }
            decide::State::Stale => {
                report.stale = true;
                metrics::counter!("flashsale_redis_stale_state_total").increment(1);
                tracing::error!(incident = true, activity_id = %activity.id, epoch = ?snapshot.epoch, mysql_epoch = fresh.redis_built_epoch, "Redis holds an older build of the activity");
                self.recover(&fresh, PreloadMode::Force, lost_seen, &mut report)
                    .await?;
                return Ok(report);
            }
            decide::State::Whole => {}
        }
        self.found(&activity.id);
        if fresh.auto_paused {
            // Paused automatically, yet the state is whole and current: a build
            // whose own resume failed (MySQL refused it after Redis was written).
            // Redis is looked at once more, after that pause was read, so a loss
            // since then keeps it; then both switches open, as after a rebuild.
            // Under the build lock: a build elsewhere may be between two shards.
            if let Some(lock) = self
                .activities
                .build_lock(&activity.id, Duration::ZERO)
                .await?
            {
                let lifted = self.lift_if_whole(&fresh).await;
                lock.release().await;
                if lifted? {
                    report.resumed = true;
                    tracing::warn!(activity_id = %activity.id, "the activity is whole in Redis again; resumed it");
                }
            }
        }
        self.decide_expired(activity, &mut report).await?;
        report.transfers_finished = self
            .stock
            .finish_transfers(
                &activity.id,
                activity.stock_shards,
                self.stock.clock().now().timestamp_millis() - TRANSFER_GRACE_MS,
            )
            .await?;
        report.topups_finished = self.finish_topups(activity).await?;
        self.audit(activity, &mut report).await?;
        self.remember(&report);
        Ok(report)
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
            // A full pass at the tick. A rebuild's retry, and a wake-up (the
            // API found a sale missing: every refused reservation wakes it),
            // look at the sales that lost their state (or hold an older build,
            // or are still paused automatically) only: a storm of wake-ups
            // costs the live sales nothing.
            let ticked = tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => true,
                _ = tokio::time::sleep_until(retry.into()), if rebuild_waiting => false,
                _ = wake.notified() => false,
            };
            let full = ticked;
            rebuild_waiting = false;
            // The lag is measured at every pass, with or without a current
            // activity, so its gauge (and the alert on it) is there from the
            // first pass after a start.
            let lag = self.measure_lag().await;
            let started = Instant::now();
            let now = self.stock.clock().now();
            let lost: std::collections::HashSet<String> = self
                .lost_since
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .keys()
                .cloned()
                .collect();
            let mut passed = 0u32;
            for activity in cache.current_activities(now) {
                match self.due(&activity, full, &lost, now).await {
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

    /// Whether an activity needs a full pass now, after at most one look at
    /// Redis (no MySQL; the rules are `decide::first_look` and
    /// `decide::after_look`). So the pass costs what the live sales cost,
    /// however many ended in the last hour.
    async fn due(
        &self,
        activity: &Activity,
        full: bool,
        lost: &std::collections::HashSet<String>,
        now: chrono::DateTime<Utc>,
    ) -> anyhow::Result<bool> {
        let open = activity.window(now) == Window::Open;
        match decide::first_look(lost.contains(&activity.id), full, open) {
            decide::Look::Pass => Ok(true),
            decide::Look::Skip => Ok(false),
            decide::Look::ReadRedis => {
                let snapshot = self
                    .stock
                    .snapshot(&activity.id, activity.stock_shards)
                    .await?;
                let behind = activity.auto_paused
                    || snapshot
                        .epoch
                        .is_some_and(|epoch| epoch < activity.redis_built_epoch);
                // An ended split sale: are units still between its shards?
                let in_transit = !open
                    && snapshot.pending == 0
                    && snapshot.loaded()
                    && activity.stock_shards > 1
                    && !self
                        .stock
                        .open_loans(
                            &activity.id,
                            activity.stock_shards,
                            self.stock.clock().now().timestamp_millis() - TRANSFER_GRACE_MS,
                        )
                        .await?
                        .is_empty();
                Ok(decide::after_look(
                    open,
                    full,
                    snapshot.loaded(),
                    behind,
                    snapshot.pending,
                    in_transit,
                ))
            }
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
