//! Kafka side: the reservation message, the idempotent producer that publishes it,
//! topic creation, and the trace context its headers carry (`trace`).

pub mod trace;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::{DateTime, Utc};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::util::Timeout;
use serde::{Deserialize, Serialize};
use tracing::Instrument;

use crate::config::KafkaSettings;

/// One reservation handed from the API to the order consumer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReservationMessage {
    pub reservation_id: String,
    pub activity_id: String,
    pub sku: String,
    pub user_id: String,
    pub quantity: u32,
    pub reserved_at: DateTime<Utc>,
}

#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("failed to encode the message")]
    Encode(#[from] serde_json::Error),
    #[error("the broker did not acknowledge the message: {0}")]
    Delivery(#[from] KafkaError),
    #[error("no delivery report within {0:?}")]
    Timeout(Duration),
}

/// How long past the publish timeout a delivery report may still come before
/// the publish is given up as unknown: below the rebuild's grace (500 ms), so
/// that every publish of a lost state has been acknowledged, has failed, or is
/// being withdrawn by its request when a rebuild reads the topic.
pub const REPORT_GRACE: Duration = Duration::from_millis(250);

impl PublishError {
    /// Whether the message certainly never left this process (it could not be
    /// encoded, or the client refused it before sending). Any other failure,
    /// a time-out above all, may still land in the topic later.
    pub fn never_sent(&self) -> bool {
        match self {
            PublishError::Encode(_) => true,
            PublishError::Delivery(KafkaError::MessageProduction(code)) => matches!(
                code,
                RDKafkaErrorCode::QueueFull
                    | RDKafkaErrorCode::MessageSizeTooLarge
                    | RDKafkaErrorCode::InvalidMessageSize
                    | RDKafkaErrorCode::UnknownTopic
                    | RDKafkaErrorCode::UnknownPartition
            ),
            _ => false,
        }
    }
}

/// The producer: idempotent, `acks=all`, and every send awaits its delivery report,
/// so a `202` always stands on a message the broker has acknowledged.
///
/// After a failed delivery the producer is replaced (at most once a second): a
/// broker that restarted without its idempotence state, or a producer that hit a
/// fatal idempotence error, would otherwise wedge every later send. The messages
/// of the old producer have failed already and their units were returned, so
/// starting a new producer id loses nothing.
#[derive(Clone)]
pub struct Publisher {
    producer: Arc<RwLock<FutureProducer>>,
    settings: Arc<KafkaSettings>,
    replaced_at: Arc<Mutex<Instant>>,
    topic: String,
    timeout: Duration,
}

fn create_producer(settings: &KafkaSettings) -> anyhow::Result<FutureProducer> {
    producer_config(settings)
        .create()
        .context("failed to create the Kafka producer")
}

/// The producer's librdkafka settings.
pub fn producer_config(settings: &KafkaSettings) -> ClientConfig {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", &settings.brokers)
        .set("enable.idempotence", settings.idempotent().to_string())
        .set("acks", "all")
        .set("linger.ms", settings.linger_ms.to_string())
        .set(
            "queue.buffering.max.messages",
            settings.queue_max_messages.to_string(),
        )
        .set("batch.size", settings.batch_bytes.to_string())
        .set(
            "max.in.flight.requests.per.connection",
            settings.max_in_flight.to_string(),
        )
        // librdkafka fails a message it could not deliver within this time, and
        // only then do we return the units: the report is the single truth.
        .set(
            "message.timeout.ms",
            settings.publish_timeout_ms.to_string(),
        )
        .set(
            "request.timeout.ms",
            settings.publish_timeout_ms.clamp(1, 30_000).to_string(),
        )
        .set("socket.connection.setup.timeout.ms", "1000")
        // Reconnects within about half a second of the broker's return (the
        // target is service again within 2 s of it), even after a long outage.
        .set("reconnect.backoff.max.ms", "500");
    config
}

impl Publisher {
    pub fn new(settings: &KafkaSettings) -> anyhow::Result<Self> {
        Ok(Publisher {
            producer: Arc::new(RwLock::new(create_producer(settings)?)),
            settings: Arc::new(settings.clone()),
            replaced_at: Arc::new(Mutex::new(Instant::now())),
            topic: settings.topic.clone(),
            timeout: settings.publish_timeout(),
        })
    }

    fn current(&self) -> FutureProducer {
        // The lock is held only to clone a handle; a poisoned lock still holds a
        // complete producer.
        self.producer
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Replaces the producer after a failure, at most once a second.
    fn replace_after_failure(&self) {
        {
            let mut at = self.replaced_at.lock().unwrap_or_else(|p| p.into_inner());
            if at.elapsed() < Duration::from_secs(1) {
                return;
            }
            *at = Instant::now();
        }
        match create_producer(&self.settings) {
            Ok(fresh) => {
                let old = std::mem::replace(
                    &mut *self.producer.write().unwrap_or_else(|p| p.into_inner()),
                    fresh,
                );
                metrics::counter!("flashsale_kafka_producer_replaced_total").increment(1);
                tracing::warn!("Kafka producer replaced after a failed delivery");
                // Dropping a producer waits for its librdkafka threads; not on a
                // runtime thread.
                tokio::task::spawn_blocking(move || drop(old));
            }
            Err(err) => tracing::error!(error = %err, "could not replace the Kafka producer"),
        }
    }

    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// Publishes one reservation keyed by user id (one user's messages stay in
    /// order on one partition) and waits for the broker's acknowledgement.
    /// While traces are on, its headers carry this publish's trace context.
    pub async fn publish(&self, msg: &ReservationMessage) -> Result<(), PublishError> {
        let span = crate::detail_span!(
            "kafka.publish",
            otel.kind = "producer",
            messaging.system = "kafka",
            messaging.operation.type = "send",
            messaging.destination.name = %self.topic,
            reservation_id = %msg.reservation_id,
            otel.status_code = tracing::field::Empty,
        );
        let result = self.send(msg).instrument(span.clone()).await;
        if result.is_err() {
            span.record("otel.status_code", "ERROR");
        }
        result
    }

    async fn send(&self, msg: &ReservationMessage) -> Result<(), PublishError> {
        let payload = serde_json::to_vec(msg)?;
        let started = Instant::now();
        let mut record = FutureRecord::to(&self.topic)
            .key(msg.user_id.as_bytes())
            .payload(&payload);
        if let Some(headers) = trace::current_headers() {
            record = record.headers(headers);
        }
        // Enqueued at once or not at all. Waiting for room in a full queue would
        // start `message.timeout.ms` (counted from the enqueue) late: a publish
        // could then be acknowledged up to twice the publish timeout after its
        // reservation, after a rebuild that waited one timeout (and its grace)
        // has read the topic. A full queue is `QueueFull`: never sent, the units
        // are returned and the client is told `503`.
        let producer = self.current();
        let send = producer.send(record, Timeout::After(Duration::ZERO));
        // librdkafka reports within message.timeout.ms (its scan for timed-out
        // messages runs once a second, so a failure may be reported later):
        // past the timeout and a short grace the publish is given up as unknown,
        // and its request settles it through MySQL, before any rebuild reads the
        // topic (`PUBLISH_GRACE`, 500 ms after the timeout).
        let bound = self.timeout + REPORT_GRACE;
        let result = match tokio::time::timeout(bound, send).await {
            Ok(Ok(_delivery)) => Ok(()),
            Ok(Err((err, _msg))) => Err(PublishError::Delivery(err)),
            Err(_) => Err(PublishError::Timeout(bound)),
        };
        // A message refused before it was sent (a full queue above all) says
        // nothing of the producer's health: replacing it would only drop its
        // connections, and the messages in them.
        if matches!(&result, Err(e) if !e.never_sent()) {
            self.replace_after_failure();
        }
        let outcome = if result.is_ok() { "ok" } else { "error" };
        metrics::histogram!("flashsale_kafka_publish_duration_seconds", "outcome" => outcome)
            .record(started.elapsed().as_secs_f64());
        result
    }

    /// Publishes raw bytes with a `reason` header (the dead-letter topic).
    pub async fn publish_raw(
        &self,
        topic: &str,
        key: Option<&[u8]>,
        payload: &[u8],
        reason: &str,
    ) -> Result<(), PublishError> {
        let headers = OwnedHeaders::new().insert(Header {
            key: "reason",
            value: Some(reason),
        });
        let mut record = FutureRecord::<[u8], [u8]>::to(topic)
            .payload(payload)
            .headers(headers);
        if let Some(key) = key {
            record = record.key(key);
        }
        let producer = self.current();
        let result = producer
            .send(record, Timeout::After(self.timeout))
            .await
            .map(|_| ())
            .map_err(|(err, _)| PublishError::Delivery(err));
        if result.is_err() {
            self.replace_after_failure();
        }
        result
    }

    /// Whether the broker answers a metadata request for the topic.
    pub async fn check(&self) -> anyhow::Result<()> {
        let producer = self.current();
        let topic = self.topic.clone();
        tokio::task::spawn_blocking(move || {
            producer
                .client()
                .fetch_metadata(Some(&topic), Duration::from_secs(1))
                .map(|_| ())
        })
        .await
        .context("metadata task failed")?
        .context("the Kafka broker did not answer")
    }

    /// Sends what is still queued; called on shutdown.
    pub fn flush(&self, timeout: Duration) {
        if let Err(err) = self.current().flush(Timeout::After(timeout)) {
            tracing::error!(error = %err, "messages were still unsent at shutdown");
        }
    }
}

/// Creates the topics when they are missing (tansu, and many Kafka deployments,
/// never auto-create them). An existing topic is fine.
pub async fn ensure_topics(settings: &KafkaSettings, topics: &[&str]) -> anyhow::Result<()> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &settings.brokers)
        .set("socket.connection.setup.timeout.ms", "2000")
        .create()
        .context("failed to create the Kafka admin client")?;
    let new_topics: Vec<NewTopic> = topics
        .iter()
        .map(|t| {
            NewTopic::new(
                t,
                settings.partitions,
                TopicReplication::Fixed(settings.replication_factor),
            )
        })
        .collect();
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(5)));
    let results = tokio::time::timeout(
        Duration::from_secs(10),
        admin.create_topics(&new_topics, &options),
    )
    .await
    .context("the Kafka broker did not answer CreateTopics in time")?
    .context("CreateTopics failed")?;
    for result in results {
        match result {
            Ok(topic) => tracing::info!(%topic, "created Kafka topic"),
            Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((topic, code)) => anyhow::bail!("failed to create topic {topic}: {code}"),
        }
    }
    Ok(())
}

