//! The test harness: every test spawns the real application on port 0 against the
//! real Redis, MariaDB and Kafka-protocol broker, with its own database, topic,
//! consumer group and activity ids, so tests run in parallel without sharing state.
//!
//! `TestApp::builder()` names the switches a test may turn (workers, limits,
//! relays, a second instance on another's data); `TestApp` has one method per
//! endpoint, so a test reads as the calls a client makes. The database is
//! dropped when the last app using it is dropped, whatever the test's outcome.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use flashsale::config::{BrokerQuirks, Settings};
use flashsale::kafka::ReservationMessage;
use flashsale::startup::{self, Application};
use flashsale::state::AppState;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Message, Offset, TopicPartitionList};
use reqwest::{RequestBuilder, Response, StatusCode};
use secrecy::{ExposeSecret, SecretString};
use serde_json::{json, Value};
use testkit::api::Api;
use testkit::database::TestDatabase;
use testkit::invariants::Answer;
use tokio_util::sync::{CancellationToken, DropGuard};

pub use testkit::api::Caller;
pub use testkit::identity::IdentityProvider;
pub use testkit::kafka_brokers;
pub use testkit::mock_kafka::MockKafka;
pub use testkit::redis_watch::RedisWatch;
pub use testkit::relay::Relay;
pub use testkit::sale::{Sale, SaleSpec};
pub use testkit::{eventually, unique};

/// How long a test waits for work the service does in the background.
pub const WAIT: Duration = Duration::from_secs(60);

/// The switches of one test's app, each named for what it turns on; `spawn`
/// starts it. By default: a fresh database, topic and group, port 0, the
/// consumer, the sweeper and the reconciler off (the reserve-path tests look at
/// Redis before any order exists), rate limits off.
pub struct TestAppBuilder {
    settings: Settings,
    database: Arc<TestDatabase>,
}

impl TestAppBuilder {
    fn new() -> Self {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
        let mut s = Settings::load_from(&dir, "test").expect("config/default.toml loads");
        let id = uuid::Uuid::new_v4().simple().to_string();
        let database = Arc::new(TestDatabase::new(
            testkit::database::SERVER,
            &format!("flashsale_t_{id}"),
        ));
        s.server.addr = "127.0.0.1:0".into();
        s.mysql.url = SecretString::from(database.url());
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
        s.consumer.enabled = false;
        s.orders.sweeper_enabled = false;
        s.reconcile.enabled = false;
        s.rate_limit.per_ip_per_sec = 0;
        s.rate_limit.per_user_per_sec = 0;
        TestAppBuilder {
            settings: s,
            database,
        }
    }

    /// The order consumer runs inside the app, with short batches.
    pub fn workers(mut self) -> Self {
        self.settings.consumer.enabled = true;
        self.settings.consumer.batch_wait_ms = 10;
        self
    }

    /// The consumer writes at most `per_sec` orders a second.
    pub fn max_orders_per_sec(mut self, per_sec: u32) -> Self {
        self.settings.consumer.max_orders_per_sec = per_sec;
        self
    }

    /// The unpaid-order sweeper runs every `secs`.
    pub fn sweeper_every(mut self, secs: u64) -> Self {
        self.settings.orders.sweeper_enabled = true;
        self.settings.orders.sweep_interval_secs = secs;
        self
    }

    /// The reconciler runs in the background every `secs`.
    pub fn reconciler_every(mut self, secs: u64) -> Self {
        self.settings.reconcile.enabled = true;
        self.settings.reconcile.interval_secs = secs;
        self
    }

    /// A sale's Redis state is removed `secs` after its end.
    pub fn retain_after_end_secs(mut self, secs: u64) -> Self {
        self.settings.redis.retain_after_end_secs = secs;
        self
    }

    /// A pending reservation is the reconciler's to decide after `secs`.
    pub fn pending_deadline_secs(mut self, secs: u64) -> Self {
        self.settings.reconcile.pending_deadline_secs = secs;
        self
    }

    /// A token bucket per user.
    pub fn per_user_limit(mut self, per_sec: u32, burst: u32) -> Self {
        self.settings.rate_limit.per_user_per_sec = per_sec;
        self.settings.rate_limit.per_user_burst = burst;
        self
    }

