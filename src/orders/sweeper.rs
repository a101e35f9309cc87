//! The unpaid-order sweeper: cancels `pending_payment` orders past their deadline
//! and returns their units, to the DB count (in the cancelling transaction) and to
//! Redis (idempotently, retried until done). Policy: the user's purchase right stays
//! spent after a lapse; the unit goes back on sale for others.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::repo::OrderRepo;
use crate::stock::{RefundMode, RefundOutcome, StockStore, ViewChange};

const BATCH: u32 = 500;

#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SweepReport {
    /// Orders this run cancelled.
    pub cancelled: usize,
    /// Failed or cancelled orders whose units this run returned to Redis.
    pub returned: usize,
}

#[derive(Clone)]
pub struct Sweeper {
    pub repo: OrderRepo,
    pub stock: StockStore,
}

impl Sweeper {
    /// One pass. Safe to run twice, or on two instances at once: each cancellation
    /// is a compare-and-set, and each Redis refund is idempotent by reservation.
    pub async fn sweep_once(&self) -> Result<SweepReport, sqlx::Error> {
        let mut report = SweepReport::default();
        loop {
            let cancelled = self.repo.cancel_expired(BATCH).await?;
            report.cancelled += cancelled.len();
            for o in &cancelled {
                tracing::info!(order_id = o.id, reservation_id = %o.reservation_id, "unpaid order cancelled");
                // A reservation-status view cached before is dropped; if this
                // fails, the copy is served no later than shortly before the
                // deadline anyway (see `http::flash::reservation`).
                if let Err(err) = self
                    .stock
                    .view_change(
                        &o.activity_id,
                        &o.reservation_id,
                        &o.user_id,
                        ViewChange::End,
                    )
                    .await
                {
                    tracing::debug!(error = %err, order_id = o.id, "the cancellation was not marked for the reservation view");
                }
            }
            if cancelled.len() < BATCH as usize {
                break;
            }
        }
        metrics::counter!("flashsale_orders_cancelled_total").increment(report.cancelled as u64);
        loop {
            let unreturned = self.repo.unreturned(BATCH).await?;
            let mut done = Vec::with_capacity(unreturned.len());
            for o in &unreturned {
                match self
                    .stock
                    .refund(
                        &o.activity_id,
                        &o.reservation_id,
                        &o.user_id,
                        o.quantity,
                        RefundMode::Return,
                    )
                    .await
                {
                    Ok(outcome) => {
                        if let RefundOutcome::Returned { units } = outcome {
                            metrics::counter!("flashsale_units_returned_total", "why" => "sweeper")
                                .increment(u64::from(units));
                        }
                        done.push(o.reservation_id.clone());
                    }
                    Err(err) => {
                        tracing::warn!(error = %err, "Redis refund failed; retried on the next sweep");
                    }
                }
            }
            self.repo.mark_units_returned(&done).await?;
            report.returned += done.len();
            if unreturned.len() < BATCH as usize || done.is_empty() {
                break;
            }
        }
        Ok(report)
    }

    pub async fn run(self, interval: Duration, shutdown: CancellationToken) {
        crate::periodic::every(interval, shutdown, || async {
            match self.sweep_once().await {
                Ok(r) if r.cancelled > 0 || r.returned > 0 => tracing::info!(?r, "sweep done"),
                Ok(_) => {}
                Err(err) => tracing::warn!(error = %err, "sweep failed; retried on the next tick"),
            }
        })
        .await;
    }
}