/// Messages on the reservation topic that the order consumers' group has not yet
/// committed: 0 means every reservation published so far has reached MySQL.
pub async fn consumer_lag(settings: &KafkaSettings) -> anyhow::Result<i64> {
    let o = group_offsets(settings).await?;
    Ok(o.lag)
}

/// Where the order consumers' group stands on the reservation topic, summed over
/// its partitions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupOffsets {
    /// Messages the group has committed (read from each partition's start when
    /// it has committed nothing there).
    pub committed: i64,
    /// Messages published and not yet committed.
    pub lag: i64,
}

/// Reads the group's committed offsets and the topic's end offsets.
pub async fn group_offsets(settings: &KafkaSettings) -> anyhow::Result<GroupOffsets> {
    let settings = settings.clone();
    tokio::task::spawn_blocking(move || -> anyhow::Result<GroupOffsets> {
        let partitions = GroupProbe::new(&settings)?.read(Duration::from_secs(3))?;
        Ok(GroupOffsets {
            committed: partitions.iter().map(|p| p.committed).sum(),
            lag: partitions.iter().map(|p| p.lag).sum(),
        })
    })
    .await
    .context("lag probe task failed")?
}

/// The consumer group's lag read by one long-lived client, shared by the
/// reconciler's passes and the operator's preload: a reading is then a few round
/// trips on connections already made. A new client's connection and metadata
/// took over a second on a loaded machine, and after Redis lost a sale every
/// such second is time without service. A reading that fails drops the client;
/// the next reading starts a new one.
#[derive(Clone)]
pub struct LagProbe {
    settings: KafkaSettings,
    client: Arc<Mutex<Option<Arc<GroupProbe>>>>,
}