    /// A token bucket per client IP.
    pub fn per_ip_limit(mut self, per_sec: u32, burst: u32) -> Self {
        self.settings.rate_limit.per_ip_per_sec = per_sec;
        self.settings.rate_limit.per_ip_burst = burst;
        self
    }

    /// Peers whose `X-Forwarded-For` is believed.
    pub fn trusted_proxies(mut self, proxies: &[&str]) -> Self {
        self.settings.server.trusted_proxies =
            flashsale::config::TrustedProxies::parse(proxies).expect("trusted proxies parse");
        self
    }

    /// Redis reached through `relay` (which a test can hold or cut).
    pub fn redis_via(mut self, relay: &Relay) -> Self {
        self.settings.redis.url = format!("redis://127.0.0.1:{}", relay.port);
        self
    }

    /// A Redis of the test's own (`redis://host:port`).
    pub fn redis_url(mut self, url: String) -> Self {
        self.settings.redis.url = url;
        self
    }

    /// How long a Redis request may take before it fails.
    pub fn redis_response_timeout_ms(mut self, ms: u64) -> Self {
        self.settings.redis.response_timeout_ms = ms;
        self
    }

    /// MySQL reached through `relay` (which a test can cut or count).
    pub fn mysql_via(mut self, relay: &Relay) -> Self {
        let url = self
            .settings
            .mysql
            .url
            .expose_secret()
            .replace(":3306/", &format!(":{}/", relay.port));
        self.settings.mysql.url = SecretString::from(url);
        self
    }

    /// How long a request waits for a MySQL connection before it fails.
    pub fn mysql_acquire_timeout_ms(mut self, ms: u64) -> Self {
        self.settings.mysql.acquire_timeout_ms = ms;
        self
    }

    /// Another app's database; it is dropped once both apps are.
    pub fn database_of(mut self, other: &TestApp) -> Self {
        self.settings.mysql.url = other.settings.mysql.url.clone();
        self.database = other.database.clone();
        self
    }

    /// Another app's topics and consumer group: a second instance of it.
    pub fn kafka_of(mut self, other: &TestApp) -> Self {
        self.settings.kafka = other.settings.kafka.clone();
        self
    }

    /// Another app's reservation topic, read by a consumer group of its own.
    pub fn topic_of(mut self, other: &TestApp) -> Self {
        self.settings.kafka.topic = other.settings.kafka.topic.clone();
        self
    }

    /// A Kafka-protocol broker of the test's own.
    pub fn kafka_brokers(mut self, brokers: String) -> Self {
        self.settings.kafka.brokers = brokers;
        self
    }

    /// Kafka as production runs it, on librdkafka's mock cluster:
    /// `broker_quirks = "none"`, the idempotent producer on, the topics made on
    /// the mock (it has no CreateTopics).
    pub fn mock_kafka(mut self, mock: &MockKafka) -> Self {
        let kafka = &mut self.settings.kafka;
        mock.create_topic(&kafka.topic, kafka.partitions);
        mock.create_topic(&kafka.dead_letter_topic, kafka.partitions);
        kafka.brokers = mock.bootstrap();
        kafka.broker_quirks = BrokerQuirks::None;
        kafka.idempotence = true;
        kafka.create_topics = false;
        self
    }

    /// MySQL as another user of the same server (`user` with `password`).
    pub fn mysql_user(mut self, user: &str, password: &str) -> Self {
        let url = self
            .settings
            .mysql
            .url
            .expose_secret()
            .replace("//root@", &format!("//{user}:{password}@"));
        self.settings.mysql.url = SecretString::from(url);
        self
    }

    /// How long a publish may wait for the broker.
    pub fn publish_timeout_ms(mut self, ms: u64) -> Self {
        self.settings.kafka.publish_timeout_ms = ms;
        self
    }

    /// How long every message waits in the producer before it is sent.
    /// The most messages the producer holds unacknowledged.
    pub fn producer_queue_messages(mut self, messages: u32) -> Self {
        self.settings.kafka.queue_max_messages = messages;
        self
    }

