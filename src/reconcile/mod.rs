//! The reconciler: makes Redis agree with MySQL (the source of truth) again after
//! whatever failed, without ever letting MySQL oversell.
//!
//! For one activity, one pass:
//! 1. **Redis lost the activity** (restart, failover, flush): the activity is paused
//!    automatically (reservations already answer 503), and once the consumers have
//!    drained the topic it is rebuilt from MySQL and resumed. An operator may
//!    rebuild at once with the preload endpoint.
//! 2. **Reservations pending past the deadline** never reached MySQL (the process
//!    died between Redis and Kafka, or the message was lost): MySQL arbitrates
//!    through the same lock and unique keys as the consumer. If the consumer got
//!    there first, the pending mark is just cleared; otherwise the reservation is
//!    recorded as failed and its units returned, and a late message finds it
//!    decided.
//! 3. **Stock drift**: Redis stock + pending units + units owed back (failed or
//!    cancelled orders not yet refunded) + live orders' units must equal the
//!    activity's stock. A difference is reported, and repaired from MySQL only
//!    when it is safe: the consumers have no lag, MySQL did not change while Redis
//!    was read, and Redis still holds what was read (compare-and-set).
//!
//! Every step is idempotent and safe to run on several instances at once.

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use serde::Serialize;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::activity::{Activity, ActivityCache, ActivityRepo, Window};
use crate::config::KafkaSettings;
use crate::orders::{Decision, Incoming, OrderRepo, OrderWriter};
use crate::queue;
use crate::stock::{Audit, PreloadMode, StockStore};

const EXPIRED_BATCH: usize = 500;

/// What one pass found and did, for the operator.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    pub activity_id: String,
    pub checked_at: chrono::DateTime<Utc>,
    /// Messages the consumers have not committed yet; `None` if the broker did not
    /// answer (repairs are then refused).
    pub consumer_lag: Option<i64>,
    /// Whether Redis held the activity when the pass began.
    pub loaded: bool,
    pub paused_automatically: bool,
    pub rebuilt: bool,
    pub resumed: bool,
    /// Pending reservations past the deadline, and what became of them.
    pub expired_pending: usize,
    pub failed_by_reconciler: usize,
    pub already_in_mysql: usize,
    pub superseded: usize,
    pub mysql: MysqlFigures,
    pub redis: Option<Audit>,
    /// Redis stock minus what MySQL implies (0 when they agree).
    pub drift: i64,
    pub repaired: bool,
    /// Why something that differs was left alone.
    pub refused: Vec<String>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct MysqlFigures {
    pub stock: i64,
    pub available: i64,
    pub live_units: i64,
    /// `stock - live_units`; differs from `available` only if MySQL itself is
    /// inconsistent (reported, never repaired automatically).
    pub expected_available: i64,
}

#[derive(Clone)]
pub struct Reconciler {
    pub activities: ActivityRepo,
    pub orders: OrderRepo,
    pub stock: StockStore,
    pub kafka: KafkaSettings,
    pub pending_deadline: Duration,
}

impl Reconciler {
    pub async fn reconcile(&self, activity_id: &str) -> anyhow::Result<Report> {
        let activity = self
            .activities
            .get(activity_id)
            .await?
            .ok_or_else(|| anyhow::anyhow!("no activity {activity_id}"))?;
        self.reconcile_activity(&activity).await
    }

    pub async fn reconcile_activity(&self, activity: &Activity) -> anyhow::Result<Report> {
        metrics::counter!("reconcile_runs_total").increment(1);
        let mut report = Report {
            activity_id: activity.id.clone(),
            checked_at: Utc::now(),
            ..Report::default()
        };
        report.consumer_lag = match queue::consumer_lag(&self.kafka).await {
            Ok(lag) => Some(lag),
            Err(err) => {
                tracing::warn!(error = %err, "consumer lag unknown");
                None
            }
        };
        let snapshot = self.stock.snapshot(&activity.id).await?;
        report.loaded = snapshot.stock.is_some() && snapshot.state.is_some();
        if !report.loaded {
            self.recover_lost(activity, &mut report).await?;
            return Ok(report);
        }
        self.decide_expired(activity, &mut report).await?;
        self.audit(activity, &mut report).await?;
        Ok(report)
    }