impl LagProbe {
    pub fn new(settings: KafkaSettings) -> Self {
        LagProbe {
            settings,
            client: Arc::default(),
        }
    }

    /// The messages published and not yet committed, summed over the topic's
    /// partitions; `timeout` bounds each request to the broker.
    pub async fn lag(&self, timeout: Duration) -> anyhow::Result<i64> {
        let this = self.clone();
        tokio::task::spawn_blocking(move || this.read(timeout))
            .await
            .context("lag probe task failed")?
    }

    fn read(&self, timeout: Duration) -> anyhow::Result<i64> {
        let client = self.client()?;
        let read = client.read(timeout);
        self.drop_if_failed(&client, &read);
        Ok(read?.iter().map(|p| p.lag).sum())
    }

    /// The client, made now if there is none.
    fn client(&self) -> anyhow::Result<Arc<GroupProbe>> {
        let mut slot = self.client.lock().unwrap_or_else(|e| e.into_inner());
        match &*slot {
            Some(client) => Ok(Arc::clone(client)),
            None => {
                let client = Arc::new(GroupProbe::new(&self.settings)?);
                *slot = Some(Arc::clone(&client));
                Ok(client)
            }
        }
    }

    /// A failed reading drops the client: the next one starts afresh.
    fn drop_if_failed<T>(&self, client: &Arc<GroupProbe>, read: &anyhow::Result<T>) {
        if read.is_err() {
            let mut slot = self.client.lock().unwrap_or_else(|e| e.into_inner());
            if slot.as_ref().is_some_and(|c| Arc::ptr_eq(c, client)) {
                *slot = None;
            }
        }
    }