    pub fn linger_ms(mut self, ms: u64) -> Self {
        self.settings.kafka.linger_ms = ms;
        self
    }

    /// Stopping: `/readyz` says no for `delay_secs` while requests are still
    /// served, then the server has `grace_secs` to finish.
    pub fn drain(mut self, delay_secs: u64, grace_secs: u64) -> Self {
        self.settings.server.drain_delay_secs = delay_secs;
        self.settings.server.shutdown_grace_secs = grace_secs;
        self
    }

    /// A second listener with the probes and metrics only.
    pub fn ops_listener(mut self) -> Self {
        self.settings.server.ops_addr = Some("127.0.0.1:0".into());
        self
    }

    /// How often the activity cache reads MySQL again.
    pub fn cache_refresh_ms(mut self, ms: u64) -> Self {
        self.settings.activities.refresh_interval_ms = ms;
        self
    }

    /// Any `auth.*` setting (HS256 off, PEM keys, refresh intervals).
    pub fn auth(mut self, change: impl FnOnce(&mut flashsale::config::AuthSettings)) -> Self {
        change(&mut self.settings.auth);
        self
    }

    /// User tokens from `idp` too: its JWKS, issuer and audience.
    pub fn identity_provider(self, idp: &IdentityProvider) -> Self {
        let url = idp.jwks_url.clone();
        self.auth(|auth| {
            auth.jwks_url = Some(url);
            auth.issuer = Some(testkit::identity::ISSUER.into());
            auth.audience = Some(testkit::identity::AUDIENCE.into());
        })
    }

    /// Named operators (`auth.operators`), each `(name, token)`.
    pub fn operators(mut self, operators: &[(&str, &str)]) -> Self {
        let list: Vec<String> = operators.iter().map(|(n, t)| format!("{n}:{t}")).collect();
        self.settings.auth.operators =
            flashsale::config::OperatorCredentials::parse_list(&list.join(","))
                .expect("operators parse");
        self.settings
            .validate()
            .expect("the operators are acceptable");
        self
    }

    /// How long an admitted waiting-room user has to reserve.
    pub fn turn_secs(mut self, secs: u64) -> Self {
        self.settings.waiting_room.turn_secs = secs;
        self
    }

    /// Migrates the database and starts the app on port 0.
    pub async fn spawn(self) -> TestApp {
        init_test_logging();
        let TestAppBuilder { settings, database } = self;
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
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(512)
            .build()
            .expect("http client");
        let api = Api::new(client, &address, settings.auth.admin_token.expose_secret())
            .with_users(state.auth.clone());
        TestApp {
            address,
            ops_address,
            api,
            settings,
            state,
            _stop_on_drop: shutdown.clone().drop_guard(),
            shutdown,
            server,
            database,
        }
    }
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

/// An app with the default switches.
pub async fn spawn_app() -> TestApp {
    TestApp::builder().spawn().await
}

pub struct TestApp {
    pub address: String,
    /// `server.ops_addr`'s listener, when the test set one.
    pub ops_address: Option<String>,
    /// The endpoints as requests not yet sent: cloned into tasks that send
    /// on their own, or sent with a caller the doors below do not name.
    pub api: Api,
    pub settings: Settings,
    pub state: AppState,
    pub shutdown: CancellationToken,
    pub server: tokio::task::JoinHandle<anyhow::Result<()>>,
    /// A test that ends without `stop` (or panics) still stops its app.
    _stop_on_drop: DropGuard,
    /// Dropped after the app's own connections (fields drop in order).
    database: Arc<TestDatabase>,
}

/// The doors: one method per endpoint, each sending its request and handing
/// back the answer (a request that cannot be sent fails the test).
impl TestApp {
    pub fn builder() -> TestAppBuilder {
        TestAppBuilder::new()
    }

    pub fn url(&self, path: &str) -> String {
        self.api.url(path)
    }

    pub fn admin_token(&self) -> String {
        self.settings.auth.admin_token.expose_secret().to_owned()
    }

    pub fn token(&self, user: &str) -> String {
        self.state.auth.issue(user, 3600).expect("token")
    }

