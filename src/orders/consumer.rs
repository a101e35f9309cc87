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

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use anyhow::Context;
use opentelemetry::trace::TraceContextExt;
use rdkafka::client::ClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::error::KafkaError;
use rdkafka::message::{BorrowedMessage, Message, OwnedMessage};
use rdkafka::{Offset, TopicPartitionList};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, Span};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::ghosts::{self, GhostWatch};
use super::pace::Pace;
use super::repo::{Decision, Incoming};
use super::writer::{OrderWriter, MAX_BACKOFF};
use crate::config::{KafkaSettings, Settings};
use crate::input::{is_valid_id, is_valid_user_id};
use crate::kafka::{self, Publisher, ReservationMessage};
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

/// What the consumer's callbacks see: each rebalance's partitions (the gauge
/// `consumer_assigned_partitions` and the logs), the partitions revoked while
/// a batch is being written, and, under tansu 0.6 only, what the ghost watch
/// needs ([`super::ghosts`]).
struct RebalanceReport {
    /// Partitions revoked since the consumer last looked, and a wake-up for
    /// it when it waits on a batch's write.
    revoked: Mutex<HashSet<i32>>,
    revoked_now: tokio::sync::Notify,
    ghosts: Option<ghosts::Memory>,
}

impl RebalanceReport {
    /// The partitions revoked since the last call.
    fn take_revoked(&self) -> HashSet<i32> {
        // A poisoned lock only means a panic elsewhere; the set is whole.
        std::mem::take(&mut *self.revoked.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

impl ClientContext for RebalanceReport {
    fn error(&self, error: KafkaError, reason: &str) {
        if let Some(ghosts) = &self.ghosts {
            ghosts.saw_error(&error);
        }
        // What the default does, through this service's logging.
        tracing::error!(target: "librdkafka", "librdkafka: {error}: {reason}");
    }
}

impl ConsumerContext for RebalanceReport {
    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let (Some(ghosts), false) = (&self.ghosts, matches!(rebalance, Rebalance::Error(_))) {
            ghosts.saw_rebalance(matches!(rebalance, Rebalance::Assign(_)));
        }
        match rebalance {
            Rebalance::Assign(partitions) => {
                tracing::info!(partitions = partitions.count(), "partitions assigned");
                metrics::gauge!("flashsale_consumer_assigned_partitions")
                    .set(partitions.count() as f64);
            }
            Rebalance::Revoke(partitions) => {
                tracing::info!("partitions revoked");
                metrics::gauge!("flashsale_consumer_assigned_partitions").set(0.0);
                self.revoked
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .extend(partitions.elements().iter().map(|e| e.partition()));
                self.revoked_now.notify_one();
            }
            Rebalance::Error(err) => tracing::warn!(error = %err, "rebalance failed"),
        }
    }
}

/// How long a batch is written before the consumer also serves its group
/// (see [`OrderConsumer::serve_group_meanwhile`]): most batches are done long
/// before.
const SERVE_GROUP_AFTER: Duration = Duration::from_millis(500);

/// What became of one batch.
enum Handled {
    /// Written and committed; MySQL took this long.
    Written(Duration),
    /// A rebalance took its partitions while MySQL refused it: their new
    /// holders read it again from the last commit.
    Abandoned,
    /// Shut down before it was committed (it will be redelivered).
    Stopped,
}

pub struct OrderConsumer {
    consumer: StreamConsumer<RebalanceReport>,
    writer: OrderWriter,
    dead_letters: Publisher,
    dead_letter_topic: String,
    batch_size: usize,
    batch_wait: Duration,
    kafka: KafkaSettings,
    /// The group's heartbeat and session (the ghost watch's pace and patience).
    heartbeat: Duration,
    session: Duration,
    /// Its pace into MySQL (see [`super::pace`]).
    pace: std::sync::Mutex<Pace>,
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
        let session = Duration::from_millis(settings.consumer.session_timeout_ms);
        let ghosts = settings
            .kafka
            .watches_for_ghost_members()
            .then(|| ghosts::Memory::new(session * 4));
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
            .create_with_context(RebalanceReport {
                revoked: Mutex::default(),
                revoked_now: tokio::sync::Notify::new(),
                ghosts,
            })
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
            heartbeat: Duration::from_millis(settings.consumer.heartbeat_interval_ms),
            session,
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
        let mut ghosts = self
            .consumer
            .context()
            .ghosts
            .as_ref()
            .map(|_| GhostWatch::start(&self.kafka, self.heartbeat, self.session, &shutdown));
        // Messages received while a batch was written (see `handle`): the
        // next batch begins with them.
        let mut carry = Vec::new();
        loop {
            let Some(batch) = self
                .next_batch(&mut carry, ghosts.as_mut(), &shutdown)
                .await
            else {
                break;
            };
            let took = match self
                .handle(&batch, &mut carry, &shutdown)
                .instrument(batch_span(&batch))
                .await
            {
                Handled::Written(took) => took,
                Handled::Abandoned => continue,
                Handled::Stopped => break,
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
            if let Some(watch) = ghosts.as_mut().filter(|w| Instant::now() >= w.next) {
                self.look_at_group(watch);
            }
        }
        tracing::info!("order consumer stopped");
    }

    /// The next batch: what was carried over from the last one's write, or
    /// the messages that arrive within `batch_wait` of the first.
    async fn next_batch(
        &self,
        carry: &mut Vec<OwnedMessage>,
        mut ghosts: Option<&mut GhostWatch>,
        shutdown: &CancellationToken,
    ) -> Option<Vec<OwnedMessage>> {
        let limit = self
            .pace
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .batch_limit(self.batch_size);
        if !carry.is_empty() {
            let rest = carry.split_off(carry.len().min(limit));
            return Some(std::mem::replace(carry, rest));
        }
        let group = self.consumer.context();
        loop {
            let first = loop {
                let look_at = ghosts.as_ref().map(|w| w.next);
                tokio::select! {
                    _ = shutdown.cancelled() => return None,
                    _ = tokio::time::sleep_until(look_at.unwrap_or_else(Instant::now)), if look_at.is_some() => {
                        if let Some(watch) = ghosts.as_deref_mut() {
                            self.look_at_group(watch);
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
            // A rebalance served before this message concerns no message here.
            group.take_revoked();
            let mut batch = vec![first];
            let deadline = Instant::now() + self.batch_wait;
            while batch.len() < limit {
                let received = tokio::time::timeout_at(deadline, self.consumer.recv()).await;
                // A partition revoked meanwhile: what came from it before is
                // its new holder's (read again from the last commit), and a
                // commit of it would move that holder's offset back.
                let revoked = group.take_revoked();
                batch.retain(|m| !revoked.contains(&m.partition()));
                match received {
                    Ok(Ok(m)) => batch.push(BorrowedMessage::detach(&m)),
                    Ok(Err(err)) => {
                        tracing::warn!(error = %err, "Kafka receive failed");
                        break;
                    }
                    Err(_) => break,
                }
            }
            if !batch.is_empty() {
                return Some(batch);
            }
        }
    }

    /// Under tansu 0.6: rejoins the group when the ghost watch says a
    /// partition is left with nobody.
    fn look_at_group(&self, watch: &mut GhostWatch) {
        let Some(memory) = &self.consumer.context().ghosts else {
            return;
        };
        let held: HashSet<i32> = match self.consumer.assignment() {
            Ok(list) => list
                .elements_for_topic(&self.kafka.topic)
                .iter()
                .map(|e| e.partition())
                .collect(),
            Err(err) => {
                tracing::warn!(error = %err, "cannot read this consumer's assignment");
                watch.next = Instant::now() + self.heartbeat;
                return;
            }
        };
        if watch.look(memory, &held) {
            metrics::counter!("flashsale_consumer_rejoins_total").increment(1);
            self.consumer.unsubscribe();
            if let Err(err) = self.consumer.subscribe(&[&self.kafka.topic]) {
                tracing::error!(error = %err, "cannot subscribe again to the reservation topic");
            }
        }
    }

    /// Processes one batch and commits its offsets.
    async fn handle(
        &self,
        batch: &[OwnedMessage],
        carry: &mut Vec<OwnedMessage>,
        shutdown: &CancellationToken,
    ) -> Handled {
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
                        return Handled::Stopped;
                    }
                }
            }
        }
        let writes = order_write_spans(&sources, &incoming);
        let group = self.consumer.context();
        let batch_partitions: HashSet<i32> = batch.iter().map(|m| m.partition()).collect();
        // What a rebalance takes from here on (`next_batch` dealt with those
        // before): the batch's messages came before it.
        let mut taken = HashSet::new();
        let paused = Mutex::new(HashSet::new());
        let abandon = shutdown.child_token();
        let started = Instant::now();
        let written = tokio::select! {
            w = self.writer.write_unless(&incoming, shutdown, &abandon) => w,
            () = self.serve_group_meanwhile(&batch_partitions, &mut taken, carry, &paused, &abandon) => unreachable!("serves the group until the write ends"),
        };
        // A rebalance served in the poll that ended with the write: the loop
        // above never looked at it.
        let revoked = group.take_revoked();
        carry.retain(|m| !revoked.contains(&m.partition()));
        taken.extend(revoked);
        let took = started.elapsed();
        let Some((decisions, refused)) = written else {
            if shutdown.is_cancelled() {
                return self.resumed(&paused, Handled::Stopped);
            }
            metrics::counter!("flashsale_consumer_batches_abandoned_total").increment(1);
            return self.resumed(&paused, Handled::Abandoned);
        };
        end_order_writes(writes, &decisions);
        for (i, reason) in refused {
            let m = sources[i];
            if !self
                .dead_letter(m.key(), m.payload(), &reason, shutdown)
                .await
            {
                return self.resumed(&paused, Handled::Stopped);
            }
        }
        let report = self.writer.settle(&incoming, &decisions).await;
        tracing::debug!(?report, "batch committed");
        // Never an offset of a partition taken meanwhile: its new holder has
        // committed its own, which this one would move back.
        self.commit(batch, &taken);
        self.resumed(&paused, Handled::Written(took))
    }

    /// While a batch is written for longer than [`SERVE_GROUP_AFTER`] (MySQL
    /// down, or refusing this member's writes): pauses every partition this
    /// consumer holds and keeps polling, so that it stays in its group and
    /// answers a rebalance at once. A member that stops polling keeps its
    /// membership through its heartbeats and holds up every rebalance of the
    /// group, and so every partition of it, until it polls again or
    /// `max.poll.interval.ms` (5 minutes) passes. A message that comes
    /// meanwhile (a partition assigned since the pause) is carried to the next
    /// batch, and the new partition paused too. Every message carried from a
    /// partition a rebalance takes is dropped (committing one later would skip
    /// what came before it, which its new holder reads again). Once every
    /// partition of the batch has been taken (an eager rebalance takes them
    /// all), `abandon` ends the write at its next retry, never in the middle of
    /// a transaction, unless its messages are being applied one by one (each
    /// decided needs its settling): the batch's new holders read it again from
    /// the last commit. Runs until the write ends; `taken` gathers what was revoked.
    async fn serve_group_meanwhile(
        &self,
        batch: &HashSet<i32>,
        taken: &mut HashSet<i32>,
        carry: &mut Vec<OwnedMessage>,
        paused: &Mutex<HashSet<i32>>,
        abandon: &CancellationToken,
    ) {
        let group = self.consumer.context();
        tokio::time::sleep(SERVE_GROUP_AFTER).await;
        self.pause_held(paused);
        loop {
            // A rebalance is served inside `recv`, which may return nothing
            // after it: the callback's wake-up ends the wait as well.
            let received = tokio::select! {
                m = self.consumer.recv() => Some(m),
                () = group.revoked_now.notified() => None,
            };
            // What a rebalance revoked is known now, and a message `recv`
            // returned came after it.
            let revoked = group.take_revoked();
            carry.retain(|m| !revoked.contains(&m.partition()));
            taken.extend(revoked);
            if let Some(Ok(m)) = &received {
                carry.push(m.detach());
            }
            if !abandon.is_cancelled() && batch.is_subset(taken) {
                tracing::warn!(
                    "a rebalance took the partitions of a batch MySQL has not accepted; their new holders read it again"
                );
                abandon.cancel();
            }
            match received {
                Some(Ok(_)) => self.pause_held(paused),
                Some(Err(err)) => {
                    tracing::warn!(error = %err, "Kafka receive failed");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                None => {}
            }
        }
    }

    /// Pauses every partition this consumer holds, and remembers them in
    /// `paused`.
    fn pause_held(&self, paused: &Mutex<HashSet<i32>>) {
        let held = match self.consumer.assignment() {
            Ok(held) => held,
            Err(err) => {
                tracing::warn!(error = %err, "cannot read this consumer's assignment");
                return;
            }
        };
        match self.consumer.pause(&held) {
            Ok(()) => paused.lock().unwrap_or_else(|p| p.into_inner()).extend(
                held.elements_for_topic(&self.kafka.topic)
                    .iter()
                    .map(|e| e.partition()),
            ),
            Err(err) => tracing::warn!(error = %err, "cannot pause the partitions held"),
        }
    }

    /// Resumes every partition [`Self::pause_held`] paused, held here or not
    /// any more (a paused partition stays paused through a rebalance: one
    /// handed back later would never be read), and hands back `outcome`.
    fn resumed(&self, paused: &Mutex<HashSet<i32>>, outcome: Handled) -> Handled {
        let paused = std::mem::take(&mut *paused.lock().unwrap_or_else(|p| p.into_inner()));
        if paused.is_empty() {
            return outcome;
        }
        let mut list = TopicPartitionList::new();
        for p in paused {
            list.add_partition(&self.kafka.topic, p);
        }
        if let Err(err) = self.consumer.resume(&list) {
            tracing::error!(error = %err, "cannot resume the partitions paused");
        }
        outcome
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

    /// Commits the batch's offsets, except on the partitions `taken` from this
    /// consumer since it was collected.
    fn commit(&self, batch: &[OwnedMessage], taken: &HashSet<i32>) {
        let mut next: HashMap<(String, i32), i64> = HashMap::new();
        for m in batch.iter().filter(|m| !taken.contains(&m.partition())) {
            let e = next
                .entry((m.topic().to_owned(), m.partition()))
                .or_insert(0);
            *e = (*e).max(m.offset() + 1);
        }
        if next.is_empty() {
            return;
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
