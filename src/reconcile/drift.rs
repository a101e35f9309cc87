//! Stock drift: Redis stock + pending units + units owed back + live orders'
//! units must equal the activity's stock. Top-ups MySQL holds and Redis does not
//! are added first; a difference is reported, and repaired from MySQL only when
//! it is safe.

use super::{decide, MysqlFigures, Reconciler, Report};
use crate::activity::Activity;
use crate::stock::{Audit, RefundOutcome};

/// Pending reservations a drift repair checks against MySQL, at most (with
/// more pending, the repair waits for a quieter pass).
const REPAIR_PENDING_CHECKED: usize = 5_000;

/// MySQL's figures a drift was measured against: the activity's stock, the
/// units of its live orders, and the units owed back to Redis.
type Seen = (i64, i64, Vec<(String, u32)>);

impl Reconciler {
    /// Adds to Redis the top-ups MySQL holds and Redis may not (their request
    /// failed between the two); each is added once whoever tries.
    pub(super) async fn finish_topups(&self, activity: &Activity) -> anyhow::Result<u64> {
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
    pub(super) async fn mysql_figures(
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
    pub(super) async fn audit(
        &self,
        activity: &Activity,
        report: &mut Report,
    ) -> anyhow::Result<()> {
        let Some((figures, audit)) = self.measure_drift(activity, report).await? else {
            return Ok(());
        };
        // With the stock split, the repair's compare-and-set checks one shard
        // while the others' figures are as the audit read them: it waits for a
        // pass with nothing pending anywhere.
        let pending = if audit.pending_units == 0 || activity.stock_shards > 1 {
            None
        } else {
            let pending = self
                .stock
                .expired_pending(
                    &activity.id,
                    activity.stock_shards,
                    i64::MAX,
                    REPAIR_PENDING_CHECKED,
                )
                .await?;
            let ids: Vec<String> = pending.into_iter().map(|p| p.reservation_id).collect();
            Some(decide::Pending {
                read: ids.len(),
                limit: REPAIR_PENDING_CHECKED,
                ordered: self.orders.count_orders_of(&ids).await?,
            })
        };
        if let Some(why) = decide::repair_waits(audit.pending_units, pending) {
            report.refused.push(format!("repair refused: {why}"));
            return Ok(());
        }
        self.repair(activity, figures, &audit, report).await
    }

    /// MySQL's figures and Redis's audit, and the drift between them into the
    /// report; `None` when there is nothing to repair (no drift, or not loaded).
    pub(super) async fn measure_drift(
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
    pub(super) async fn repair(
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
}
