//! librdkafka's mock cluster: Kafka brokers inside the test process, on
//! loopback ports, speaking the protocol the service's own client speaks, with
//! their own fault injection. It stands beside the real broker (tansu), never
//! instead of it: tansu 0.6 cannot run the idempotent producer, and its group
//! coordinator is not Kafka's; the mock runs both as librdkafka's authors
//! test them. The service connects to it with `kafka.broker_quirks = "none"`.
//!
//! What the mock does not do, so that no test relies on it: it checks an
//! idempotent producer's sequence numbers only for a transactional producer
//! (a plain idempotent producer's retry is appended again), and it has no
//! CreateTopics (topics are made here, `kafka.create_topics = false`).

use std::ffi::{CStr, CString};
use std::time::Duration;

use rdkafka::bindings as sys;
use rdkafka::config::ClientConfig;
use rdkafka::producer::{BaseProducer, Producer};
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};

/// A mock cluster of a few brokers, ids `1..=n`, gone when dropped.
pub struct MockKafka {
    cluster: *mut sys::rd_kafka_mock_cluster_t,
    /// The handle the cluster lives in; dropped after it.
    _handle: BaseProducer,
}

// The mock cluster's calls take its lock or post to its own thread: they may
// come from any thread.
unsafe impl Send for MockKafka {}
unsafe impl Sync for MockKafka {}

fn c(s: &str) -> CString {
    CString::new(s).expect("no NUL in a mock cluster name")
}

fn ok(err: RDKafkaRespErr, what: &str) {
    assert!(
        err == RDKafkaRespErr::RD_KAFKA_RESP_ERR_NO_ERROR,
        "mock cluster: {what}: {err:?}"
    );
}

impl MockKafka {
    pub fn start(brokers: i32) -> Self {
        let handle: BaseProducer = ClientConfig::new()
            .set("log_level", "3")
            .create()
            .expect("a librdkafka handle for the mock cluster");
        // SAFETY: the handle outlives the cluster (field order, and `Drop`).
        let cluster =
            unsafe { sys::rd_kafka_mock_cluster_new(handle.client().native_ptr(), brokers) };
        assert!(!cluster.is_null(), "mock cluster did not start");
        // Groups form at once (Kafka's own default waits 3 s for more members).
        unsafe { sys::rd_kafka_mock_group_initial_rebalance_delay_ms(cluster, 0) };
        // Every request is kept, for [`MockKafka::requests`].
        unsafe { sys::rd_kafka_mock_start_request_tracking(cluster) };
        MockKafka {
            cluster,
            _handle: handle,
        }
    }

    /// `kafka.brokers` for the service.
    pub fn bootstrap(&self) -> String {
        // SAFETY: a NUL-terminated string the cluster owns while it lives.
        unsafe { CStr::from_ptr(sys::rd_kafka_mock_cluster_bootstraps(self.cluster)) }
            .to_string_lossy()
            .into_owned()
    }

    pub fn create_topic(&self, topic: &str, partitions: i32) {
        let name = c(topic);
        ok(
            unsafe { sys::rd_kafka_mock_topic_create(self.cluster, name.as_ptr(), partitions, 1) },
            "create topic",
        );
    }

    /// The next requests of `api`, to any broker, answered with these errors in
    /// turn; a produce answered an error is not written.
    /// `RD_KAFKA_RESP_ERR__TRANSPORT` closes the connection as well (the
    /// produce not written): for a write whose acknowledgement is lost, see
    /// [`MockKafka::answer_from`] and [`MockKafka::down`].
    pub fn answer_next(&self, api: RDKafkaApiKey, errors: &[RDKafkaRespErr]) {
        unsafe {
            sys::rd_kafka_mock_push_request_errors_array(
                self.cluster,
                api as i16,
                errors.len(),
                errors.as_ptr(),
            )
        };
    }

    /// The next requests of `api` to `broker` answered in turn with these
    /// errors, each after its delay (the request is handled at once: a produce
    /// answered no error is written before its answer waits). While any is
    /// used, `broker` ignores [`MockKafka::answer_next`] for `api`: its
    /// own list, even empty, comes first.
    pub fn answer_from(
        &self,
        broker: i32,
        api: RDKafkaApiKey,
        answers: &[(RDKafkaRespErr, Duration)],
    ) {
        for (err, delay) in answers {
            let ms = i32::try_from(delay.as_millis()).expect("a delay in i32 milliseconds");
            ok(
                unsafe {
                    sys::rd_kafka_mock_broker_push_request_error_rtts(
                        self.cluster,
                        broker,
                        api as i16,
                        1,
                        *err as i32,
                        ms,
                    )
                },
                "push a broker's answer",
            );
        }
    }

    /// How many requests of `api` the brokers have received.
    pub fn requests(&self, api: RDKafkaApiKey) -> usize {
        let mut count = 0usize;
        // SAFETY: an array of `count` requests the caller owns and destroys.
        unsafe {
            let requests = sys::rd_kafka_mock_get_requests(self.cluster, &mut count);
            if requests.is_null() {
                return 0;
            }
            let seen = (0..count)
                .filter(|&i| sys::rd_kafka_mock_request_api_key(*requests.add(i)) == api as i16)
                .count();
            sys::rd_kafka_mock_request_destroy_array(requests, count);
            seen
        }
    }

    /// A broker stops answering (its connections are closed) until `up`.
    pub fn down(&self, broker: i32) {
        ok(
            unsafe { sys::rd_kafka_mock_broker_set_down(self.cluster, broker) },
            "broker down",
        );
    }

    pub fn up(&self, broker: i32) {
        ok(
            unsafe { sys::rd_kafka_mock_broker_set_up(self.cluster, broker) },
            "broker up",
        );
    }

    /// Every partition of `topic` led by `broker`.
    pub fn lead(&self, topic: &str, partitions: i32, broker: i32) {
        let name = c(topic);
        for p in 0..partitions {
            ok(
                unsafe {
                    sys::rd_kafka_mock_partition_set_leader(self.cluster, name.as_ptr(), p, broker)
                },
                "set a partition's leader",
            );
        }
    }

    /// The consumer group `group`'s coordinator moves to `broker`.
    pub fn move_coordinator(&self, group: &str, broker: i32) {
        let (kind, key) = (c("group"), c(group));
        ok(
            unsafe {
                sys::rd_kafka_mock_coordinator_set(
                    self.cluster,
                    kind.as_ptr(),
                    key.as_ptr(),
                    broker,
                )
            },
            "move the group coordinator",
        );
    }
}

impl Drop for MockKafka {
    fn drop(&mut self) {
        // SAFETY: made by `start`, destroyed once, before its handle.
        unsafe { sys::rd_kafka_mock_cluster_destroy(self.cluster) };
    }
}
