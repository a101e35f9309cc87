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

use super::repo::Incoming;
use super::stall::{StallWatch, Verdict};
use super::writer::{OrderWriter, MAX_BACKOFF};
use crate::config::{KafkaSettings, Settings};
use crate::input::is_valid_id;
use crate::kafka::{group_offsets, Publisher, ReservationMessage};

/// Messages this process's consumer sent to the dead-letter topic.
static DEAD_LETTERS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many messages this process's consumer dead-lettered since it started.
pub fn dead_letters_seen() -> u64 {
    DEAD_LETTERS.load(std::sync::atomic::Ordering::Relaxed)
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
    kafka: KafkaSettings,
    /// How often an idle consumer looks at its group (see [`super::stall`]).
    stall_check: Duration,
    /// How long the group's backlog may stand still before an idle consumer
    /// rejoins.
    stall_patience: Duration,
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
            kafka: settings.kafka.clone(),
            stall_check: Duration::from_millis(settings.consumer.heartbeat_interval_ms),
            stall_patience: Duration::from_millis(settings.consumer.session_timeout_ms),
        })
    }

    /// Consumes until `shutdown`. Never returns early on an error: each is logged
    /// and retried.
    pub async fn run(self, shutdown: CancellationToken) {
        tracing::info!("order consumer started");
        let mut stall = StallWatch::new(self.stall_patience);
        loop {
            let Some(batch) = self.next_batch(&mut stall, &shutdown).await else {
                break;
            };
            if !self.handle(&batch, &shutdown).await {
                break;
            }
        }
        tracing::info!("order consumer stopped");
    }

    async fn next_batch(
        &self,
        stall: &mut StallWatch,
        shutdown: &CancellationToken,
    ) -> Option<Vec<OwnedMessage>> {
        let first = loop {
            tokio::select! {
                _ = shutdown.cancelled() => return None,
                _ = tokio::time::sleep(self.stall_check) => {
                    tokio::select! {
                        _ = shutdown.cancelled() => return None,
                        _ = self.watch_group(stall) => {}
                    }
                }
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

    /// While no message comes: when this consumer holds no partition and the
    /// group's backlog stands still, leaves the group and joins again.
    async fn watch_group(&self, stall: &mut StallWatch) {
        let held = match self.consumer.assignment() {
            Ok(list) => list.count(),
            Err(err) => {
                tracing::warn!(error = %err, "cannot read this consumer's assignment");
                return;
            }
        };
        if held > 0 {
            stall.healthy();
            return;
        }
        // The broker not answering says nothing about the group: look again later.
        let offsets = match group_offsets(&self.kafka).await {
            Ok(o) => o,
            Err(err) => {
                tracing::debug!(error = %err, "cannot read the group's offsets");
                return;
            }
        };
        if stall.idle(offsets.committed, offsets.lag, Instant::now()) == Verdict::Rejoin {
            tracing::warn!(
                lag = offsets.lag,
                "this consumer holds no partition and nobody drains the backlog; rejoining the group"
            );
            metrics::counter!("flashsale_consumer_rejoins_total").increment(1);
            self.consumer.unsubscribe();
            if let Err(err) = self.consumer.subscribe(&[&self.kafka.topic]) {
                tracing::error!(error = %err, "cannot subscribe again to the reservation topic");
            }
        }
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