    /// Sends a request built with `self.api`.
    pub async fn send(&self, request: RequestBuilder) -> Response {
        request.send().await.expect("request sent")
    }

    /// `GET path` without credentials (pages, probes, unknown routes).
    pub async fn get(&self, path: &str) -> Response {
        self.send(
            self.api
                .request(reqwest::Method::GET, path, Caller::Anonymous),
        )
        .await
    }

    /// `GET /flash/{sku}`.
    pub async fn sale(&self, sku: &str) -> Response {
        self.send(self.api.sale(sku)).await
    }

    /// `GET /flash/{sku}`'s body, whatever its status.
    pub async fn sale_state(&self, sku: &str) -> Value {
        self.sale(sku).await.json().await.expect("JSON")
    }

    /// `POST /flash/{sku}/reserve` as `user`, with this body if any.
    pub async fn reserve(&self, sku: &str, user: &str, body: Option<Value>) -> Response {
        let mut request = self.api.reserve(sku, Caller::User(user));
        if let Some(b) = body {
            request = request.json(&b);
        }
        self.send(request).await
    }

    /// `POST /flash/{sku}/reserve` as `user`, which must be answered `202`;
    /// the reservation's body.
    pub async fn reserve_accepted(&self, sku: &str, user: &str) -> Value {
        let resp = self.reserve(sku, user, None).await;
        assert_eq!(resp.status(), StatusCode::ACCEPTED, "{user}");
        resp.json().await.expect("JSON")
    }

    /// `POST /flash/{sku}/reserve` from any caller, without a body.
    pub async fn reserve_as(&self, sku: &str, caller: Caller<'_>) -> Response {
        self.send(self.api.reserve(sku, caller)).await
    }

    /// `POST /flash/{sku}/reserve` as `user`, with this text as a JSON body
    /// (malformed, oversized or `null` ones too).
    pub async fn reserve_raw(&self, sku: &str, user: &str, body: &str) -> Response {
        let request = self
            .api
            .reserve(sku, Caller::User(user))
            .header("content-type", "application/json")
            .body(body.to_owned());
        self.send(request).await
    }

    /// `GET /flash/{sku}/reservation` as `user`.
    pub async fn reservation(&self, sku: &str, user: &str) -> Response {
        self.send(self.api.reservation(sku, Caller::User(user)))
            .await
    }

    /// `GET /flash/{sku}/reservation` as `user`: its status and body.
    pub async fn reservation_state(&self, sku: &str, user: &str) -> (StatusCode, Value) {
        let resp = self.reservation(sku, user).await;
        let status = resp.status();
        (status, resp.json().await.expect("JSON"))
    }

    /// `POST /flash/{sku}/queue` as `user`.
    pub async fn join_queue(&self, sku: &str, user: &str) -> Response {
        self.send(self.api.join_queue(sku, Caller::User(user)))
            .await
    }

    /// `GET /flash/{sku}/queue` as `user`.
    pub async fn queue_place(&self, sku: &str, user: &str) -> Response {
        self.send(self.api.queue_place(sku, Caller::User(user)))
            .await
    }

    /// `POST /orders/{order_id}/pay` as `user`.
    pub async fn pay(&self, order_id: &str, user: &str) -> Response {
        self.send(self.api.pay(order_id, Caller::User(user))).await
    }

    /// `POST /admin/activities`.
    pub async fn create_activity(&self, body: Value) -> Response {
        self.send(self.api.create_activity(&body)).await
    }

    /// `GET /admin/activities`.
    pub async fn activities(&self) -> Response {
        self.send(self.api.activities()).await
    }

    /// `GET /admin/activities/{id}`.
    pub async fn activity(&self, id: &str) -> Response {
        self.send(self.api.activity(id)).await
    }

    /// `GET /admin/activities/{id}`'s body, whatever its status.
    pub async fn activity_figures(&self, id: &str) -> Value {
        self.activity(id).await.json().await.expect("JSON")
    }

    /// `POST /admin/activities/{id}/preload`.
    pub async fn preload(&self, id: &str) -> Response {
        self.send(self.api.preload(id)).await
    }

