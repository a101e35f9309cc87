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
use opentelemetry::trace::TraceContextExt;
use rdkafka::client::ClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Message, OwnedMessage};
use rdkafka::{Offset, TopicPartitionList};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, Span};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::pace::Pace;
use super::repo::{Decision, Incoming};
use super::stall::{StallWatch, Verdict};
use super::writer::{OrderWriter, MAX_BACKOFF};
use crate::config::{KafkaSettings, Settings};
use crate::input::{is_valid_id, is_valid_user_id};
use crate::kafka::{self, GroupProbe, PartitionOffsets, Publisher, ReservationMessage};
use crate::telemetry;

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
        || !is_valid_user_id(&m.user_id)
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
struct RebalanceReport {
    /// When the last assignment or revocation reached this consumer, and whether
    /// it was an assignment.
    last: std::sync::Mutex<Option<(Instant, bool)>>,
    /// When this consumer first saw every broker down, in the last outage (see
    /// [`super::stall`]: the ghosts a restart leaves).
    broker_lost: std::sync::Mutex<Option<Instant>>,
    /// How long an outage's first failure is remembered (see [`begins_outage`]).
    outage_memory: Duration,
}

/// Whether every broker found down `now` begins a new outage: the first one, one
/// after the group was rebuilt (an assignment since the last outage began), or
/// one longer than `memory` after it began. Failures in between belong to the
/// same outage, whose ghosts are timed from its first failure.
fn begins_outage(
    lost: Option<Instant>,
    assigned: Option<Instant>,
    now: Instant,
    memory: Duration,
) -> bool {
    lost.is_none_or(|at| now.duration_since(at) > memory || assigned.is_some_and(|a| a > at))
}

impl RebalanceReport {
    /// `outage_memory`: longer than a session timeout, so that failures repeated
    /// through one outage never move its start past the ghosts' expiry.
    fn new(outage_memory: Duration) -> Self {
        RebalanceReport {
            last: std::sync::Mutex::new(None),
            broker_lost: std::sync::Mutex::new(None),
            outage_memory,
        }
    }

    /// A rebalance is under way (revoked, not yet assigned again, for less than
    /// `patience`) or has just ended (assigned less than `just` ago): this
    /// consumer's assignment says nothing yet.
    fn settling(&self, now: Instant, just: Duration, patience: Duration) -> bool {
        // A poisoned lock only means a panic elsewhere; the time is still good.
        match *self.last.lock().unwrap_or_else(|p| p.into_inner()) {
            Some((at, true)) => now.duration_since(at) < just,
            Some((at, false)) => now.duration_since(at) < patience,
            None => false,
        }
    }

    /// When every member that heartbeated before the last outage this consumer
    /// saw has been dropped by the coordinator: one session timeout after the
    /// connection failed, and a margin.
    fn ghosts_gone(&self, session: Duration, margin: Duration) -> Option<Instant> {
        let lost = *self.broker_lost.lock().unwrap_or_else(|p| p.into_inner());
        lost.map(|at| at + session + margin)
    }
}

impl ClientContext for RebalanceReport {
    fn error(&self, error: KafkaError, reason: &str) {
        // Every broker down: an outage (one connection failing is not one).
        if error.rdkafka_error_code() == Some(RDKafkaErrorCode::AllBrokersDown) {
            let now = Instant::now();
            let assigned = match *self.last.lock().unwrap_or_else(|p| p.into_inner()) {
                Some((at, true)) => Some(at),
                _ => None,
            };
            let mut lost = self.broker_lost.lock().unwrap_or_else(|p| p.into_inner());
            if begins_outage(*lost, assigned, now, self.outage_memory) {
                *lost = Some(now);
            }
        }
        // What the default does, through this service's logging.
        tracing::error!(target: "librdkafka", "librdkafka: {error}: {reason}");
    }
}

impl ConsumerContext for RebalanceReport {
    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if !matches!(rebalance, Rebalance::Error(_)) {
            let assigned = matches!(rebalance, Rebalance::Assign(_));
            *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some((Instant::now(), assigned));
        }
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
    /// How often the consumer looks at its group (see [`super::stall`]).
    stall_check: Duration,
    /// How long a partition's backlog may stand still, held by nobody here,
    /// before the consumer rejoins.
    stall_patience: Duration,
    /// Its pace into MySQL (see [`super::pace`]).
    pace: std::sync::Mutex<Pace>,
}

/// The group's offsets as the probe last read them, and when.
type GroupView = Option<(Instant, Vec<PartitionOffsets>)>;

