//! The one decision step between Redis and MySQL: `OrderWriter` turns
//! reservations into orders (or withdrawals) under MySQL's lock and unique keys,
//! then settles Redis to match. The consumer drives it from Kafka, the
//! reservation path when a publish fails, and the reconciler for reservations
//! left pending; it knows nothing of Kafka itself.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::Context;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::repo::{is_permanent, Decision, Incoming, NewRows, OrderRepo};
use crate::stock::{FateChange, RefundMode, RefundOutcome, StockStore};

/// The longest wait between two tries of a MySQL write (and of a dead letter).
pub(super) const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// What happened to one batch, for tests, benchmarks and logs.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct BatchReport {
    pub ordered: usize,
    pub duplicates: usize,
    pub failed: usize,
    pub refused: usize,
    pub withdrawn: usize,
    pub superseded: usize,
    pub adopted: u64,
    pub dead_lettered: usize,
}

/// The MySQL-and-Redis half of the consumer, independent of Kafka so that it can be
/// driven directly (benchmarks, tests).
#[derive(Clone)]
pub struct OrderWriter {
    pub repo: OrderRepo,
    pub stock: StockStore,
}

impl OrderWriter {
    pub fn new(repo: OrderRepo, stock: StockStore) -> Self {
        OrderWriter { repo, stock }
    }

    /// Applies a batch as orders, retrying MySQL errors until `shutdown`; returns
    /// `None` only if shut down before the batch was committed.
    pub async fn write(
        &self,
        batch: &[Incoming],
        shutdown: &CancellationToken,
    ) -> Option<(Vec<Decision>, Vec<(usize, String)>)> {
        self.write_unless(batch, shutdown, shutdown).await
    }

    /// [`Self::write`], which `abandon` (a child of `shutdown`) also ends, but
    /// only while the batch is retried whole: one transaction, nothing of it
    /// written until it commits. Once its messages are applied one by one,
    /// each decided needs its settling, and only `shutdown` ends it.
    pub async fn write_unless(
        &self,
        batch: &[Incoming],
        shutdown: &CancellationToken,
        abandon: &CancellationToken,
    ) -> Option<(Vec<Decision>, Vec<(usize, String)>)> {
        if batch.is_empty() {
            return Some((Vec::new(), Vec::new()));
        }
        match self.decide(batch, NewRows::Order, abandon).await? {
            Ok(decisions) => Some((decisions, Vec::new())),
            Err(err) => {
                // Something in the batch is bad data; find it by applying each
                // message alone.
                tracing::error!(error = %err, size = batch.len(), "batch refused; applying its messages one by one");
                self.write_one_by_one(batch, shutdown).await
            }
        }
    }

    /// One decision step, retried with backoff while MySQL's error is not a
    /// permanent one. `None` if shut down first; `Some(Err)` for bad data.
    pub async fn decide(
        &self,
        batch: &[Incoming],
        new_rows: NewRows,
        shutdown: &CancellationToken,
    ) -> Option<Result<Vec<Decision>, sqlx::Error>> {
        let span = crate::detail_span!(
            "mysql.apply",
            otel.kind = "client",
            db.system.name = "mysql",
            messages = batch.len(),
        );
        self.decide_retrying(batch, new_rows, shutdown)
            .instrument(span)
            .await
    }

