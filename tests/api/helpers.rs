//! The test harness: every test spawns the real application on port 0 against the
//! real Redis, MariaDB and Kafka-protocol broker, with its own database, topic,
//! consumer group and activity ids, so tests run in parallel without sharing state.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use flashsale::config::Settings;
use flashsale::kafka::ReservationMessage;
use flashsale::startup::{self, Application};
use flashsale::state::AppState;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Message, Offset, TopicPartitionList};
use reqwest::{Response, StatusCode};
use secrecy::{ExposeSecret, SecretString};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

pub fn kafka_brokers() -> String {
    std::env::var("FLASHSALE_TEST_KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

pub use testkit::relay::Relay;
pub use testkit::{eventually, unique};

/// Settings for one isolated test: a fresh database, topic and group, port 0, and
/// rate limits off (the rate-limit tests turn them on).
pub fn test_settings() -> Settings {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    let mut s = Settings::load_from(&dir, "test").expect("config/default.toml loads");
    let id = uuid::Uuid::new_v4().simple().to_string();
    s.server.addr = "127.0.0.1:0".into();
    s.mysql.url = SecretString::from(format!("mysql://root@127.0.0.1:3306/flashsale_t_{id}"));
    s.mysql.max_connections = 5;
    s.kafka.brokers = kafka_brokers();
    // scripts/test.sh runs the reserve, order and reconcile tests once more with
    // this set to a Redis Cluster.
    if let Ok(url) = std::env::var("FLASHSALE_TEST_REDIS_URL") {
        s.redis.url = url;
    }
    s.kafka.topic = format!("flash.t.{id}");
    s.kafka.dead_letter_topic = format!("flash.t.{id}.dlq");
    s.kafka.group_id = format!("flashsale-t-{id}");
    s.kafka.partitions = 3;
    // The reserve-path tests look at Redis before any order exists; the order
    // tests switch the workers on.
    s.consumer.enabled = false;
    s.orders.sweeper_enabled = false;
    s.reconcile.enabled = false;
    s.rate_limit.per_ip_per_sec = 0;
    s.rate_limit.per_user_per_sec = 0;
    s
}

pub struct TestApp {
    pub address: String,
    /// `server.ops_addr`'s listener, when the test set one.
    pub ops_address: Option<String>,
    pub client: reqwest::Client,
    pub settings: Settings,
    pub state: AppState,
    pub shutdown: CancellationToken,
    pub server: tokio::task::JoinHandle<anyhow::Result<()>>,
}

/// The order consumer runs inside the app, with short batches.
pub fn with_workers(s: &mut Settings) {
    s.consumer.enabled = true;
    s.consumer.batch_wait_ms = 10;
}

pub async fn spawn_app() -> TestApp {
    spawn_app_with(|_| {}).await
}

/// Logs go to the test's captured output (shown for failing tests); `RUST_LOG`
/// picks the level, warnings by default.
fn init_test_logging() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let filter = tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_test_writer()
            .try_init();
    });
}

pub async fn spawn_app_with(customise: impl FnOnce(&mut Settings)) -> TestApp {
    let mut settings = test_settings();
    customise(&mut settings);
    spawn_app_from(settings).await
}

/// An app with exactly these settings (a second instance on another's database,
/// topic and group, for one).
pub async fn spawn_app_from(settings: Settings) -> TestApp {
    init_test_logging();
    startup::migrate(&settings.mysql)
        .await
        .expect("migrations apply");
    let app = Application::build(settings.clone())
        .await
        .expect("application builds");
    let address = format!("http://127.0.0.1:{}", app.port());
    let ops_address = app.ops_port().map(|p| format!("http://127.0.0.1:{p}"));
    let state = app.state();
    let shutdown = app.shutdown_token();
    let server = tokio::spawn(app.run_until_stopped());
    TestApp {
        address,
        ops_address,
        client: reqwest::Client::builder()
            .pool_max_idle_per_host(512)
            .build()
            .expect("http client"),
        settings,
        state,
        shutdown,
        server,
    }
}

pub use testkit::sale::Sale;

