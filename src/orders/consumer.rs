//! The order consumer: Kafka → MySQL, at least once.
//!
//! Messages are taken in batches (size and wait from `consumer.*`); one
//! transaction turns a batch into orders; only then are the batch's offsets
//! committed (`enable.auto.commit=false`), so a crash redelivers what was not
//! committed and `UNIQUE(reservation_id)` / `UNIQUE(activity_id, holder)` make the
//! redelivery a no-op. A MySQL error is retried with backoff, without committing
//! and without refunding, unless it says the data itself is bad (`is_permanent`):
//! then that message alone is dead-lettered and its reservation failed; a payload
//! that cannot be read goes to the dead-letter topic.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::Context;
use rdkafka::client::ClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::message::{BorrowedMessage, Message, OwnedMessage};
use rdkafka::{Offset, TopicPartitionList};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::repo::{is_permanent, Decision, Incoming, NewRows, OrderRepo};
use crate::config::Settings;
use crate::input::is_valid_id;
use crate::kafka::{Publisher, ReservationMessage};
use crate::stock::{FateChange, RefundMode, RefundOutcome, StockStore};

/// Messages this process's consumer sent to the dead-letter topic.
static DEAD_LETTERS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many messages this process's consumer dead-lettered since it started.
pub fn dead_letters_seen() -> u64 {
    DEAD_LETTERS.load(std::sync::atomic::Ordering::Relaxed)
}