    /// `POST /admin/activities/{id}/pause`.
    pub async fn pause(&self, id: &str) -> Response {
        self.send(self.api.pause(id)).await
    }

    /// `POST /admin/activities/{id}/resume`.
    pub async fn resume(&self, id: &str) -> Response {
        self.send(self.api.resume(id)).await
    }

    /// `POST /admin/activities/{id}/{step}`: `preload`, `pause`, `resume`,
    /// `reconcile`.
    pub async fn admin_step(&self, id: &str, step: &str) -> Response {
        self.send(self.api.admin_step(id, step)).await
    }

    /// One reconciler pass over an activity (`POST …/reconcile`, which must
    /// answer 200); its report.
    pub async fn reconcile(&self, activity_id: &str) -> Value {
        let resp = self.send(self.api.reconcile(activity_id)).await;
        assert_eq!(resp.status(), StatusCode::OK);
        resp.json().await.expect("a reconcile report")
    }

    /// `POST /admin/activities/{id}/stock` with this body (`{"add": N}`).
    pub async fn top_up(&self, id: &str, body: Value) -> Response {
        self.send(self.api.top_up(id, &body)).await
    }

    /// `GET /admin/audit?{query}` with the shared token.
    pub async fn audit(&self, query: &str) -> Response {
        self.send(self.api.audit(query, Caller::Admin)).await
    }

    /// `GET /admin/audit?{query}`, which must answer `200`: its entries.
    pub async fn audit_entries(&self, query: &str) -> Vec<Value> {
        let resp = self.audit(query).await;
        assert_eq!(resp.status(), StatusCode::OK, "GET /admin/audit?{query}");
        resp.json().await.expect("a list of entries")
    }

    /// `GET /healthz`.
    pub async fn healthz(&self) -> Response {
        self.send(self.api.healthz()).await
    }

    /// `GET /readyz`.
    pub async fn readyz(&self) -> Response {
        self.send(self.api.readyz()).await
    }

    /// `GET /metrics`.
    pub async fn metrics(&self) -> Response {
        self.send(self.api.metrics()).await
    }

    /// `GET /metrics`' text.
    pub async fn metrics_text(&self) -> String {
        self.metrics().await.text().await.expect("text")
    }

