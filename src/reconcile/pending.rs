//! Reservations pending past the deadline (see the module's notes): the
//! acknowledged ones are honoured as orders, the others withdrawn; MySQL
//! decides under the same locks and keys as the consumer.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::{Reconciler, Report};
use crate::activity::Activity;
use crate::orders::{Decision, Incoming, OrderWriter};
use crate::stock::Fate;

const EXPIRED_BATCH: usize = 500;
/// How long one pass keeps retrying MySQL for the orders it honours.
const HONOUR_TIMEOUT: Duration = Duration::from_secs(10);

impl Reconciler {
    pub(super) async fn decide_expired(
        &self,
        activity: &Activity,
        report: &mut Report,
    ) -> anyhow::Result<()> {
        let deadline_ms = self.pending_deadline.as_millis().min(i64::MAX as u128) as i64;
        self.decide_pending(
            activity,
            self.stock.clock().now().timestamp_millis() - deadline_ms,
            report,
        )
        .await
    }

    /// Decides every reservation pending since before `before_ms`: acknowledged
    /// ones become orders, the others are withdrawn (see the module's notes).
    pub(super) async fn decide_pending(
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
}

/// Makes orders of acknowledged reservations: the consumer's own write, one
/// batch, then one by one if MySQL refuses some as bad data (those are withdrawn
/// and reported), so one bad reservation never blocks the others. MySQL errors
/// are retried for a while, then left for the next pass.
pub(super) async fn honour(
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
pub(super) async fn withdraw(
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