const MAX_BACKOFF: Duration = Duration::from_secs(5);

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
    /// Applies a batch as orders, retrying MySQL errors until `shutdown`; returns
    /// `None` only if shut down before the batch was committed.
    pub async fn write(
        &self,
        batch: &[Incoming],
        shutdown: &CancellationToken,
    ) -> Option<(Vec<Decision>, Vec<(usize, String)>)> {
        if batch.is_empty() {
            return Some((Vec::new(), Vec::new()));
        }
        match self.decide(batch, NewRows::Order, shutdown).await? {
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
        let mut report = BatchReport::default();
        let mut confirmed: HashMap<&str, Vec<(String, String, u32)>> = HashMap::new();
        let mut released: HashMap<&str, Vec<String>> = HashMap::new();
        let mut returned = Vec::new();
        for (m, d) in batch.iter().zip(decisions) {
            match d {
                Decision::Ordered | Decision::Duplicate => {
                    if *d == Decision::Ordered {
                        report.ordered += 1;
                    } else {
                        report.duplicates += 1;
                    }
                    confirmed.entry(m.activity_id.as_str()).or_default().push((
                        m.reservation_id.clone(),
                        m.user_id.clone(),
                        m.quantity,
                    ));
                }
                Decision::AlreadyFailed => {
                    report.duplicates += 1;
                    released
                        .entry(m.activity_id.as_str())
                        .or_default()
                        .push(m.reservation_id.clone());
                }
                Decision::Refused { available } => {
                    report.refused += 1;
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
                            *available,
                            &owed,
                        )
                        .await
                    {
                        Ok(Some(by)) if by > 0 => {
                            metrics::counter!("flashsale_redis_stock_lowered_total")
                                .increment(by as u64);
                        }
                        Ok(_) => {}
                        Err(err) => {
                            tracing::warn!(error = %err, reservation_id = %m.reservation_id, "could not lower Redis; the reconciler repairs the drift")
                        }
                    }
                }
                Decision::Withdrawn => {
                    report.withdrawn += 1;
                    let outcome = self.give_back(m, RefundMode::Undo, "withdrawn").await;
                    if outcome == Some(RefundOutcome::Acknowledged) {
                        // Only a message MySQL refused as bad data gets here.
                        metrics::counter!("flashsale_promises_broken_total").increment(1);
                        tracing::error!(
                            incident = true,
                            reservation_id = %m.reservation_id,
                            "an acknowledged reservation was withdrawn (its order was refused as bad data)"
                        );
                        self.give_back(m, RefundMode::Return, "withdrawn").await;
                    }
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
                        returned.push(m.reservation_id.clone());
                    }
                }
            }
        }
        for (activity_id, orders) in confirmed {
            match self.stock.confirm(activity_id, &orders).await {
                Ok(0) => {}
                Ok(adopted) => {
                    report.adopted += adopted;
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
        for (activity_id, ids) in released {
            if let Err(err) = self.stock.release(activity_id, &ids).await {
                tracing::warn!(error = %err, activity_id, "could not clear pending marks; the reconciler will");
            }
        }
        if let Err(err) = self.repo.mark_units_returned(&returned).await {
            tracing::warn!(error = %err, "could not mark returned units; the sweeper retries (the refund is idempotent)");
        }
        metrics::counter!("flashsale_orders_created_total").increment(report.ordered as u64);
        metrics::counter!("flashsale_orders_duplicate_deliveries_total")
            .increment(report.duplicates as u64);
        metrics::counter!("flashsale_orders_failed_total")
            .increment((report.failed + report.superseded + report.refused) as u64);
        metrics::counter!("flashsale_reservations_withdrawn_total")
            .increment(report.withdrawn as u64);
        report
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

/// Checks a message's payload; the reason is what the dead-letter topic records.
pub fn parse(payload: Option<&[u8]>) -> Result<Incoming, String> {
    let bytes = payload.ok_or("empty payload")?;
    let m: ReservationMessage =
        serde_json::from_slice(bytes).map_err(|e| format!("invalid reservation message: {e}"))?;
    if !crate::stock::is_valid_reservation_id(&m.reservation_id)
        || !is_valid_id(&m.activity_id)
        || !is_valid_id(&m.user_id)
    {
        return Err("invalid identifier in reservation message".into());
    }
    if m.quantity == 0 {
        return Err("quantity must be at least 1".into());
    }
    Ok(Incoming {
        reservation_id: m.reservation_id,
        activity_id: m.activity_id,
        user_id: m.user_id,
        quantity: m.quantity,
    })
}

/// Reports the partitions this consumer holds after each rebalance, as the gauge
/// `consumer_assigned_partitions` and in the logs.
struct RebalanceReport;

impl ClientContext for RebalanceReport {}

impl ConsumerContext for RebalanceReport {
    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(partitions) => {
                tracing::info!(partitions = partitions.count(), "partitions assigned");
                metrics::gauge!("flashsale_consumer_assigned_partitions")
                    .set(partitions.count() as f64);
            }
            Rebalance::Revoke(_) => {
                tracing::info!("partitions revoked");
                metrics::gauge!("flashsale_consumer_assigned_partitions").set(0.0);
            }
            Rebalance::Error(err) => tracing::warn!(error = %err, "rebalance failed"),
        }
    }
}

pub struct OrderConsumer {
    consumer: StreamConsumer<RebalanceReport>,
    writer: OrderWriter,
    dead_letters: Publisher,
    dead_letter_topic: String,
    batch_size: usize,
    batch_wait: Duration,
}

impl OrderConsumer {
    pub fn new(
        settings: &Settings,
        writer: OrderWriter,
        dead_letters: Publisher,
    ) -> anyhow::Result<Self> {
        let mut config = ClientConfig::new();
        if !settings.kafka.client_debug.is_empty() {
            config.set("debug", &settings.kafka.client_debug);
        }
        let consumer: StreamConsumer<RebalanceReport> = config
            .set("bootstrap.servers", &settings.kafka.brokers)
            .set("group.id", &settings.kafka.group_id)
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest")
            .set("enable.partition.eof", "false")
            // A crashed consumer's partitions move to a live one after this.
            .set(
                "session.timeout.ms",
                settings.consumer.session_timeout_ms.to_string(),
            )
            .set(
                "heartbeat.interval.ms",
                settings.consumer.heartbeat_interval_ms.to_string(),
            )
            .set("socket.connection.setup.timeout.ms", "2000")
            .create_with_context(RebalanceReport)
            .context("failed to create the Kafka consumer")?;
        consumer
            .subscribe(&[&settings.kafka.topic])
            .context("failed to subscribe to the reservation topic")?;
        Ok(OrderConsumer {
            consumer,
            writer,
            dead_letters,
            dead_letter_topic: settings.kafka.dead_letter_topic.clone(),
            batch_size: settings.consumer.batch_size,
            batch_wait: Duration::from_millis(settings.consumer.batch_wait_ms),
        })
    }

    /// Consumes until `shutdown`. Never returns early on an error: each is logged
    /// and retried.
    pub async fn run(self, shutdown: CancellationToken) {
        tracing::info!("order consumer started");
        loop {
            let Some(batch) = self.next_batch(&shutdown).await else {
                break;
            };
            if !self.handle(&batch, &shutdown).await {
                break;
            }
        }
        tracing::info!("order consumer stopped");
    }

    async fn next_batch(&self, shutdown: &CancellationToken) -> Option<Vec<OwnedMessage>> {
        let first = loop {
            tokio::select! {
                _ = shutdown.cancelled() => return None,
                m = self.consumer.recv() => match m {
                    Ok(m) => break m.detach(),
                    Err(err) => {
                        tracing::warn!(error = %err, "Kafka receive failed");
                        tokio::select! {
                            _ = shutdown.cancelled() => return None,
                            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                        }
                    }
                },
            }
        };
        let mut batch = vec![first];
        let deadline = Instant::now() + self.batch_wait;
        while batch.len() < self.batch_size {
            match tokio::time::timeout_at(deadline, self.consumer.recv()).await {
                Ok(Ok(m)) => batch.push(BorrowedMessage::detach(&m)),
                Ok(Err(err)) => {
                    tracing::warn!(error = %err, "Kafka receive failed");
                    break;
                }
                Err(_) => break,
            }
        }
        Some(batch)
    }

    /// Processes one batch and commits its offsets. Returns false when shut down
    /// before the batch was committed (it will be redelivered).
    async fn handle(&self, batch: &[OwnedMessage], shutdown: &CancellationToken) -> bool {
        let mut incoming = Vec::with_capacity(batch.len());
        let mut sources = Vec::with_capacity(batch.len());
        for m in batch {
            match parse(m.payload()) {
                Ok(i) => {
                    incoming.push(i);
                    sources.push(m);
                }
                Err(reason) => {
                    if !self
                        .dead_letter(m.key(), m.payload(), &reason, shutdown)
                        .await
                    {
                        return false;
                    }
                }
            }
        }
        let Some((decisions, refused)) = self.writer.write(&incoming, shutdown).await else {
            return false;
        };
        for (i, reason) in refused {
            let m = sources[i];
            if !self
                .dead_letter(m.key(), m.payload(), &reason, shutdown)
                .await
            {
                return false;
            }
        }
        let report = self.writer.settle(&incoming, &decisions).await;
        tracing::debug!(?report, "batch committed");
        self.commit(batch);
        true
    }

    async fn dead_letter(
        &self,
        key: Option<&[u8]>,
        payload: Option<&[u8]>,
        reason: &str,
        shutdown: &CancellationToken,
    ) -> bool {
        tracing::error!(%reason, "message sent to the dead-letter topic");
        metrics::counter!("flashsale_consumer_dead_letters_total").increment(1);
        DEAD_LETTERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut backoff = Duration::from_millis(100);
        loop {
            match self
                .dead_letters
                .publish_raw(
                    &self.dead_letter_topic,
                    key,
                    payload.unwrap_or_default(),
                    reason,
                )
                .await
            {
                Ok(()) => return true,
                Err(err) => {
                    tracing::warn!(error = %err, "dead-letter publish failed; retrying");
                    tokio::select! {
                        _ = shutdown.cancelled() => return false,
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
    }

    fn commit(&self, batch: &[OwnedMessage]) {
        let mut next: HashMap<(String, i32), i64> = HashMap::new();
        for m in batch {
            let e = next
                .entry((m.topic().to_owned(), m.partition()))
                .or_insert(0);
            *e = (*e).max(m.offset() + 1);
        }
        let mut tpl = TopicPartitionList::new();
        for ((topic, partition), offset) in next {
            if let Err(err) = tpl.add_partition_offset(&topic, partition, Offset::Offset(offset)) {
                tracing::error!(error = %err, "cannot build the offset list");
                return;
            }
        }
        // Async: a lost commit only means a redelivery, which is a no-op.
        if let Err(err) = self.consumer.commit(&tpl, CommitMode::Async) {
            tracing::warn!(error = %err, "offset commit failed; the batch may be redelivered");
        }
    }
}
