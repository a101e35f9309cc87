//! A sale whose Redis state was lost (a restart, a flush, a failover to a replica
//! that missed writes): paused, then rebuilt from MySQL once every reservation of
//! it that was published is an order there, read from the topic itself rather
//! than waited for (other sales' backlog never holds it up), and resumed. The
//! operator's preload is the same rebuild.

use std::time::{Duration, Instant};

use super::pending::honour;
use super::{decide, Reconciler, Report, LAG_READ_TIMEOUT};
use crate::activity::{Activity, Build, Window};
use crate::orders::{consumer, Incoming, OrderWriter};
use crate::stock::{PreloadMode, Preloaded, RefundMode, RefundOutcome};

/// How soon a rebuild that waits (for publishes in flight, or for the broker or
/// MySQL to answer) is tried again.
const REBUILD_RETRY: Duration = Duration::from_millis(250);
/// Beyond the publish timeout, for the broker's acknowledgement to reach the
/// service and the message's offset to reach the lag.
const PUBLISH_GRACE: Duration = Duration::from_millis(500);
/// How long one reading of the topic's uncommitted messages goes on; a longer
/// backlog is read over several passes, each resuming where the last stopped.
const IN_FLIGHT_READ_BUDGET: Duration = Duration::from_secs(2);

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

impl Reconciler {
    /// How long a publish may still be on its way: the publish timeout, and the
    /// time for its acknowledgement to reach the service and its offset the lag.
    pub(super) fn in_flight(&self) -> Duration {
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
    pub(super) async fn settle_in_flight(
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
    pub(super) fn next_retry(&self) -> Instant {
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
                .is_some_and(|until| until <= self.stock.clock().now())
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
    pub(super) async fn recover(
        &self,
        activity: &Activity,
        mode: PreloadMode,
        lost_seen: Instant,
        report: &mut Report,
    ) -> anyhow::Result<()> {
        let open = activity.window(self.stock.clock().now()) == Window::Open;
        let since = if open {
            *self
                .lost_since
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .entry(activity.id.clone())
                .or_insert(lost_seen)
        } else {
            lost_seen
        };
        let in_flight = self.in_flight();
        let verdict = decide::recovery(open, lost_seen.saturating_duration_since(since), in_flight);
        if verdict == decide::Recovery::NotSelling {
            return Ok(());
        }
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
        if verdict == decide::Recovery::Wait {
            report.rebuild_waiting = true;
            report.refused.push(format!(
                "rebuild waits out publishes that were in flight when the loss was seen ({in_flight:?})"
            ));
            return Ok(());
        }
        // One build of a sale at a time over every instance (their reconcilers
        // see a loss within milliseconds of each other), and no resume in the
        // middle of one: two forced builds would split the shards between two
        // snapshots, or write an older build over a newer one.
        let Some(lock) = self
            .activities
            .build_lock(&activity.id, Duration::ZERO)
            .await?
        else {
            report.rebuild_waiting = true;
            report
                .refused
                .push("rebuild waits: another build of the sale is under way".into());
            return Ok(());
        };
        let done = self.rebuild_and_resume(activity, mode, report).await;
        lock.release().await;
        done
    }

    /// The build and the resume after it; the caller holds the build lock.
    async fn rebuild_and_resume(
        &self,
        activity: &Activity,
        mode: PreloadMode,
        report: &mut Report,
    ) -> anyhow::Result<()> {
        let removed = match self.rebuild(activity, mode, report).await? {
            Rebuild::Waiting(why) => {
                report.rebuild_waiting = true;
                report.refused.push(format!("rebuild {why}"));
                return Ok(());
            }
            Rebuild::Built(build) => {
                report.rebuilt = true;
                tracing::warn!(activity_id = %activity.id, available = build.available, buyers = build.buyers.len(), "activity rebuilt from MySQL");
                metrics::counter!("flashsale_activity_rebuilt_total").increment(1);
                false
            }
            Rebuild::AlreadyLoaded => false,
            Rebuild::Removed => true,
        };
        let fresh = self.reread(&activity.id).await?;
        if fresh.auto_paused && removed {
            // Past its retention: nothing is built again, nothing to wait for.
            report.resumed = self.activities.auto_resume(&activity.id).await?;
        } else if fresh.auto_paused {
            // Lifted once Redis, read after the pause was read, holds the sale
            // whole and current, whoever built it: a loss seen since (of the
            // state just written) keeps its pause for the build that repairs it.
            report.resumed = self.lift_if_whole(&fresh).await?;
        } else if !fresh.paused {
            // Whoever built the state, it should now be open.
            self.stock
                .set_paused(&activity.id, activity.stock_shards, false)
                .await?;
        }
        Ok(())
    }

    /// (Re)builds an activity's Redis state from MySQL, the one way both the
    /// automatic recovery and the operator's preload do it, the caller holding
    /// the sale's build lock (`ActivityRepo::build_lock`):
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
        if mode == PreloadMode::Force || matches!(built, Ok(Rebuild::Built(_))) {
            // The switch as MySQL has it now, not as it was at the start (nor as
            // the snapshot the shards were written from said): an operator's
            // pause may have landed meanwhile (a resume waits for the build
            // lock the caller holds).
            let paused = match self.reread(&activity.id).await {
                Ok(now) => now.paused,
                Err(_) => fresh.paused,
            };
            if let Err(err) = self
                .stock
                .set_paused(&activity.id, activity.stock_shards, paused)
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

    pub(super) async fn replace_state(
        &self,
        activity: &Activity,
        mode: PreloadMode,
    ) -> anyhow::Result<Rebuild> {
        if mode == PreloadMode::Force {
            let mut report = Report::default();
            // Everything pending up to now (and a little beyond, for clock skew).
            let until = self.stock.clock().now().timestamp_millis() + 60_000;
            self.decide_pending(activity, until, &mut report).await?;
        }
        let build = self
            .activities
            .build_snapshot(&activity.id)
            .await?
            .ok_or_else(|| anyhow::anyhow!("activity {} vanished", activity.id))?;
        let preloaded = self
            .stock
            .preload(&activity.id, activity.stock_shards, &build, mode)
            .await?;
        if preloaded == Preloaded::Removed {
            if !self.past_retention(&self.reread(&activity.id).await?) {
                tracing::error!(activity_id = %activity.id, "a removal marker in Redis keeps a sale that is not past its retention from being built (a Redis restored from an old copy?); delete the marker key to build it");
            }
            return Ok(Rebuild::Removed);
        }
        let built = preloaded == Preloaded::Built;
        if built {
            self.activities
                .record_build(&activity.id, build.epoch)
                .await?;
            // Read again at once now that the build is recorded: an automatic
            // pause that landed since `activity` was read (an instance that
            // looked at Redis before this build wrote it) is lifted here, not
            // left to nobody, once Redis, read after that pause, holds this
            // build (or a later one) whole. A pause for a loss of the state just
            // written (a second loss within milliseconds) finds it lost, and
            // stays for the build that repairs it.
            let now = self.reread(&activity.id).await?;
            if !build.paused && now.auto_paused {
                self.lift_if_whole(&now).await?;
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
    pub(super) async fn return_late_lapses(
        &self,
        activity: &Activity,
        build: &Build,
    ) -> anyhow::Result<()> {
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
}