    /// One sale's messages still in the topic: published (below each
    /// partition's end offset, read now) and not yet committed by the order
    /// consumers' group, as raw payloads; every other sale's messages in that
    /// range are read and skipped. `from` holds, per partition, where an earlier
    /// read of this sale stopped (its messages before that already dealt with):
    /// a read resumes there rather than at the committed offset, so a backlog
    /// too long for one read is read over several. `budget` bounds each request
    /// to the broker, and the reading of messages.
    pub async fn in_flight(
        &self,
        activity_id: &str,
        from: HashMap<i32, i64>,
        budget: Duration,
    ) -> anyhow::Result<InFlight> {
        let this = self.clone();
        let activity_id = activity_id.to_owned();
        tokio::task::spawn_blocking(move || {
            let client = this.client()?;
            let read = client.in_flight(&activity_id, &from, budget);
            this.drop_if_failed(&client, &read);
            read
        })
        .await
        .context("in-flight read task failed")?
    }
}

/// What [`LagProbe::in_flight`] found.
#[derive(Debug, Default)]
pub struct InFlight {
    /// Every message not yet committed, all sales together.
    pub lag: i64,
    /// How many messages this read went through.
    pub read: i64,
    /// The sale's own (payloads that name it; those that cannot be decoded are
    /// the consumers' to dead-letter).
    pub payloads: Vec<Vec<u8>>,
    /// Where the next read of this sale resumes, per partition.
    pub next: HashMap<i32, i64>,
    /// Whether every partition was read to its end offset.
    pub complete: bool,
}