    /// Redis does not hold the activity: pause it, and rebuild it from MySQL once
    /// every published reservation has reached MySQL.
    async fn recover_lost(&self, activity: &Activity, report: &mut Report) -> anyhow::Result<()> {
        if activity.window(Utc::now()) != Window::Open {
            // Not selling: nothing to protect; the operator preloads before the start.
            return Ok(());
        }
        if !activity.paused {
            report.paused_automatically = self.activities.auto_pause(&activity.id).await?;
            if report.paused_automatically {
                tracing::warn!(activity_id = %activity.id, "Redis lost the activity; paused it");
                metrics::counter!("activity_auto_paused_total").increment(1);
            }
        }
        match report.consumer_lag {
            Some(0) => {}
            Some(lag) => {
                report.refused.push(format!(
                    "rebuild waits for the consumers to drain the topic ({lag} messages left)"
                ));
                return Ok(());
            }
            None => {
                report
                    .refused
                    .push("rebuild waits: the consumers' lag is unknown".into());
                return Ok(());
            }
        }
        // Read MySQL only now: every reservation published before the loss is in it.
        let fresh = self
            .activities
            .get(&activity.id)
            .await?
            .ok_or_else(|| anyhow::anyhow!("activity {} vanished", activity.id))?;
        let buyers = self.activities.buyers(&activity.id).await?;
        // MySQL's `available` already counts the units of failed and cancelled
        // orders; the new Redis state owes them nothing.
        self.orders.mark_all_returned(&activity.id).await?;
        let resume = fresh.auto_paused || !fresh.paused;
        report.rebuilt = self
            .stock
            .preload(
                &activity.id,
                i64::from(fresh.available),
                !resume,
                &buyers,
                PreloadMode::Missing,
            )
            .await?;
        if report.rebuilt {
            tracing::warn!(activity_id = %activity.id, available = fresh.available, buyers = buyers.len(), "activity rebuilt from MySQL");
            metrics::counter!("activity_rebuilt_total").increment(1);
        }
        if resume {
            report.resumed = self.activities.auto_resume(&activity.id).await?;
            // Whoever built the state, it should now be open.
            self.stock.set_paused(&activity.id, false).await?;
        }
        Ok(())
    }

    async fn decide_expired(&self, activity: &Activity, report: &mut Report) -> anyhow::Result<()> {
        let deadline_ms = self.pending_deadline.as_millis().min(i64::MAX as u128) as i64;
        let before = Utc::now().timestamp_millis() - deadline_ms;
        let writer = OrderWriter {
            repo: self.orders.clone(),
            stock: self.stock.clone(),
        };
        loop {
            let expired = self
                .stock
                .expired_pending(&activity.id, before, EXPIRED_BATCH)
                .await?;
            if expired.is_empty() {
                return Ok(());
            }
            let batch: Vec<Incoming> = expired
                .into_iter()
                .map(|(reservation_id, user_id, quantity)| Incoming {
                    reservation_id,
                    activity_id: activity.id.clone(),
                    user_id,
                    quantity,
                })
                .collect();
            let decisions = self
                .orders
                .fail_absent(&batch, "never reached the order queue")
                .await?;
            report.expired_pending += batch.len();
            for d in &decisions {
                match d {
                    Decision::Failed { .. } => report.failed_by_reconciler += 1,
                    Decision::Superseded => report.superseded += 1,
                    _ => report.already_in_mysql += 1,
                }
            }
            metrics::counter!("reconcile_failed_reservations_total")
                .increment(report.failed_by_reconciler as u64);
            // Clears the pending marks and returns the units of what failed.
            writer.settle(&batch, &decisions).await;
            if batch.len() < EXPIRED_BATCH {
                return Ok(());
            }
        }
    }

    async fn audit(&self, activity: &Activity, report: &mut Report) -> anyhow::Result<()> {
        let total = i64::from(activity.stock);
        let read_mysql = || async {
            let fresh = self.activities.get(&activity.id).await?;
            let live = self.orders.live_units(&activity.id).await?;
            let owed = self.orders.owed_units(&activity.id).await?;
            Ok::<_, sqlx::Error>((fresh.map(|a| a.available), live, owed))
        };
        let (available, live, owed) = read_mysql().await?;
        let available = i64::from(available.unwrap_or_default());
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
        let audit = self
            .stock
            .audit(&activity.id, total, live, &owed, None)
            .await?;
        report.redis = Some(audit);
        if !audit.loaded {
            return Ok(());
        }
        report.drift = audit.stock - audit.expected;
        if report.drift == 0 {
            return Ok(());
        }
        metrics::counter!("reconcile_drift_found_total").increment(1);
        tracing::warn!(activity_id = %activity.id, drift = report.drift, ?audit, "Redis stock differs from MySQL");
        if report.consumer_lag != Some(0) {
            report
                .refused
                .push("repair refused: the consumers still have lag".into());
            return Ok(());
        }
        let (_, live_again, owed_again) = read_mysql().await?;
        if live_again != live || owed_again != owed {
            report
                .refused
                .push("repair refused: MySQL changed during the check; next pass".into());
            return Ok(());
        }
        let repaired = self
            .stock
            .audit(
                &activity.id,
                total,
                live,
                &owed,
                Some((audit.stock, audit.pending_units)),
            )
            .await?;
        report.repaired = repaired.repaired;
        if repaired.repaired {
            metrics::counter!("reconcile_drift_repaired_total").increment(1);
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
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {}
                _ = wake.notified() => {}
            }
            for activity in cache.current_activities(Utc::now()) {
                match self.reconcile_activity(&activity).await {
                    Ok(r)
                        if r.drift != 0
                            || r.failed_by_reconciler > 0
                            || r.rebuilt
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
        }
    }
}

impl Report {
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
            "  expired pending {}: failed {}, already in MySQL {}, superseded {}\n",
            self.expired_pending, self.failed_by_reconciler, self.already_in_mysql, self.superseded
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