/// The consumer's side of the group watch: the probe's latest reading, the
/// verdicts, and when to look next. Active only against tansu 0.6
/// (`kafka.broker_quirks`): Kafka's own coordinator tells the group when a
/// member leaves, and a rejoin over a live member that is busy (retrying
/// MySQL) would stall every partition until it polls again.
struct GroupWatch {
    active: bool,
    view: tokio::sync::watch::Receiver<GroupView>,
    stall: StallWatch,
    next: Instant,
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
            // After a broker restart, reach the coordinator again within a
            // second: the default backoff (up to 10 s) let the session run out.
            .set("reconnect.backoff.max.ms", "1000")
            .create_with_context(RebalanceReport::new(
                Duration::from_millis(settings.consumer.session_timeout_ms) * 4,
            ))
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
            pace: std::sync::Mutex::new(Pace::new(
                settings.consumer.max_orders_per_sec,
                settings.consumer.adaptive_pace,
            )),
        })
    }

    /// Consumes until `shutdown`. Never returns early on an error: each is logged
    /// and retried.
    pub async fn run(self, shutdown: CancellationToken) {
        tracing::info!("order consumer started");
        let active = self.kafka.watches_for_ghost_members();
        let mut watch = GroupWatch {
            active,
            view: match active {
                true => self.spawn_probe(&shutdown),
                false => tokio::sync::watch::channel(None).1,
            },
            stall: StallWatch::new(
                self.stall_patience,
                self.stall_check * 2,
                self.stall_check * 5,
            ),
            next: Instant::now() + self.stall_check,
        };
        loop {
            let Some(batch) = self.next_batch(&mut watch, &shutdown).await else {
                break;
            };
            let Some(took) = self
                .handle(&batch, &shutdown)
                .instrument(batch_span(&batch))
                .await
            else {
                break;
            };
            // MySQL's pace: a pause after the batch (the backlog waits in the
            // topic), never a refused reservation.
            let pause = {
                let mut pace = self.pace.lock().unwrap_or_else(|e| e.into_inner());
                let pause = pace.after(batch.len(), took);
                metrics::gauge!("flashsale_consumer_pace_duty").set(pace.duty());
                pause
            };
            if !pause.is_zero() {
                metrics::histogram!("flashsale_consumer_pause_seconds").record(pause.as_secs_f64());
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(pause) => {}
                }
            }
            // Between batches: a rejoin never revokes a batch half done.
            if watch.active && Instant::now() >= watch.next {
                self.look_at_group(&mut watch);
            }
        }
        tracing::info!("order consumer stopped");
    }

    /// Reads the group's offsets every `stall_check` on a client of its own, off
    /// the consumer's loop, so that a slow broker never keeps the consumer from
    /// polling (a rebalance waits for every member to poll).
    fn spawn_probe(&self, shutdown: &CancellationToken) -> tokio::sync::watch::Receiver<GroupView> {
        let (tx, rx) = tokio::sync::watch::channel(None);
        let probe = match GroupProbe::new(&self.kafka) {
            Ok(p) => std::sync::Arc::new(p),
            Err(err) => {
                tracing::error!(error = %err, "no group probe: a partition nobody holds will not be noticed");
                return rx;
            }
        };
        let (every, shutdown) = (self.stall_check, shutdown.clone());
        tokio::spawn(async move {
            let mut failing = false;
            let mut first = true;
            loop {
                // The first reading at once: a restarted consumer's clocks start
                // when it does.
                if !std::mem::take(&mut first) {
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep(every) => {}
                    }
                }
                let p = probe.clone();
                let read =
                    tokio::task::spawn_blocking(move || p.read(Duration::from_secs(2))).await;
                let view = match read {
                    Ok(Ok(v)) => v,
                    Ok(Err(err)) => {
                        if !failing {
                            tracing::warn!(error = %err, "cannot read the consumer group's offsets; the group watch waits");
                        }
                        failing = true;
                        continue;
                    }
                    Err(err) => {
                        tracing::error!(error = %err, "the group probe task failed");
                        continue;
                    }
                };
                if failing {
                    tracing::info!("the consumer group's offsets can be read again");
                }
                failing = false;
                if tx.send(Some((Instant::now(), view))).is_err() {
                    return;
                }
            }
        });
        rx
    }

    async fn next_batch(
        &self,
        watch: &mut GroupWatch,
        shutdown: &CancellationToken,
    ) -> Option<Vec<OwnedMessage>> {
        let first = loop {
            tokio::select! {
                _ = shutdown.cancelled() => return None,
                _ = tokio::time::sleep_until(watch.next), if watch.active => self.look_at_group(watch),
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
        let limit = self
            .pace
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .batch_limit(self.batch_size);
        while batch.len() < limit {
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

    /// When a partition this consumer does not hold has messages waiting and
    /// nothing committed for longer than the patience, leaves the group and joins
    /// again. Cheap: reads the probe's latest reading and this consumer's
    /// assignment, both in memory.
    fn look_at_group(&self, watch: &mut GroupWatch) {
        let now = Instant::now();
        watch.next = now + self.stall_check;
        let Some((read_at, view)) = watch.view.borrow().clone() else {
            return;
        };
        let group = self.consumer.context();
        let settling = group.settling(now, self.stall_check * 2, self.stall_patience);
        let ghosts_gone = group.ghosts_gone(self.stall_patience, self.stall_check / 2);
        let held: std::collections::HashSet<i32> = match self.consumer.assignment() {
            Ok(list) => list
                .elements_for_topic(&self.kafka.topic)
                .iter()
                .map(|e| e.partition())
                .collect(),
            Err(err) => {
                tracing::warn!(error = %err, "cannot read this consumer's assignment");
                return;
            }
        };
        // A fraction in [0, 1) from the process's random source: members of one
        // fleet do not rejoin in step.
        let jitter =
            (uuid::Uuid::new_v4().as_u128() & ((1 << 53) - 1)) as f64 / (1u64 << 53) as f64;
        if watch
            .stall
            .look(&view, &held, settling, ghosts_gone, jitter, read_at)
            == Verdict::Rejoin
        {
            let waiting: i64 = view.iter().map(|p| p.lag).sum();
            tracing::warn!(
                waiting,
                "a partition this consumer does not hold has messages nobody commits; rejoining the group"
            );
            metrics::counter!("flashsale_consumer_rejoins_total").increment(1);
            self.consumer.unsubscribe();
            if let Err(err) = self.consumer.subscribe(&[&self.kafka.topic]) {
                tracing::error!(error = %err, "cannot subscribe again to the reservation topic");
            }
        }
    }

    /// Processes one batch and commits its offsets. Returns how long MySQL took
    /// to write it, or `None` when shut down before the batch was committed (it
    /// will be redelivered).
    async fn handle(
        &self,
        batch: &[OwnedMessage],
        shutdown: &CancellationToken,
    ) -> Option<Duration> {
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
                        return None;
                    }
                }
            }
        }
        let writes = order_write_spans(&sources, &incoming);
        let started = Instant::now();
        let written = self.writer.write(&incoming, shutdown).await;
        let took = started.elapsed();
        let (decisions, refused) = written?;
        end_order_writes(writes, &decisions);
        for (i, reason) in refused {
            let m = sources[i];
            if !self
                .dead_letter(m.key(), m.payload(), &reason, shutdown)
                .await
            {
                return None;
            }
        }
        let report = self.writer.settle(&incoming, &decisions).await;
        tracing::debug!(?report, "batch committed");
        self.commit(batch);
        Some(took)
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

/// While traces are on, the span of one batch: a root of its own (a batch
/// mixes many requests' messages), linked to the trace of each message that
/// carries one. Off: no span.
fn batch_span(batch: &[OwnedMessage]) -> Span {
    if !telemetry::traces_enabled() {
        return Span::none();
    }
    let span = tracing::info_span!(
        parent: None,
        "consumer.batch",
        otel.kind = "consumer",
        messaging.system = "kafka",
        messaging.operation.type = "process",
        messaging.batch.message_count = batch.len(),
    );
    for m in batch {
        if let Some(cx) = kafka::trace::context_of(m.headers()) {
            span.add_link(cx.span().span_context().clone());
        }
    }
    span
}

/// While traces are on, one `order.write` span per message for the batch's
/// MySQL write: a child of the publish whose context the message's headers
/// carry, so the reservation's trace holds its order, and linked to the batch.
/// A message without that context (published with traces off, or by an older
/// build) gets its span under the batch's. Off: none.
fn order_write_spans(sources: &[&OwnedMessage], incoming: &[Incoming]) -> Vec<Span> {
    if !telemetry::traces_enabled() {
        return Vec::new();
    }
    let batch = Span::current().context().span().span_context().clone();
    sources
        .iter()
        .zip(incoming)
        .map(|(m, i)| {
            let span = tracing::info_span!(
                "order.write",
                otel.kind = "consumer",
                db.system.name = "mysql",
                messaging.system = "kafka",
                messaging.destination.partition.id = m.partition(),
                messaging.kafka.offset = m.offset(),
                reservation_id = %i.reservation_id,
                decision = tracing::field::Empty,
            );
            if let Some(cx) = kafka::trace::context_of(m.headers()) {
                // Fails only for a span the exporter filters out.
                let _ = span.set_parent(cx);
                span.add_link(batch.clone());
            }
            span
        })
        .collect()
}

/// Records each message's decision on its `order.write` span and ends them.
fn end_order_writes(spans: Vec<Span>, decisions: &[Decision]) {
    for (span, decision) in spans.into_iter().zip(decisions) {
        span.record("decision", tracing::field::debug(decision));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_outage_begins_with_its_first_failure_and_again_once_the_group_was_rebuilt() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let memory = s * 24;
        assert!(begins_outage(None, None, t0, memory));
        // Failures repeated through the outage keep its start.
        assert!(!begins_outage(Some(t0), None, t0 + s * 5, memory));
        assert!(!begins_outage(Some(t0 + s), Some(t0), t0 + s * 5, memory));
        // The group was rebuilt since it began: the next failure is a new one.
        assert!(begins_outage(
            Some(t0),
            Some(t0 + s * 3),
            t0 + s * 5,
            memory
        ));
        // Long after it began: a new one.
        assert!(begins_outage(Some(t0), None, t0 + s * 25, memory));
    }
}