    /// Waits until `/readyz` answers `200` (the first probe may not have
    /// finished when the server starts; on a busy machine an answer may be late
    /// for a moment); that answer's body.
    pub async fn wait_ready(&self) -> Value {
        eventually(Duration::from_secs(10), "/readyz to answer 200", || async {
            let resp = self.readyz().await;
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
}

/// Sales, and what the service holds for them.
impl TestApp {
    /// An activity open now with `stock` units, loaded into Redis and selling:
    /// created, then preloaded (an unloaded sale is loaded whatever its window).
    pub async fn open_sale(&self, stock: u32, per_user_limit: u32) -> Sale {
        self.open_sale_with(stock, per_user_limit, 900).await
    }

    /// `open_sale` with a payment window of its own.
    pub async fn open_sale_with(
        &self,
        stock: u32,
        per_user_limit: u32,
        payment_timeout_secs: u32,
    ) -> Sale {
        self.open_sale_spec(&SaleSpec {
            per_user_limit,
            payment_timeout_secs,
            ..SaleSpec::new(stock)
        })
        .await
    }

    /// A sale as `spec` says, open and loaded.
    pub async fn open_sale_spec(&self, spec: &SaleSpec) -> Sale {
        testkit::sale::open_sale(&self.api.client, &self.address, &self.admin_token(), spec)
            .await
            .expect("a sale opens")
    }

    /// A sale selling now (one per user) that ends `ends_in` from now, loaded
    /// into Redis.
    pub async fn open_sale_ending(
        &self,
        stock: u32,
        ends_in: Duration,
        payment_timeout_secs: u32,
    ) -> Sale {
        let now = chrono::Utc::now();
        let sku = testkit::unique("sku-");
        let resp = self
            .create_activity(json!({
                "sku": sku,
                "stock": stock,
                "per_user_limit": 1,
                "starts_at": now - chrono::Duration::seconds(5),
                "ends_at": now + chrono::Duration::from_std(ends_in).expect("a short window"),
                "payment_timeout_secs": payment_timeout_secs,
            }))
            .await;
        assert_eq!(resp.status(), StatusCode::CREATED);
        let body: Value = resp.json().await.expect("JSON");
        let id = body["id"].as_str().expect("id").to_owned();
        assert_eq!(self.preload(&id).await.status(), StatusCode::OK);
        Sale { id, sku, shards: 1 }
    }

    /// Fires `clicks` concurrent reserve requests for each of `users` users, at
    /// most `parallel` at a time, and returns (user, status, body) for every
    /// answer.
    pub async fn crowd(
        &self,
        sku: &str,
        users: usize,
        clicks: usize,
        parallel: usize,
    ) -> Vec<(String, StatusCode, Value)> {
        let gate = Arc::new(tokio::sync::Semaphore::new(parallel));
        let mut tasks = Vec::with_capacity(users * clicks);
        for u in 0..users {
            let user = format!("user-{u}");
            let token = self.token(&user);
            for _ in 0..clicks {
                let request = self.api.reserve(sku, Caller::Token(&token));
                let (user, gate) = (user.clone(), gate.clone());
                tasks.push(tokio::spawn(async move {
                    let _permit = gate.acquire_owned().await.expect("semaphore open");
                    let resp = request.send().await.expect("request sent");
                    let status = resp.status();
                    let body: Value = resp.json().await.expect("JSON body");
                    (user, status, body)
                }));
            }
        }
        let mut out = Vec::with_capacity(tasks.len());
        for t in tasks {
            out.push(t.await.expect("request task"));
        }
        out
    }

    /// The test kit's invariant checker, pointed at this app's services.
    pub fn probe(&self, sale: &Sale) -> testkit::invariants::Probe {
        testkit::invariants::Probe {
            mysql_url: self.settings.mysql.url.expose_secret().to_owned(),
            redis_url: self.settings.redis.url.clone(),
            activity_id: sale.id.clone(),
            kafka: self.settings.kafka.clone(),
        }
    }

    /// Whether the primaries holding the sale's shards have a replica online
    /// (a lone Redis has none; each primary of the test Cluster has one).
    /// Panics when some have and some have not: no test sets that up.
    pub async fn replicas_online(&self, sale: &Sale) -> bool {
        let mut conn = self.state.stock.connection();
        let mut seen = Vec::new();
        for k in flashsale::stock::Keys::all(&sale.id, sale.shards) {
            // A script naming the shard's key runs on the node that owns it.
            let info: String = redis::cmd("EVAL")
                .arg("return redis.call('INFO', 'replication')")
                .arg(1)
                .arg(&k.barrier)
                .query_async(&mut conn)
                .await
                .expect("INFO replication of a shard's primary");
            seen.push(info.contains("state=online"));
        }
        assert!(
            seen.iter().all(|s| *s == seen[0]),
            "replicas online on some shards only: {seen:?}"
        );
        seen[0]
    }

    /// The sale's state in Redis, summed over its shards.
    pub async fn redis_snapshot(&self, sale: &Sale) -> flashsale::stock::StockSnapshot {
        self.state
            .stock
            .snapshot(&sale.id, sale.shards)
            .await
            .expect("snapshot")
    }

    pub async fn redis_stock(&self, sale: &Sale) -> Option<i64> {
        self.state
            .stock
            .stock_left(&sale.id, sale.shards)
            .await
            .expect("redis answers")
    }

    /// Starts listing the commands Redis runs that name this sale (MONITOR on
    /// every node; see `testkit::redis_watch`).
    pub async fn watch_redis(&self, sale: &Sale) -> RedisWatch {
        RedisWatch::start(&self.settings.redis.url, &sale.id).await
    }

    /// Stops `watch` once every command sent before this call was listed
    /// (a marker `GET` on each shard's node) and returns what it saw.
    pub async fn watched(&self, sale: &Sale, watch: RedisWatch) -> Vec<String> {
        let mut conn = self.state.stock.connection();
        let mut markers = Vec::new();
        for k in flashsale::stock::Keys::all(&sale.id, sale.shards) {
            let marker = format!("{}:marker-{}", k.stock, unique(""));
            let _: Option<String> = redis::cmd("GET")
                .arg(&marker)
                .query_async(&mut conn)
                .await
                .expect("a marker GET");
            markers.push(marker);
        }
        watch.until(&markers).await
    }

    /// Order rows of an activity by status.
    pub async fn order_counts(&self, activity_id: &str) -> HashMap<String, i64> {
        self.state
            .activities
            .order_counts(activity_id)
            .await
            .expect("order counts")
            .into_iter()
            .collect()
    }

    /// MySQL's count of the units still for sale.
    pub async fn db_available(&self, activity_id: &str) -> i32 {
        self.state
            .activities
            .get(activity_id)
            .await
            .expect("query")
            .expect("activity")
            .available
    }

    /// Waits until MySQL holds at least `total` orders of the activity.
    pub async fn wait_for_orders(&self, activity_id: &str, total: i64) {
        eventually(WAIT, "orders in MySQL", || async {
            let n: i64 = self.order_counts(activity_id).await.values().sum();
            (n >= total).then_some(())
        })
        .await;
    }

    /// Waits until exactly `n` orders of the activity have this status.
    pub async fn wait_for_status(&self, activity_id: &str, status: &str, n: i64) {
        eventually(WAIT, &format!("{n} orders {status}"), || async {
            (self.order_counts(activity_id).await.get(status) == Some(&n)).then_some(())
        })
        .await;
    }

    /// Waits until no reservation of the sale is pending in Redis.
    pub async fn wait_nothing_pending(&self, sale: &Sale) -> flashsale::stock::StockSnapshot {
        eventually(WAIT, "nothing pending", || async {
            let s = self
                .state
                .stock
                .snapshot(&sale.id, sale.shards)
                .await
                .ok()?;
            (s.pending == 0).then_some(s)
        })
        .await
    }

    /// Waits until the consumers have read every message on the topic.
    pub async fn wait_drained(&self) {
        eventually(WAIT, "the consumers to drain", || async {
            let lag = flashsale::kafka::consumer_lag(&self.settings.kafka)
                .await
                .ok()?;
            (lag == 0).then_some(())
        })
        .await;
    }

    /// Waits until this instance's sold-out gate is shut for the activity (it
    /// shuts once the buyers' filters are read, in the background): a few
    /// probe users, so that one the filters cannot rule out does not hide it.
    pub async fn wait_gate_shut(&self, activity_id: &str) {
        eventually(Duration::from_secs(5), "the gate shut", || async {
            (0..8)
                .any(|i| {
                    self.state
                        .stock
                        .sold_out_from_memory(activity_id, &format!("probe-{i}"))
                })
                .then_some(())
        })
        .await;
    }

    /// The unpaid-order sweeper, to run by hand.
    pub fn sweeper(&self) -> flashsale::orders::Sweeper {
        flashsale::orders::Sweeper {
            repo: self.state.orders.clone(),
            stock: self.state.stock.clone(),
        }
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

    /// Stops the server, waits for it, and closes its connections (the
    /// database goes when the last app using it is dropped).
    pub async fn stop(self) {
        self.shutdown.cancel();
        self.server
            .await
            .expect("server task joins")
            .expect("server stops cleanly");
        self.state.pool.close().await;
    }
}

/// New buyers reserving without pause from a few tasks, each a user never seen
/// before, until stopped: a flash sale's crowd, beside which a test changes
/// something.
pub struct Flood {
    stop: Arc<AtomicBool>,
    accepted: Arc<AtomicUsize>,
    refused: Arc<AtomicUsize>,
    answers: Arc<Mutex<Vec<Answer>>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Flood {
    /// `workers` tasks reserving `sku`, each waiting for its answer before the
    /// next request.
    pub fn start(app: &TestApp, sku: &str, workers: usize) -> Flood {
        let next_user = Arc::new(AtomicUsize::new(0));
        let mut flood = Flood {
            stop: Arc::new(AtomicBool::new(false)),
            accepted: Arc::new(AtomicUsize::new(0)),
            refused: Arc::new(AtomicUsize::new(0)),
            answers: Arc::new(Mutex::new(Vec::new())),
            tasks: Vec::new(),
        };
        for _ in 0..workers {
            let (api, sku, next_user) = (app.api.clone(), sku.to_owned(), next_user.clone());
            let (stop, accepted, refused, answers) = (
                flood.stop.clone(),
                flood.accepted.clone(),
                flood.refused.clone(),
                flood.answers.clone(),
            );
            flood.tasks.push(tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let user = format!("flood-{}", next_user.fetch_add(1, Ordering::Relaxed));
                    let sent = api.reserve(&sku, Caller::User(&user)).send().await;
                    let answer = Answer::from_response(sent).await;
                    match answer.status {
                        Some(202) => accepted.fetch_add(1, Ordering::Relaxed),
                        Some(409) => refused.fetch_add(1, Ordering::Relaxed),
                        _ => 0,
                    };
                    answers.lock().expect("answers").push(answer);
                }
            }));
        }
        flood
    }

    /// `202`s so far.
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::Relaxed)
    }