    async fn decide_retrying(
        &self,
        batch: &[Incoming],
        new_rows: NewRows,
        shutdown: &CancellationToken,
    ) -> Option<Result<Vec<Decision>, sqlx::Error>> {
        let mut backoff = Duration::from_millis(50);
        loop {
            match self.repo.apply(batch, new_rows).await {
                Ok(decisions) => return Some(Ok(decisions)),
                Err(err) if is_permanent(&err) => return Some(Err(err)),
                Err(err) => {
                    metrics::counter!("flashsale_consumer_transient_errors_total").increment(1);
                    tracing::warn!(error = %err, retry_in = ?backoff, "MySQL refused the batch; it will be retried");
                    tokio::select! {
                        _ = shutdown.cancelled() => return None,
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }

    async fn write_one_by_one(
        &self,
        batch: &[Incoming],
        shutdown: &CancellationToken,
    ) -> Option<(Vec<Decision>, Vec<(usize, String)>)> {
        let mut decisions = Vec::with_capacity(batch.len());
        let mut refused = Vec::new();
        for (i, m) in batch.iter().enumerate() {
            let one = std::slice::from_ref(m);
            match self.decide(one, NewRows::Order, shutdown).await? {
                Ok(mut d) => decisions.push(d.pop().unwrap_or(Decision::Duplicate)),
                Err(err) => {
                    // Its order cannot be written; record it as withdrawn, through
                    // the same step as every other decision, so it is decided once
                    // and never stays pending.
                    refused.push((i, format!("refused by the database: {err}")));
                    let reason = "its order was refused by the database";
                    let d = match self
                        .decide(one, NewRows::Withdraw(reason), shutdown)
                        .await?
                    {
                        Ok(mut d) => d.pop().unwrap_or(Decision::Withdrawn),
                        Err(_) => Decision::Failed { reason },
                    };
                    decisions.push(d);
                }
            }
        }
        Some((decisions, refused))
    }

    /// Withdraws reservations that have not reached anyone (their publish failed or
    /// timed out, or the reconciler found them stale): each is first marked
    /// withdrawing in Redis, so no `202` can be answered for it any more, then MySQL
    /// decides under the activity lock (an order if its message got there first, a
    /// withdrawal otherwise), then Redis settles. Reservations already acknowledged
    /// are promises: they are left out, and so missing from the answer.
    ///
    /// One attempt: a MySQL error is returned, and the reservation stays marked
    /// withdrawing in Redis, where the reconciler's next pass finishes it.
    pub async fn withdraw(
        &self,
        batch: &[Incoming],
        reason: &'static str,
    ) -> anyhow::Result<Vec<(Incoming, Decision)>> {
        let mut marked = Vec::with_capacity(batch.len());
        for m in batch {
            match self
                .stock
                .set_fate(&m.activity_id, &m.reservation_id, false)
                .await?
            {
                FateChange::Done | FateChange::Unknown => marked.push(m.clone()),
                FateChange::Refused => {}
            }
        }
        if marked.is_empty() {
            return Ok(Vec::new());
        }
        let decisions = self
            .repo
            .apply(&marked, NewRows::Withdraw(reason))
            .await
            .context("failed to record the withdrawal")?;
        self.settle(&marked, &decisions).await;
        Ok(marked.into_iter().zip(decisions).collect())
    }

    /// After the commit: clear the pending marks of what MySQL now holds, lower
    /// Redis for what MySQL refused, and return the units of what failed, lost or
    /// was withdrawn. A Redis failure here is logged; the sweeper (for failed rows)
    /// and the reconciler (for pending marks and drift) finish it.
    pub async fn settle(&self, batch: &[Incoming], decisions: &[Decision]) -> BatchReport {
        let span = crate::detail_span!("orders.settle", messages = batch.len());
        self.settle_all(batch, decisions).instrument(span).await
    }

    async fn settle_all(&self, batch: &[Incoming], decisions: &[Decision]) -> BatchReport {
        let mut report = BatchReport::default();
        let mut after = AfterCommit::default();
        for (m, d) in batch.iter().zip(decisions) {
            match d {
                Decision::Ordered => {
                    report.ordered += 1;
                    after.confirm(m);
                }
                Decision::Duplicate => {
                    report.duplicates += 1;
                    after.confirm(m);
                }
                Decision::AlreadyFailed => {
                    report.duplicates += 1;
                    after.release(m);
                }
                Decision::Refused { available } => {
                    report.refused += 1;
                    self.lower_for_refused(m, *available).await;
                }
                Decision::Withdrawn => {
                    report.withdrawn += 1;
                    self.return_withdrawn(m).await;
                }
                Decision::Superseded => {
                    report.superseded += 1;
                    tracing::info!(reservation_id = %m.reservation_id, reason = reason_of(d), "reservation superseded; returning its units");
                    self.give_back(m, RefundMode::Drop, "superseded").await;
                }
                Decision::Failed { .. } => {
                    report.failed += 1;
                    tracing::info!(reservation_id = %m.reservation_id, reason = reason_of(d), "reservation failed; returning its units");
                    if self
                        .give_back(m, RefundMode::Return, "failed")
                        .await
                        .is_some()
                    {
                        after.returned.push(m.reservation_id.clone());
                    }
                }
            }
        }
        report.adopted += self.confirm_orders(after.confirmed).await;
        self.release_marks(after.released).await;
        if let Err(err) = self.repo.mark_units_returned(&after.returned).await {
            tracing::warn!(error = %err, "could not mark returned units; the sweeper retries (the refund is idempotent)");
        }
        report.record();
        report
    }

    /// MySQL holds fewer units than Redis handed out (an incident): the
    /// reservation failed, and Redis is lowered to what MySQL can still sell.
    async fn lower_for_refused(&self, m: &Incoming, available: i64) {
        metrics::counter!("flashsale_promises_broken_total").increment(1);
        tracing::error!(
            incident = true,
            reservation_id = %m.reservation_id,
            activity_id = %m.activity_id,
            available,
            "MySQL holds fewer units than Redis handed out; the reservation failed and Redis is lowered"
        );
        // Read after MySQL's `available` (committed with the batch):
        // a unit owed after that read only lowers the cap.
        let owed = match self.repo.owed_to_redis(&m.activity_id).await {
            Ok(owed) => owed,
            Err(err) => {
                tracing::warn!(error = %err, reservation_id = %m.reservation_id, "units owed to Redis unknown; lowering without them, the reconciler repairs the drift");
                Vec::new()
            }
        };
        match self
            .stock
            .lower(
                &m.activity_id,
                &m.reservation_id,
                &m.user_id,
                available,
                &owed,
            )
            .await
        {
            Ok(Some(by)) if by > 0 => {
                metrics::counter!("flashsale_redis_stock_lowered_total").increment(by as u64);
            }
            Ok(_) => {}
            Err(err) => {
                tracing::warn!(error = %err, reservation_id = %m.reservation_id, "could not lower Redis; the reconciler repairs the drift")
            }
        }
    }

    /// A withdrawn reservation's units and its user's right go back. One that
    /// was acknowledged (only a message MySQL refused as bad data gets here) is
    /// a broken promise: reported, and its units returned all the same.
    async fn return_withdrawn(&self, m: &Incoming) {
        let outcome = self.give_back(m, RefundMode::Undo, "withdrawn").await;
        if outcome == Some(RefundOutcome::Acknowledged) {
            metrics::counter!("flashsale_promises_broken_total").increment(1);
            tracing::error!(
                incident = true,
                reservation_id = %m.reservation_id,
                "an acknowledged reservation was withdrawn (its order was refused as bad data)"
            );
            self.give_back(m, RefundMode::Return, "withdrawn").await;
        }
    }

    /// Clears the pending marks of the reservations MySQL now holds as orders,
    /// per activity; returns how many orders Redis did not know and adopted.
    async fn confirm_orders(&self, confirmed: HashMap<&str, Vec<(String, String, u32)>>) -> u64 {
        let mut adopted_total = 0;
        for (activity_id, orders) in confirmed {
            match self.stock.confirm(activity_id, &orders).await {
                Ok(0) => {}
                Ok(adopted) => {
                    adopted_total += adopted;
                    metrics::counter!("flashsale_redis_lost_reservations_total").increment(adopted);
                    tracing::error!(
                        incident = true,
                        activity_id,
                        adopted,
                        "Redis did not know orders MySQL holds (lost writes); adopted them"
                    );
                }
                Err(err) => {
                    tracing::warn!(error = %err, activity_id, "could not clear pending marks; the reconciler will");
                }
            }
        }
        adopted_total
    }

    /// Clears the pending marks of reservations whose order had failed before.
    async fn release_marks(&self, released: HashMap<&str, Vec<String>>) {
        for (activity_id, ids) in released {
            if let Err(err) = self.stock.release(activity_id, &ids).await {
                tracing::warn!(error = %err, activity_id, "could not clear pending marks; the reconciler will");
            }
        }
    }

    /// Returns a reservation's units to Redis (idempotent; see `RefundMode`);
    /// `None` if Redis did not answer (logged: the reconciler or the sweeper
    /// retries).
    pub async fn give_back(
        &self,
        m: &Incoming,
        mode: RefundMode,
        why: &'static str,
    ) -> Option<RefundOutcome> {
        match self
            .stock
            .refund(
                &m.activity_id,
                &m.reservation_id,
                &m.user_id,
                m.quantity,
                mode,
            )
            .await
        {
            Ok(outcome) => {
                if let RefundOutcome::Returned { units } = outcome {
                    metrics::counter!("flashsale_units_returned_total", "why" => why)
                        .increment(u64::from(units));
                }
                Some(outcome)
            }
            Err(err) => {
                tracing::warn!(error = %err, reservation_id = %m.reservation_id, "refund failed; retried later");
                None
            }
        }
    }
}

fn reason_of(d: &Decision) -> &'static str {
    match d {
        Decision::Failed { reason } => reason,
        Decision::Superseded => "the user already holds an order from another reservation",
        _ => "",
    }
}

impl BatchReport {
    /// Adds the batch to the process's order counters.
    fn record(&self) {
        metrics::counter!("flashsale_orders_created_total").increment(self.ordered as u64);
        metrics::counter!("flashsale_orders_duplicate_deliveries_total")
            .increment(self.duplicates as u64);
        metrics::counter!("flashsale_orders_failed_total")
            .increment((self.failed + self.superseded + self.refused) as u64);
        metrics::counter!("flashsale_reservations_withdrawn_total")
            .increment(self.withdrawn as u64);
    }
}

/// What `settle` does once every decision of a batch was read: the pending
/// marks to clear per activity (orders, and failures seen before) and the
/// reservations whose units went back.
#[derive(Default)]
struct AfterCommit<'a> {
    confirmed: HashMap<&'a str, Vec<(String, String, u32)>>,
    released: HashMap<&'a str, Vec<String>>,
    returned: Vec<String>,
}

impl<'a> AfterCommit<'a> {
    fn confirm(&mut self, m: &'a Incoming) {
        self.confirmed
            .entry(m.activity_id.as_str())
            .or_default()
            .push((m.reservation_id.clone(), m.user_id.clone(), m.quantity));
    }

    fn release(&mut self, m: &'a Incoming) {
        self.released
            .entry(m.activity_id.as_str())
            .or_default()
            .push(m.reservation_id.clone());
    }
}