impl TestApp {
    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.address, path)
    }

    /// `GET path` without credentials.
    pub async fn get(&self, path: &str) -> Response {
        self.client
            .get(self.url(path))
            .send()
            .await
            .expect("request sent")
    }

    /// Waits until `/readyz` answers `200` (the first probe may not have
    /// finished when the server starts; on a busy machine an answer may be late
    /// for a moment); that answer's body.
    pub async fn wait_ready(&self) -> Value {
        eventually(Duration::from_secs(10), "/readyz to answer 200", || async {
            let resp = self.get("/readyz").await;
            if resp.status() != StatusCode::OK {
                return None;
            }
            resp.json().await.ok()
        })
        .await
    }

    /// Whether an answer is one of `/readyz`'s: `200`, or `503 unavailable`,
    /// with every dependency's state in `checks`.
    pub async fn is_readiness_answer(resp: Response) -> bool {
        let status = resp.status();
        let Ok(body) = resp.json::<Value>().await else {
            return false;
        };
        let states_named = ["redis", "mysql", "kafka"]
            .iter()
            .all(|d| matches!(body["checks"][d].as_str(), Some("ok" | "down" | "unknown")));
        states_named
            && (status == StatusCode::OK
                || (status == StatusCode::SERVICE_UNAVAILABLE && body["code"] == "unavailable"))
    }

    /// The environment for running the `flashsale` binary against this app's
    /// database, Redis, topics and group.
    pub fn binary_env(&self) -> testkit::process::Env {
        let s = &self.settings;
        let mut env = testkit::process::Env::new(
            env!("CARGO_BIN_EXE_flashsale"),
            Path::new(env!("CARGO_MANIFEST_DIR")).join("config"),
        );
        env.set("FLASHSALE__MYSQL__URL", s.mysql.url.expose_secret());
        env.set("FLASHSALE__REDIS__URL", &s.redis.url);
        env.set("FLASHSALE__KAFKA__BROKERS", &s.kafka.brokers);
        env.set("FLASHSALE__KAFKA__TOPIC", &s.kafka.topic);
        env.set(
            "FLASHSALE__KAFKA__DEAD_LETTER_TOPIC",
            &s.kafka.dead_letter_topic,
        );
        env.set("FLASHSALE__KAFKA__GROUP_ID", &s.kafka.group_id);
        env
    }

    pub fn admin_token(&self) -> String {
        self.settings.auth.admin_token.expose_secret().to_owned()
    }

    pub fn token(&self, user: &str) -> String {
        self.state.auth.issue(user, 3600).expect("token")
    }

    pub async fn admin_post(&self, path: &str, body: Option<Value>) -> Response {
        let mut req = self
            .client
            .post(self.url(path))
            .bearer_auth(self.admin_token());
        if let Some(b) = body {
            req = req.json(&b);
        }
        req.send().await.expect("request sent")
    }

    pub async fn admin_get(&self, path: &str) -> Response {
        self.client
            .get(self.url(path))
            .bearer_auth(self.admin_token())
            .send()
            .await
            .expect("request sent")
    }

    /// Creates an activity and returns the answer.
    pub async fn create_activity(&self, body: Value) -> Response {
        self.admin_post("/admin/activities", Some(body)).await
    }

    /// An activity open now with `stock` units, loaded into Redis and selling:
    /// created, then preloaded (an unloaded sale is loaded whatever its window).
    pub async fn open_sale(&self, stock: u32, per_user_limit: u32) -> Sale {
        self.open_sale_with(stock, per_user_limit, 900).await
    }

    /// A sale as `spec` says, open and loaded.
    pub async fn open_sale_spec(&self, spec: &testkit::sale::SaleSpec) -> Sale {
        testkit::sale::open_sale(&self.client, &self.address, &self.admin_token(), spec)
            .await
            .expect("a sale opens")
    }

    /// `open_sale` with a payment window of its own.
    pub async fn open_sale_with(
        &self,
        stock: u32,
        per_user_limit: u32,
        payment_timeout_secs: u32,
    ) -> Sale {
        let spec = testkit::sale::SaleSpec {
            per_user_limit,
            payment_timeout_secs,
            ..testkit::sale::SaleSpec::new(stock)
        };
        testkit::sale::open_sale(&self.client, &self.address, &self.admin_token(), &spec)
            .await
            .expect("a sale opens")
    }

    pub async fn reserve(&self, sku: &str, user: &str, body: Option<Value>) -> Response {
        let mut req = self
            .client
            .post(self.url(&format!("/flash/{sku}/reserve")))
            .bearer_auth(self.token(user));
        if let Some(b) = body {
            req = req.json(&b);
        }
        req.send().await.expect("request sent")
    }

    /// One reconciler pass over an activity (`POST …/reconcile`, which must
    /// answer 200); its report.
    pub async fn reconcile(&self, activity_id: &str) -> Value {
        let resp = self
            .admin_post(&format!("/admin/activities/{activity_id}/reconcile"), None)
            .await;
        assert_eq!(resp.status(), reqwest::StatusCode::OK);
        resp.json().await.expect("a reconcile report")
    }

    /// The test kit's invariant checker, pointed at this app's services.
    pub fn probe(&self, sale: &Sale) -> testkit::invariants::Probe {
        testkit::invariants::Probe {
            mysql_url: secrecy::ExposeSecret::expose_secret(&self.settings.mysql.url).to_owned(),
            redis_url: self.settings.redis.url.clone(),
            activity_id: sale.id.clone(),
            kafka: self.settings.kafka.clone(),
        }
    }

    pub async fn redis_stock(&self, sale: &Sale) -> Option<i64> {
        self.state
            .stock
            .stock_left(&sale.id, sale.shards)
            .await
            .expect("redis answers")
    }

    pub async fn stop(self) {
        self.shutdown.cancel();
        self.server
            .await
            .expect("server task joins")
            .expect("server stops cleanly");
    }
}