    /// `409`s so far.
    pub fn refused(&self) -> usize {
        self.refused.load(Ordering::Relaxed)
    }

    /// Answers of any kind so far.
    pub fn answered(&self) -> usize {
        self.answers.lock().expect("answers").len()
    }

    /// Stops the buyers and returns every answer they got.
    pub async fn stop(self) -> Vec<Answer> {
        self.stop.store(true, Ordering::Relaxed);
        for task in self.tasks {
            task.await.expect("flood task");
        }
        let answers = self.answers.lock().expect("answers").clone();
        answers
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
    read_topic_on(&kafka_brokers(), topic).await
}

/// [`read_topic`] on the brokers `brokers`.
pub async fn read_topic_on(brokers: &str, topic: &str) -> Vec<ReservationMessage> {
    let (brokers, topic) = (brokers.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || read_topic_blocking(&brokers, &topic))
        .await
        .expect("reader task")
}

fn read_topic_blocking(brokers: &str, topic: &str) -> Vec<ReservationMessage> {
    each_message_on(brokers, topic, |m| {
        serde_json::from_slice(m.payload().expect("payload")).expect("valid message")
    })
}

/// What `read` makes of each message on the topic, from its start to the ends
/// it had when this began (blocking: run it off the runtime's workers).
pub fn each_message_blocking<T>(
    topic: &str,
    read: impl Fn(&rdkafka::message::BorrowedMessage<'_>) -> T,
) -> Vec<T> {
    each_message_on(&kafka_brokers(), topic, read)
}

fn each_message_on<T>(
    brokers: &str,
    topic: &str,
    read: impl Fn(&rdkafka::message::BorrowedMessage<'_>) -> T,
) -> Vec<T> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
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
                out.push(read(&m));
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

/// The quoted words of a `MONITOR` line that quotes no code: the command and
/// its arguments.
pub fn words(line: &str) -> Vec<&str> {
    line.split('"').skip(1).step_by(2).collect()
}

/// The script calls among `MONITOR` lines, each with the commands it ran (a
/// script's commands follow its call, uninterrupted, on its node; a call
/// answered `NOSCRIPT`, which ran nothing, is left out: the call sent again
/// with its code follows), and the lines that belong to none.
pub fn script_calls(lines: &[String]) -> (Vec<(&String, Vec<&String>)>, Vec<String>) {
    let mut runs: Vec<(&String, Vec<&String>)> = Vec::new();
    let mut other = Vec::new();
    for line in lines {
        let command = words(line).first().map(|c| c.to_uppercase());
        if matches!(command.as_deref(), Some("EVALSHA" | "EVAL")) {
            runs.push((line, Vec::new()));
        } else if line.contains("[0 lua]") {
            runs.last_mut()
                .expect("a script's command after its call")
                .1
                .push(line);
        } else {
            other.push(line.clone());
        }
    }
    runs.retain(|(_, inner)| !inner.is_empty());
    (runs, other)
}