/// Whether a payload is a reservation message of `activity_id`.
fn names_activity(payload: &[u8], activity_id: &str) -> bool {
    #[derive(Deserialize)]
    struct Head<'a> {
        #[serde(borrow)]
        activity_id: std::borrow::Cow<'a, str>,
    }
    serde_json::from_slice::<Head<'_>>(payload).is_ok_and(|h| h.activity_id == activity_id)
}

/// Where the order consumers' group stands on one partition of the reservation
/// topic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartitionOffsets {
    pub partition: i32,
    /// The group's committed offset (the partition's start when it has committed
    /// nothing there).
    pub committed: i64,
    /// Messages published and not yet committed.
    pub lag: i64,
}

/// A client that reads the group's offsets without joining the group, and a
/// second one, in no group, that reads messages the group has not committed yet.
/// Its calls block: run them off the async runtime.
pub struct GroupProbe {
    consumer: rdkafka::consumer::BaseConsumer,
    reader: Mutex<rdkafka::consumer::BaseConsumer>,
    topic: String,
}

impl GroupProbe {
    pub fn new(settings: &KafkaSettings) -> anyhow::Result<Self> {
        let consumer = ClientConfig::new()
            .set("bootstrap.servers", &settings.brokers)
            .set("group.id", &settings.group_id)
            .set("enable.auto.commit", "false")
            .set("socket.connection.setup.timeout.ms", "2000")
            // A long-lived probe reconnects to a broker that came back within a
            // second, not after librdkafka's default backoff of up to ten.
            .set("reconnect.backoff.max.ms", "1000")
            .create()
            .context("failed to create the group probe")?;
        // A group of its own that it never joins (no subscription) nor commits
        // to, so it never disturbs the consumers; it reads from the offsets it is
        // given. (librdkafka wants a group id for an assignment all the same.)
        let reader = ClientConfig::new()
            .set("bootstrap.servers", &settings.brokers)
            .set(
                "group.id",
                format!("{}.in-flight-reader", settings.group_id),
            )
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("enable.partition.eof", "true")
            .set("auto.offset.reset", "earliest")
            .set("fetch.wait.max.ms", "10")
            .set("socket.connection.setup.timeout.ms", "2000")
            .set("reconnect.backoff.max.ms", "1000")
            .create()
            .context("failed to create the in-flight reader")?;
        Ok(GroupProbe {
            consumer,
            reader: Mutex::new(reader),
            topic: settings.topic.clone(),
        })
    }