/// Asserts the documented error shape and code, and returns the body.
pub async fn assert_error(resp: Response, status: StatusCode, code: &str) -> Value {
    assert_eq!(resp.status(), status, "unexpected status");
    let body: Value = resp.json().await.expect("error body is JSON");
    assert_eq!(body["code"], code, "unexpected code in {body}");
    assert!(
        body["message"].as_str().is_some_and(|m| !m.is_empty()),
        "message missing in {body}"
    );
    body
}

/// Reads every message on the topic, up to the high watermark of each partition at
/// the time of the call.
pub async fn read_topic(topic: &str) -> Vec<ReservationMessage> {
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || read_topic_blocking(&topic))
        .await
        .expect("reader task")
}

fn read_topic_blocking(topic: &str) -> Vec<ReservationMessage> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", kafka_brokers())
        .set("group.id", unique("reader-"))
        .set("enable.auto.commit", "false")
        .create()
        .expect("consumer");
    let md = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(5))
        .expect("metadata");
    let partitions: Vec<i32> = md.topics()[0].partitions().iter().map(|p| p.id()).collect();
    assert!(!partitions.is_empty(), "topic {topic} has no partitions");
    let mut tpl = TopicPartitionList::new();
    let mut ends = HashMap::new();
    let mut remaining = 0;
    for p in partitions {
        let (lo, hi) = consumer
            .fetch_watermarks(topic, p, Duration::from_secs(5))
            .expect("watermarks");
        if hi > lo {
            tpl.add_partition_offset(topic, p, Offset::Offset(lo))
                .expect("partition");
            ends.insert(p, hi);
            remaining += hi - lo;
        }
    }
    let mut out = Vec::new();
    if remaining == 0 {
        return out;
    }
    consumer.assign(&tpl).expect("assign");
    let deadline = Instant::now() + Duration::from_secs(30);
    while remaining > 0 {
        assert!(Instant::now() < deadline, "timed out reading {topic}");
        if let Some(m) = consumer.poll(Duration::from_millis(500)) {
            let m = m.expect("message");
            if m.offset() < ends[&m.partition()] {
                remaining -= 1;
                out.push(
                    serde_json::from_slice(m.payload().expect("payload")).expect("valid message"),
                );
            }
        }
    }
    out
}

/// How many messages the topic holds (the sum of its partitions' watermarks).
pub async fn topic_len(topic: &str) -> usize {
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", kafka_brokers())
            .set("group.id", unique("len-"))
            .create()
            .expect("consumer");
        let md = consumer
            .fetch_metadata(Some(&topic), Duration::from_secs(5))
            .expect("metadata");
        md.topics()[0]
            .partitions()
            .iter()
            .map(|p| {
                let (lo, hi) = consumer
                    .fetch_watermarks(&topic, p.id(), Duration::from_secs(5))
                    .expect("watermarks");
                usize::try_from(hi - lo).unwrap_or(0)
            })
            .sum()
    })
    .await
    .expect("reader task")
}

/// A Kafka-protocol broker of the test's own, on a free port, with its data in a
/// temporary folder: a test may kill it without disturbing the others.
pub struct OwnBroker {
    pub broker: testkit::process::Broker,
    _dir: tempfile::TempDir,
}

impl OwnBroker {
    pub fn start() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        OwnBroker {
            broker: testkit::process::Broker::start(dir.path()),
            _dir: dir,
        }
    }

    pub fn brokers(&self) -> String {
        self.broker.brokers()
    }

    pub fn kill(&mut self) {
        self.broker.kill();
    }
}

/// Order rows of an activity by status.
pub async fn order_counts(app: &TestApp, activity_id: &str) -> HashMap<String, i64> {
    app.state
        .activities
        .order_counts(activity_id)
        .await
        .expect("order counts")
        .into_iter()
        .collect()
}

pub async fn db_available(app: &TestApp, activity_id: &str) -> i32 {
    app.state
        .activities
        .get(activity_id)
        .await
        .expect("query")
        .expect("activity")
        .available
}
