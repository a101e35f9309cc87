//! The order consumer: Kafka → MySQL, at least once.
//!
//! Messages are taken in batches (size and wait from `consumer.*`); one
//! transaction turns a batch into orders; only then are the batch's offsets
//! committed (`enable.auto.commit=false`), so a crash redelivers what was not
//! committed and `UNIQUE(reservation_id)` / `UNIQUE(activity_id, user_id)` make the
//! redelivery a no-op. A transient MySQL failure is retried with backoff, without
//! committing and without refunding; a permanent failure of one message fails that
//! reservation alone; a payload that cannot be read goes to the dead-letter topic.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::Context;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::{BorrowedMessage, Message, OwnedMessage};
use rdkafka::{Offset, TopicPartitionList};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::repo::{is_transient, Decision, Incoming, OrderRepo};
use crate::activity::is_valid_id;
use crate::config::Settings;
use crate::queue::{Publisher, ReservationMessage};
use crate::stock::{RefundMode, RefundOutcome, StockStore};

const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// What happened to one batch, for tests, benchmarks and logs.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct BatchReport {
    pub ordered: usize,
    pub duplicates: usize,
    pub failed: usize,
    pub superseded: usize,
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
    /// Applies a batch, retrying transient failures until `shutdown`; returns
    /// `None` only if shut down before the batch was committed.
    pub async fn write(
        &self,
        batch: &[Incoming],
        shutdown: &CancellationToken,
    ) -> Option<(Vec<Decision>, Vec<(usize, String)>)> {
        if batch.is_empty() {
            return Some((Vec::new(), Vec::new()));
        }
        let mut backoff = Duration::from_millis(50);
        loop {
            match self.repo.apply_batch(batch).await {
                Ok(decisions) => return Some((decisions, Vec::new())),
                Err(err) if is_transient(&err) => {
                    metrics::counter!("consumer_transient_errors_total").increment(1);
                    tracing::warn!(error = %err, retry_in = ?backoff, "MySQL unavailable; batch will be retried");
                    tokio::select! {
                        _ = shutdown.cancelled() => return None,
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
                Err(err) => {
                    // Something in the batch is refused for good; find it by
                    // applying each message alone.
                    tracing::error!(error = %err, size = batch.len(), "batch refused; applying its messages one by one");
                    return self.write_one_by_one(batch, shutdown).await;
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
            let mut backoff = Duration::from_millis(50);
            loop {
                match self.repo.apply_batch(std::slice::from_ref(m)).await {
                    Ok(mut d) => {
                        decisions.push(d.pop().unwrap_or(Decision::Duplicate));
                        break;
                    }
                    Err(err) if is_transient(&err) => {
                        tokio::select! {
                            _ = shutdown.cancelled() => return None,
                            _ = tokio::time::sleep(backoff) => {}
                        }
                        backoff = (backoff * 2).min(MAX_BACKOFF);
                    }
                    Err(err) => {
                        refused.push((i, format!("refused by the database: {err}")));
                        decisions.push(Decision::Failed {
                            reason: "refused by the database",
                        });
                        break;
                    }
                }
            }
        }
        Some((decisions, refused))
    }

    /// After the commit: clear the pending marks of what MySQL now holds, and
    /// return the units of what failed or lost. A Redis failure here is logged; the
    /// sweeper (for failed rows) and the reconciler (for pending marks) finish it.
    pub async fn settle(&self, batch: &[Incoming], decisions: &[Decision]) -> BatchReport {
        let mut report = BatchReport::default();
        let mut confirmed: HashMap<&str, Vec<String>> = HashMap::new();
        let mut returned = Vec::new();
        for (m, d) in batch.iter().zip(decisions) {
            match d {
                Decision::Ordered | Decision::Duplicate => {
                    if *d == Decision::Ordered {
                        report.ordered += 1;
                    } else {
                        report.duplicates += 1;
                    }
                    confirmed
                        .entry(m.activity_id.as_str())
                        .or_default()
                        .push(m.reservation_id.clone());
                }
                Decision::Failed { .. } | Decision::Superseded => {
                    let superseded = *d == Decision::Superseded;
                    if superseded {
                        report.superseded += 1;
                    } else {
                        report.failed += 1;
                    }
                    tracing::info!(reservation_id = %m.reservation_id, reason = reason_of(d), "reservation failed; returning its units");
                    match self
                        .stock
                        .refund(
                            &m.activity_id,
                            &m.reservation_id,
                            &m.user_id,
                            m.quantity,
                            RefundMode::Return,
                        )
                        .await
                    {
                        Ok(outcome) => {
                            if !superseded {
                                returned.push(m.reservation_id.clone());
                            }
                            if let RefundOutcome::Returned { units } = outcome {
                                metrics::counter!("units_returned_total", "why" => "failed")
                                    .increment(u64::from(units));
                            }
                        }
                        Err(err) => {
                            tracing::warn!(error = %err, reservation_id = %m.reservation_id, "refund failed; the sweeper retries")
                        }
                    }
                }
            }
        }
        for (activity_id, ids) in confirmed {
            if let Err(err) = self.stock.confirm(activity_id, &ids).await {
                tracing::warn!(error = %err, activity_id, "could not clear pending marks; the reconciler will");
            }
        }
        if let Err(err) = self.repo.mark_units_returned(&returned).await {
            tracing::warn!(error = %err, "could not mark returned units; the sweeper retries (the refund is idempotent)");
        }
        metrics::counter!("orders_created_total").increment(report.ordered as u64);
        metrics::counter!("orders_duplicate_deliveries_total").increment(report.duplicates as u64);
        metrics::counter!("orders_failed_total")
            .increment((report.failed + report.superseded) as u64);
        report
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
    if !is_valid_id(&m.reservation_id) || !is_valid_id(&m.activity_id) || !is_valid_id(&m.user_id) {
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

pub struct OrderConsumer {
    consumer: StreamConsumer,
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
        let consumer: StreamConsumer = config
            .set("bootstrap.servers", &settings.kafka.brokers)
            .set("group.id", &settings.kafka.group_id)
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest")
            .set("enable.partition.eof", "false")
            // A crashed consumer's partitions move to a live one after this.
            .set("session.timeout.ms", "6000")
            .set("heartbeat.interval.ms", "2000")
            .set("socket.connection.setup.timeout.ms", "2000")
            .create()
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
        metrics::counter!("consumer_dead_letters_total").increment(1);
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