    /// See [`LagProbe::in_flight`].
    pub fn in_flight(
        &self,
        activity_id: &str,
        from: &HashMap<i32, i64>,
        budget: Duration,
    ) -> anyhow::Result<InFlight> {
        use rdkafka::consumer::Consumer;
        use rdkafka::message::Message;
        use rdkafka::{Offset, TopicPartitionList};
        let offsets = self.read(budget)?;
        let started = Instant::now();
        let mut found = InFlight {
            lag: offsets.iter().map(|p| p.lag).sum(),
            ..InFlight::default()
        };
        // Each partition with messages left, from the group's committed offset
        // (or where the last read stopped, if further) to the end offset read
        // above: every message published before then.
        let mut tpl = TopicPartitionList::new();
        let mut end: HashMap<i32, i64> = HashMap::new();
        for p in &offsets {
            let high = p.committed + p.lag;
            // Where the last read stopped, unless the partition's offsets went
            // back below it since (a topic made anew, a log truncated by an
            // unclean election): then from the committed offset again.
            let resumed = from.get(&p.partition).copied().filter(|at| *at <= high);
            let start = resumed.unwrap_or(0).max(p.committed);
            found.next.insert(p.partition, start);
            if start < high {
                end.insert(p.partition, high);
                tpl.add_partition_offset(&self.topic, p.partition, Offset::Offset(start))
                    .context("bad partition offset")?;
            }
        }
        if end.is_empty() {
            found.complete = true;
            return Ok(found);
        }
        let reader = self.reader.lock().unwrap_or_else(|e| e.into_inner());
        reader
            .assign(&tpl)
            .context("could not assign the partitions to read")?;
        while !end.is_empty() {
            let left = budget.saturating_sub(started.elapsed());
            if left.is_zero() {
                break;
            }
            match reader.poll(left.min(Duration::from_millis(100))) {
                None => {}
                Some(Ok(m)) => {
                    let partition = m.partition();
                    let Some(&last) = end.get(&partition) else {
                        continue;
                    };
                    if m.offset() < last {
                        found.read += 1;
                        if let Some(payload) = m.payload() {
                            if names_activity(payload, activity_id) {
                                found.payloads.push(payload.to_vec());
                            }
                        }
                        found.next.insert(partition, m.offset() + 1);
                    }
                    if m.offset() + 1 >= last {
                        end.remove(&partition);
                    }
                }
                Some(Err(KafkaError::PartitionEOF(partition))) => {
                    // Everything below the end offset read above was delivered.
                    if let Some(last) = end.remove(&partition) {
                        found.next.insert(partition, last);
                    }
                }
                // A transport error the client retries by itself (a broker
                // connection dropped, say): the budget bounds the wait.
                Some(Err(err)) => {
                    tracing::debug!(error = %err, "the in-flight reader saw an error");
                }
            }
        }
        found.complete = end.is_empty();
        if let Err(err) = reader.unassign() {
            tracing::warn!(error = %err, "the in-flight reader could not drop its partitions");
        }
        Ok(found)
    }

    /// Each partition's committed offset and lag; `timeout` bounds each request.
    pub fn read(&self, timeout: Duration) -> anyhow::Result<Vec<PartitionOffsets>> {
        use rdkafka::consumer::Consumer;
        use rdkafka::{Offset, TopicPartitionList};
        // Serves the client's own events (errors, logs), which would pile up in a
        // long-lived client nobody polls; each poll returns at the first error
        // event. It holds no partition: no message comes.
        for _ in 0..100 {
            if self.consumer.poll(Duration::ZERO).is_none() {
                break;
            }
        }
        let topic = self.topic.as_str();
        let md = self
            .consumer
            .fetch_metadata(Some(topic), timeout)
            .context("the broker did not answer a metadata request")?;
        // A topic the broker does not know now (an error, or no partitions) has
        // no lag that can be read: an empty list would read as lag 0.
        let Some(found) = md.topics().first() else {
            anyhow::bail!("the broker returned no metadata for {topic}");
        };
        if let Some(err) = found.error() {
            anyhow::bail!("the broker answered {err:?} for {topic}");
        }
        let partitions: Vec<i32> = found.partitions().iter().map(|p| p.id()).collect();
        if partitions.is_empty() {
            anyhow::bail!("the broker knows no partition of {topic}");
        }
        let mut tpl = TopicPartitionList::new();
        for p in &partitions {
            tpl.add_partition(topic, *p);
        }
        let committed = self
            .consumer
            .committed_offsets(tpl, timeout)
            .context("the broker did not return the group's offsets")?;
        let mut out = Vec::with_capacity(partitions.len());
        for partition in partitions {
            let (low, high) = self
                .consumer
                .fetch_watermarks(topic, partition, timeout)
                .context("the broker did not return the watermarks")?;
            let done = match committed
                .find_partition(topic, partition)
                .map(|e| e.offset())
            {
                Some(Offset::Offset(o)) => o.max(low),
                _ => low,
            };
            out.push(PartitionOffsets {
                partition,
                committed: done,
                lag: (high - done).max(0),
            });
        }
        Ok(out)
    }
}
