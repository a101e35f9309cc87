//! Layered, typed settings: `config/default.toml`, then `config/{FLASHSALE_ENV}.toml`
//! when present, then `FLASHSALE__<SECTION>__<KEY>` environment variables.
//!
//! Every default value is written once, in `config/default.toml`, which is always
//! read: the types here add none of their own (the few `#[serde(default)]`s are
//! empty: no trusted proxy, no debug context, no second listener).
//!
//! Secrets are `SecretString`s so they never reach a log line through `Debug`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;

mod operators;
mod trusted_proxies;

pub use operators::{OperatorCredential, OperatorCredentials, SHARED_TOKEN_NAME};
pub use trusted_proxies::TrustedProxies;

/// The development admin token shipped in `config/default.toml`.
pub const DEV_ADMIN_TOKEN: &str = "dev-admin-token-change-me";
/// The development user-token secret shipped in `config/default.toml`.
pub const DEV_USER_TOKEN_SECRET: &str = "dev-user-token-secret-change-me";

#[derive(Debug, Clone, Deserialize)]
pub struct Settings {
    pub server: ServerSettings,
    pub log: LogSettings,
    pub redis: RedisSettings,
    pub mysql: MysqlSettings,
    pub kafka: KafkaSettings,
    pub auth: AuthSettings,
    pub rate_limit: RateLimitSettings,
    pub activities: ActivitiesSettings,
    pub consumer: ConsumerSettings,
    pub orders: OrdersSettings,
    pub reconcile: ReconcileSettings,
    pub waiting_room: WaitingRoomSettings,
    pub telemetry: TelemetrySettings,
    pub payments: PaymentsSettings,
}

/// How an order comes to be paid (API version 4, "Payments").
#[derive(Debug, Clone, Deserialize)]
pub struct PaymentsSettings {
    pub provider: PaymentProvider,
    /// In production, accept `provider = "none"` all the same: orders marked
    /// paid by their owners, with no money checked.
    pub allow_unverified: bool,
}

/// Who says an order is paid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum PaymentProvider {
    /// Nobody: `POST /orders/{order_id}/pay` by the owner marks the order paid
    /// at once (development and tests; refused in production unless
    /// `payments.allow_unverified`).
    #[serde(rename = "none")]
    None,
}

/// OpenTelemetry traces, exported over OTLP/HTTP with JSON bodies. Off unless
/// an endpoint is set here or in `OTEL_EXPORTER_OTLP_ENDPOINT` (see
/// `crate::telemetry`).
#[derive(Debug, Clone, Deserialize)]
pub struct TelemetrySettings {
    /// The collector's base URL (`http://host:4318`); `/v1/traces` is added.
    /// Empty: the standard `OTEL_EXPORTER_OTLP_*` variables decide.
    pub otlp_endpoint: String,
    /// How long finished spans wait to be sent together.
    pub export_delay_ms: u64,
    /// The share of new traces recorded (0 to 1); a trace that arrives with a
    /// parent (a `traceparent` header) follows its parent's choice.
    pub sample_ratio: f64,
}

/// Waiting rooms (activities with `"admission": "waiting_room"`).
#[derive(Debug, Clone, Deserialize)]
pub struct WaitingRoomSettings {
    /// How long an admitted user has to reserve before the turn goes to the next.
    pub turn_secs: u64,
    /// How often each instance admits (and draws, once due).
    pub tick_ms: u64,
    /// Users each instance remembers as joined before a room's start, to
    /// answer their polls without Redis until then (0: never).
    pub remembered_joins: usize,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ServerSettings {
    pub addr: String,
    pub max_concurrency: usize,
    pub request_timeout_ms: u64,
    pub body_limit_bytes: usize,
    pub shutdown_grace_secs: u64,
    /// After SIGTERM, how long `/readyz` answers `503` while requests are still
    /// served, before the server stops taking new ones.
    pub drain_delay_secs: u64,
    /// Proxies whose `X-Forwarded-For` names the client (addresses or CIDRs; as
    /// an environment variable, a comma-separated list).
    #[serde(default)]
    pub trusted_proxies: TrustedProxies,
    /// A second listener serving only `/metrics`, `/healthz` and `/readyz`
    /// (the main listener serves them too); none when absent.
    #[serde(default)]
    pub ops_addr: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct LogSettings {
    pub format: LogFormat,
    pub filter: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

/// The Kafka broker's known defects the service works around
/// (`kafka.broker_quirks`, docs/API.md version 4).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub enum BrokerQuirks {
    /// A broker that implements Kafka's protocol as Apache Kafka does (Apache
    /// Kafka, Redpanda, managed Kafka): no workaround runs.
    #[default]
    #[serde(rename = "none")]
    None,
    /// tansu 0.6, the development and test broker: its idempotent producer
    /// panics once a producer's epoch is bumped, so the producer runs without
    /// idempotence; its coordinator drops departed members without telling the
    /// group, so the consumer watches for partitions nobody holds and rejoins
    /// (`orders::ghosts`).
    #[serde(rename = "tansu-0.6")]
    Tansu06,
}

#[derive(Debug, Clone, Deserialize)]
pub struct RedisSettings {
    pub url: String,
    pub connection_timeout_ms: u64,
    pub response_timeout_ms: u64,
    /// Replicas that must hold a reservation before its `202` (`WAIT`).
    pub min_replicas_acked: ReplicasAcked,
    /// How long a reservation waits for those replicas before it is withdrawn.
    pub replica_ack_timeout_ms: u64,
    /// How long after its `ends_at` a sale's Redis state is removed; everything
    /// about the sale is then answered from MySQL.
    #[serde(default = "default_retain_after_end_secs")]
    pub retain_after_end_secs: u64,
}

/// `redis.min_replicas_acked`: `auto` (the default) waits for one replica
/// whenever the sale's primary has one online and answers without waiting (and
/// counts it) while it has none; `N` waits for N replicas strictly (none: `503`);
/// `0` never waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicasAcked {
    Auto,
    Exactly(u32),
}

impl ReplicasAcked {
    /// Whether a reservation may ever wait for a replica.
    pub fn waits(self) -> bool {
        self != ReplicasAcked::Exactly(0)
    }
}

impl std::fmt::Display for ReplicasAcked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReplicasAcked::Auto => f.write_str("auto"),
            ReplicasAcked::Exactly(n) => write!(f, "{n}"),
        }
    }
}

impl<'de> Deserialize<'de> for ReplicasAcked {
    /// `auto`, or a whole number: written in TOML or, from the environment, as text.
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(u32),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Number(n) => Ok(ReplicasAcked::Exactly(n)),
            Raw::Text(t) if t.trim().eq_ignore_ascii_case("auto") => Ok(ReplicasAcked::Auto),
            Raw::Text(t) => t.trim().parse().map(ReplicasAcked::Exactly).map_err(|_| {
                serde::de::Error::custom(format!(
                    "redis.min_replicas_acked must be auto or a whole number, not {t:?}"
                ))
            }),
        }
    }
}

fn default_retain_after_end_secs() -> u64 {
    86_400
}

#[derive(Debug, Clone, Deserialize)]
pub struct MysqlSettings {
    /// May carry a password, hence secret.
    pub url: SecretString,
    pub max_connections: u32,
    pub acquire_timeout_ms: u64,
}

#[derive(Debug, Clone, Deserialize)]
pub struct KafkaSettings {
    pub brokers: String,
    pub topic: String,
    pub dead_letter_topic: String,
    pub group_id: String,
    pub create_topics: bool,
    pub partitions: i32,
    pub replication_factor: i32,
    pub publish_timeout_ms: u64,
    pub linger_ms: u64,
    /// librdkafka's `batch.size`: the most bytes one batch of a partition holds.
    pub batch_bytes: u32,
    /// librdkafka's `max.in.flight.requests.per.connection` (at most 5 with
    /// idempotence). 1 by default: while a produce request waits for `acks=all`,
    /// the next one gathers every publish that arrived, so fewer, fuller requests
    /// carry the same load (measured by the benchmark's producer section).
    pub max_in_flight: u32,
    /// The idempotent producer (no duplicates from retries). On by default,
    /// and refused off unless `broker_quirks = "tansu-0.6"`, under which the
    /// producer runs without it whatever this says (see
    /// [`KafkaSettings::idempotent`]).
    pub idempotence: bool,
    /// The broker's known defects worked around; `none` by default.
    #[serde(default)]
    pub broker_quirks: BrokerQuirks,
    /// librdkafka's `debug` contexts (e.g. "consumer,cgrp"); empty for none.
    #[serde(default)]
    pub client_debug: String,
    /// librdkafka's `queue.buffering.max.messages`: the most messages the
    /// producer holds unacknowledged, every sale's together. A publish that
    /// finds it full is refused at once: never sent, its units returned, `503`.
    #[serde(default = "default_queue_max_messages")]
    pub queue_max_messages: u32,
}

impl KafkaSettings {
    /// Whether the producer runs idempotent: as configured, except against
    /// tansu 0.6, whose support for it is broken (the consumer absorbs the
    /// duplicates a retry may make).
    pub fn idempotent(&self) -> bool {
        self.idempotence && self.broker_quirks != BrokerQuirks::Tansu06
    }

    /// Whether the consumer watches its group for partitions a departed
    /// member left with nobody (tansu 0.6's coordinator). Against Kafka's own
    /// group protocol it never rejoins over a live member.
    pub fn watches_for_ghost_members(&self) -> bool {
        self.broker_quirks == BrokerQuirks::Tansu06
    }
}

/// librdkafka's own default for `queue.buffering.max.messages`.
fn default_queue_max_messages() -> u32 {
    100_000
}

#[derive(Debug, Clone, Deserialize)]
pub struct AuthSettings {
    pub admin_token: SecretString,
    pub user_token_secret: SecretString,
    /// HS256 user tokens signed with `user_token_secret` are accepted; false when
    /// an identity provider signs every user token.
    pub hs256: bool,
    /// User tokens kept as verified (subject and expiry) per process; 0 verifies
    /// every request in full.
    pub verified_tokens: usize,
    /// Clock skew allowed on `exp` and `nbf`, in seconds.
    pub leeway_secs: u64,
    /// The identity provider's JWKS document (`https://…`); none when absent.
    #[serde(default)]
    pub jwks_url: Option<String>,
    /// Public keys of the identity provider as PEM files (RSA or EC P-256/P-384);
    /// a file's name without its extension is its `kid`. As an environment
    /// variable, a comma-separated list.
    #[serde(default)]
    pub public_keys: Vec<PathBuf>,
    /// When set, an identity provider's token must carry this `iss`.
    #[serde(default)]
    pub issuer: Option<String>,
    /// When set, an identity provider's token must carry this `aud`.
    #[serde(default)]
    pub audience: Option<String>,
    /// How often the JWKS is fetched again while all goes well.
    pub jwks_refresh_secs: u64,
    /// A token with an unknown `kid` fetches the JWKS at most once per this.
    pub jwks_min_refresh_secs: u64,
    /// How long one fetch of the JWKS may take.
    pub jwks_timeout_ms: u64,
    /// Named admin credentials beside `admin_token` (`config::operators`);
    /// none when absent.
    #[serde(default)]
    pub operators: OperatorCredentials,
}

/// The largest `auth.leeway_secs` accepted.
pub const MAX_LEEWAY_SECS: u64 = 300;

impl AuthSettings {
    /// Whether tokens signed by an identity provider are accepted.
    pub fn has_identity_provider(&self) -> bool {
        self.jwks_url.is_some() || !self.public_keys.is_empty()
    }

    fn validate(&self) -> anyhow::Result<()> {
        if self.admin_token.expose_secret().len() < 16 {
            bail!("auth.admin_token must be at least 16 characters");
        }
        if self.hs256 && self.user_token_secret.expose_secret().len() < 16 {
            bail!("auth.user_token_secret must be at least 16 characters (or set auth.hs256 = false to refuse HS256 user tokens)");
        }
        if !self.hs256 && !self.has_identity_provider() {
            bail!("auth.hs256 is false and no identity provider is configured (auth.jwks_url or auth.public_keys): no user token could be verified");
        }
        if let Some(url) = &self.jwks_url {
            let parsed = reqwest::Url::parse(url)
                .with_context(|| format!("auth.jwks_url {url:?} is not a URL"))?;
            let host = parsed.host_str().unwrap_or_default();
            match parsed.scheme() {
                "https" => {}
                "http" if is_loopback(host) => {}
                _ => bail!("auth.jwks_url must be an https URL (http only on a loopback host): keys fetched in clear text could be swapped on the way"),
            }
        }
        for (key, value) in [
            ("auth.issuer", &self.issuer),
            ("auth.audience", &self.audience),
        ] {
            if value.as_deref().is_some_and(|v| v.trim().is_empty()) {
                bail!("{key} must not be empty: leave it out to accept any");
            }
        }
        if self.jwks_min_refresh_secs == 0 || self.jwks_timeout_ms == 0 {
            bail!("auth.jwks_min_refresh_secs and auth.jwks_timeout_ms must be positive");
        }
        if self.leeway_secs > MAX_LEEWAY_SECS {
            bail!("auth.leeway_secs must be 0 to {MAX_LEEWAY_SECS} (a clock skew in seconds)");
        }
        if self.jwks_refresh_secs < self.jwks_min_refresh_secs {
            bail!("auth.jwks_refresh_secs must be at least auth.jwks_min_refresh_secs");
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct RateLimitSettings {
    pub per_ip_per_sec: u32,
    pub per_ip_burst: u32,
    pub per_user_per_sec: u32,
    pub per_user_burst: u32,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ActivitiesSettings {
    pub refresh_interval_ms: u64,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ConsumerSettings {
    pub enabled: bool,
    pub batch_size: usize,
    pub batch_wait_ms: u64,
    /// Where `flashsale consume` serves `/metrics` and `/healthz`.
    pub metrics_addr: String,
    /// The group session: a consumer silent this long loses its partitions.
    pub session_timeout_ms: u64,
    pub heartbeat_interval_ms: u64,
    /// The most orders a second this instance's consumer writes into MySQL
    /// (0: no budget); beyond it the backlog waits in the topic.
    #[serde(default)]
    pub max_orders_per_sec: u32,
    /// The consumer slows down when its own commits slow down (see
    /// `orders::pace`).
    #[serde(default)]
    pub adaptive_pace: bool,
}

#[derive(Debug, Clone, Deserialize)]
pub struct OrdersSettings {
    pub sweeper_enabled: bool,
    pub sweep_interval_secs: u64,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ReconcileSettings {
    pub enabled: bool,
    pub interval_secs: u64,
    pub pending_deadline_secs: u64,
}

/// The environment the process runs in, from `FLASHSALE_ENV` (default `development`).
pub fn environment() -> String {
    std::env::var("FLASHSALE_ENV").unwrap_or_else(|_| "development".to_owned())
}

impl Settings {
    /// Loads settings from `./config` (or `FLASHSALE_CONFIG_DIR`) and the environment.
    pub fn load() -> anyhow::Result<Self> {
        let dir = std::env::var_os("FLASHSALE_CONFIG_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("config"));
        Self::load_from(&dir, &environment())
    }

    /// Loads settings from the given folder for the given environment name.
    pub fn load_from(dir: &Path, env: &str) -> anyhow::Result<Self> {
        Self::load_with_vars(dir, env, None)
    }

    /// `load_from` with these variables instead of the process's environment
    /// (for tests, which must not change a variable other tests read).
    fn load_with_vars(
        dir: &Path,
        env: &str,
        vars: Option<config::Map<String, String>>,
    ) -> anyhow::Result<Self> {
        let settings: Settings = config::Config::builder()
            .add_source(config::File::from(dir.join("default.toml")).required(true))
            .add_source(config::File::from(dir.join(format!("{env}.toml"))).required(false))
            .add_source(
                config::Environment::with_prefix("FLASHSALE")
                    .source(vars)
                    .prefix_separator("__")
                    .separator("__")
                    .list_separator(",")
                    .with_list_parse_key("server.trusted_proxies")
                    .with_list_parse_key("auth.public_keys")
                    .try_parsing(true),
            )
            .build()
            .with_context(|| format!("failed to read configuration from {}", dir.display()))?
            .try_deserialize()
            .context("configuration is incomplete or has a value of the wrong type")?;
        settings.validate()?;
        Ok(settings)
    }

    /// Checks what types alone cannot.
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.kafka.topic.is_empty() || self.kafka.dead_letter_topic.is_empty() {
            bail!("kafka.topic and kafka.dead_letter_topic must not be empty");
        }
        if self.kafka.topic == self.kafka.dead_letter_topic {
            bail!("kafka.dead_letter_topic must differ from kafka.topic");
        }
        if self.kafka.partitions < 1 || self.kafka.replication_factor < 1 {
            bail!("kafka.partitions and kafka.replication_factor must be at least 1");
        }
        if self.kafka.publish_timeout_ms == 0 {
            bail!("kafka.publish_timeout_ms must be positive");
        }
        if self.kafka.batch_bytes == 0 || self.kafka.max_in_flight == 0 {
            bail!("kafka.batch_bytes and kafka.max_in_flight must be positive");
        }
        if !self.kafka.idempotence && self.kafka.broker_quirks == BrokerQuirks::None {
            bail!("kafka.idempotence = false is only for a broker whose idempotent producer is broken: set kafka.broker_quirks = \"tansu-0.6\" for tansu 0.6, or leave idempotence on");
        }
        if self.kafka.idempotent() && self.kafka.max_in_flight > 5 {
            bail!("kafka.max_in_flight must be at most 5 with kafka.idempotence");
        }
        if self
            .server
            .ops_addr
            .as_deref()
            .is_some_and(|a| a.trim().is_empty())
        {
            bail!("server.ops_addr must be a host:port, or absent");
        }
        if self.server.max_concurrency == 0 || self.server.request_timeout_ms == 0 {
            bail!("server.max_concurrency and server.request_timeout_ms must be positive");
        }
        if self.rate_limit.per_ip_per_sec > 0 && self.rate_limit.per_ip_burst == 0 {
            bail!("rate_limit.per_ip_burst must be positive when per_ip_per_sec is set");
        }
        if self.rate_limit.per_user_per_sec > 0 && self.rate_limit.per_user_burst == 0 {
            bail!("rate_limit.per_user_burst must be positive when per_user_per_sec is set");
        }
        if self.orders.sweep_interval_secs == 0 || self.reconcile.interval_secs == 0 {
            bail!("orders.sweep_interval_secs and reconcile.interval_secs must be positive");
        }
        if self.waiting_room.turn_secs == 0 || self.waiting_room.tick_ms == 0 {
            bail!("waiting_room.turn_secs and waiting_room.tick_ms must be positive");
        }
        if self.consumer.heartbeat_interval_ms == 0
            || self.consumer.heartbeat_interval_ms * 3 > self.consumer.session_timeout_ms
        {
            bail!("consumer.heartbeat_interval_ms must be at least 1 and at most a third of consumer.session_timeout_ms");
        }
        if self.consumer.batch_size == 0 {
            bail!("consumer.batch_size must be at least 1");
        }
        if self.telemetry.export_delay_ms == 0 {
            bail!("telemetry.export_delay_ms must be positive");
        }
        if !(0.0..=1.0).contains(&self.telemetry.sample_ratio) {
            bail!("telemetry.sample_ratio must be between 0 and 1");
        }
        self.auth.validate()?;
        self.auth.operators.validate(&self.auth.admin_token)?;
        if self.auth.jwks_url.is_some()
            && self.auth.jwks_timeout_ms >= self.server.request_timeout_ms
        {
            bail!("auth.jwks_timeout_ms must be less than server.request_timeout_ms: a request waiting for the JWKS must be answered before it times out");
        }
        Ok(())
    }

    /// Refuses an identity provider without both `auth.issuer` and
    /// `auth.audience` whenever `server.addr` is not a loopback address: a
    /// provider's keys sign the tokens of all its tenants and applications
    /// (Firebase, Azure AD's common endpoint), which only these two tell apart.
    /// On loopback, a warning. Called by `serve`.
    pub fn check_identity_provider(&self) -> anyhow::Result<()> {
        if !self.auth.has_identity_provider()
            || (self.auth.issuer.is_some() && self.auth.audience.is_some())
        {
            return Ok(());
        }
        if !is_loopback(&self.server.addr) {
            bail!(
                "refusing to start: an identity provider is configured (auth.jwks_url or auth.public_keys) without both auth.issuer and auth.audience, and server.addr {} is not a loopback address; tokens the provider signs for others would be accepted",
                self.server.addr
            );
        }
        tracing::warn!("an identity provider is configured without both auth.issuer and auth.audience: any token its keys sign is accepted (allowed on loopback only)");
        Ok(())
    }

    /// Refuses, in production (`FLASHSALE_ENV=production`), orders paid on
    /// their owners' word (`payments.provider = "none"`) unless the deployment
    /// says it means it (`payments.allow_unverified = true`). Called by `serve`.
    pub fn check_payments(&self, env: &str) -> anyhow::Result<()> {
        if env == "production"
            && self.payments.provider == PaymentProvider::None
            && !self.payments.allow_unverified
        {
            bail!("refusing to start: payments.provider = \"none\" lets buyers mark their own orders paid, with no payment checked, and FLASHSALE_ENV=production; set FLASHSALE__PAYMENTS__ALLOW_UNVERIFIED=true if that is what this deployment wants");
        }
        Ok(())
    }

    /// Refuses the published development secrets (`config/default.toml`'s, so
    /// anyone can sign a user token or act as admin with them) whenever the
    /// deployment is not plainly local: in production, whenever `server.addr` is
    /// not a loopback address (whatever the environment is called: a deployment
    /// that forgets `FLASHSALE_ENV` is still refused), and whenever
    /// `server.trusted_proxies` names any proxy (requests then come through
    /// another machine, even to a loopback listener).
    /// `server.ops_addr` does not matter here: it serves no authenticated
    /// endpoint, so the secrets cannot be used through it. Called by `serve`.
    pub fn check_published_secrets(&self, env: &str) -> anyhow::Result<()> {
        let published: Vec<&str> = [
            (
                self.auth.admin_token.expose_secret() == DEV_ADMIN_TOKEN,
                "auth.admin_token (FLASHSALE__AUTH__ADMIN_TOKEN)",
            ),
            (
                // With HS256 off the secret verifies nothing, whatever it is.
                self.auth.hs256
                    && self.auth.user_token_secret.expose_secret() == DEV_USER_TOKEN_SECRET,
                "auth.user_token_secret (FLASHSALE__AUTH__USER_TOKEN_SECRET)",
            ),
        ]
        .into_iter()
        .filter_map(|(is_published, key)| is_published.then_some(key))
        .collect();
        if published.is_empty() {
            return Ok(());
        }
        let keys = published.join(" and ");
        if env == "production" {
            bail!("refusing to start: {keys} still has the published development value in production (FLASHSALE_ENV=production); set a secret of your own");
        }
        if !is_loopback(&self.server.addr) {
            bail!(
                "refusing to start: {keys} still has the published development value and server.addr {} is not a loopback address; set a secret of your own, or listen on 127.0.0.1 for development",
                self.server.addr
            );
        }
        if !self.server.trusted_proxies.is_empty() {
            bail!(
                "refusing to start: {keys} still has the published development value and server.trusted_proxies is set ({}), so requests come through a proxy from other machines; set a secret of your own, or leave server.trusted_proxies empty for development",
                self.server.trusted_proxies
            );
        }
        Ok(())
    }
}

/// Whether a listen address (`host:port`, or a bare host) can only be reached
/// from this machine: a loopback IP (`127.0.0.0/8`, `::1`, and `::ffff:127.…`),
/// or the name `localhost`. Any other name counts as reachable from outside: what
/// it resolves to is not this check's to trust.
pub fn is_loopback(addr: &str) -> bool {
    use std::net::{IpAddr, SocketAddr};
    let addr = addr.trim();
    if let Ok(socket) = addr.parse::<SocketAddr>() {
        return socket.ip().to_canonical().is_loopback();
    }
    if let Ok(ip) = addr.parse::<IpAddr>() {
        return ip.to_canonical().is_loopback();
    }
    let host = match addr.rsplit_once(':') {
        Some((host, port)) if port.parse::<u16>().is_ok() => host,
        _ => addr,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    match host.parse::<IpAddr>() {
        Ok(ip) => ip.to_canonical().is_loopback(),
        Err(_) => host.eq_ignore_ascii_case("localhost"),
    }
}

impl ServerSettings {
    pub fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms)
    }
}

impl KafkaSettings {
    pub fn publish_timeout(&self) -> Duration {
        Duration::from_millis(self.publish_timeout_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("config")
    }

    #[test]
    fn default_file_loads_and_validates() {
        let s = Settings::load_from(&config_dir(), "development").expect("default config loads");
        assert_eq!(s.server.addr, "127.0.0.1:8080");
        assert_eq!(s.kafka.topic, "flash.reservations");
        assert_eq!(s.kafka.group_id, "flashsale-orders");
        assert_eq!(s.reconcile.pending_deadline_secs, 60);
        assert_eq!(s.orders.sweep_interval_secs, 5);
        assert!(s.consumer.enabled);
        assert!(
            s.telemetry.otlp_endpoint.is_empty(),
            "traces are off by default"
        );
    }

    /// Production's Kafka settings are the defaults (config/production.toml
    /// sets none of these): no broker quirk, the
    /// idempotent producer, no group watch. The test broker's workarounds come
    /// from config/test.toml alone, and only as a whole.
    #[test]
    fn the_test_brokers_workarounds_act_only_under_its_switch() {
        let none = || Some(config::Map::new());
        let s =
            Settings::load_with_vars(&config_dir(), "development", none()).expect("defaults load");
        assert_eq!(s.kafka.broker_quirks, BrokerQuirks::None);
        assert!(s.kafka.idempotent());
        assert!(!s.kafka.watches_for_ghost_members());
        let t = Settings::load_with_vars(&config_dir(), "test", none()).expect("test loads");
        assert_eq!(t.kafka.broker_quirks, BrokerQuirks::Tansu06);
        assert!(t.kafka.idempotence, "the setting itself stays on");
        assert!(!t.kafka.idempotent());
        assert!(t.kafka.watches_for_ghost_members());
        let get = |s: &Settings, key: &str| {
            crate::kafka::producer_config(&s.kafka)
                .get(key)
                .map(str::to_owned)
        };
        assert_eq!(get(&s, "enable.idempotence").as_deref(), Some("true"));
        assert_eq!(get(&t, "enable.idempotence").as_deref(), Some("false"));
        let off = config::Map::from([(
            "FLASHSALE__KAFKA__IDEMPOTENCE".to_owned(),
            "false".to_owned(),
        )]);
        let err = Settings::load_with_vars(&config_dir(), "development", Some(off))
            .expect_err("idempotence off against a broker that has it is refused");
        assert!(format!("{err:#}").contains("broker_quirks"), "{err:#}");
        let vars = config::Map::from([(
            "FLASHSALE__KAFKA__BROKER_QUIRKS".to_owned(),
            "redpanda".to_owned(),
        )]);
        let err = Settings::load_with_vars(&config_dir(), "development", Some(vars))
            .expect_err("an unknown broker is refused");
        assert!(format!("{err:#}").contains("broker_quirks"), "{err:#}");
    }

    #[test]
    fn trusted_proxies_come_as_a_comma_separated_list() {
        // Given as a map, not set in the process's environment: the other tests
        // load the defaults at the same time, and trusted proxies refuse the
        // development secrets.
        let vars = config::Map::from([(
            "FLASHSALE__SERVER__TRUSTED_PROXIES".to_owned(),
            "10.0.0.0/8,127.0.0.1".to_owned(),
        )]);
        let s = Settings::load_with_vars(&config_dir(), "development", Some(vars))
            .expect("config loads");
        assert_eq!(
            s.server.trusted_proxies,
            TrustedProxies::parse(&["10.0.0.0/8", "127.0.0.1"]).expect("parses")
        );
    }

    #[test]
    fn operators_come_as_tables_or_as_name_token_pairs() {
        let dir = tempfile_dir("operators");
        std::fs::copy(config_dir().join("default.toml"), dir.join("default.toml"))
            .expect("default.toml copied");
        std::fs::write(
            dir.join("staging.toml"),
            "[[auth.operators]]\nname = \"alice\"\ntoken = \"Alice-token-0123456789\"\n\n\
             [[auth.operators]]\nname = \"bob\"\ntoken = \"Bob-token-0123456789ab\"\n",
        )
        .expect("staging.toml written");
        let s = Settings::load_from(&dir, "staging").expect("tables load");
        let names: Vec<&str> = s.auth.operators.0.iter().map(|o| o.name.as_str()).collect();
        assert_eq!(names, ["alice", "bob"]);
        assert_eq!(
            s.auth.operators.0[1].token.expose_secret(),
            "Bob-token-0123456789ab"
        );
        // A duplicate stops the load, naming the entry.
        std::fs::write(
            dir.join("staging.toml"),
            "[[auth.operators]]\nname = \"alice\"\ntoken = \"Alice-token-0123456789\"\n\n\
             [[auth.operators]]\nname = \"alice\"\ntoken = \"Bob-token-0123456789ab\"\n",
        )
        .expect("staging.toml written");
        let err = Settings::load_from(&dir, "staging").expect_err("duplicate refused");
        assert!(format!("{err:#}").contains("appears twice"), "{err:#}");
        std::fs::remove_dir_all(&dir).expect("folder removed");
        // The default: none.
        let s = Settings::load_from(&config_dir(), "development").expect("default config loads");
        assert!(s.auth.operators.is_empty());
    }

    /// A folder of this test's own under the system's temporary folder.
    fn tempfile_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "flashsale-config-{name}-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir).expect("folder created");
        dir
    }

    #[test]
    fn min_replicas_acked_is_auto_unless_a_number_is_given() {
        let s = Settings::load_from(&config_dir(), "development").expect("default config loads");
        assert_eq!(s.redis.min_replicas_acked, ReplicasAcked::Auto);
        for (text, expected) in [
            ("0", Some(ReplicasAcked::Exactly(0))),
            ("2", Some(ReplicasAcked::Exactly(2))),
            ("AUTO", Some(ReplicasAcked::Auto)),
            ("some", None),
            ("-1", None),
        ] {
            let vars = config::Map::from([(
                "FLASHSALE__REDIS__MIN_REPLICAS_ACKED".to_owned(),
                text.to_owned(),
            )]);
            let loaded = Settings::load_with_vars(&config_dir(), "development", Some(vars));
            match expected {
                Some(v) => assert_eq!(loaded.expect("config loads").redis.min_replicas_acked, v),
                None => {
                    let err = loaded.expect_err("refused");
                    assert!(format!("{err:#}").contains("min_replicas_acked"), "{err:#}");
                }
            }
        }
    }

    #[test]
    fn operators_as_an_environment_variable() {
        let vars = config::Map::from([(
            "FLASHSALE__AUTH__OPERATORS".to_owned(),
            "carol:Carol-token-0123456789,dave:Dave-token-0123456789x".to_owned(),
        )]);
        let s = Settings::load_with_vars(&config_dir(), "development", Some(vars))
            .expect("config loads");
        let names: Vec<&str> = s.auth.operators.0.iter().map(|o| o.name.as_str()).collect();
        assert_eq!(names, ["carol", "dave"]);
        let vars = config::Map::from([(
            "FLASHSALE__AUTH__OPERATORS".to_owned(),
            "carol:short".to_owned(),
        )]);
        let err = Settings::load_with_vars(&config_dir(), "development", Some(vars))
            .expect_err("a short token is refused");
        assert!(format!("{err:#}").contains("16 to 256"), "{err:#}");
    }

    #[test]
    fn production_refuses_unverified_payments_unless_allowed() {
        let mut s =
            Settings::load_from(&config_dir(), "development").expect("default config loads");
        assert_eq!(s.payments.provider, PaymentProvider::None);
        assert!(!s.payments.allow_unverified, "the default refuses");
        let err = s
            .check_payments("production")
            .expect_err("refused in production");
        assert!(
            err.to_string()
                .contains("FLASHSALE__PAYMENTS__ALLOW_UNVERIFIED"),
            "{err}"
        );
        assert!(s.check_payments("test").is_ok());
        assert!(s.check_payments("development").is_ok());
        s.payments.allow_unverified = true;
        assert!(s.check_payments("production").is_ok());
    }

    #[test]
    fn production_refuses_development_secrets() {
        let s = Settings::load_from(&config_dir(), "development").expect("default config loads");
        assert!(s.check_published_secrets("development").is_ok());
        let err = s
            .check_published_secrets("production")
            .expect_err("dev secrets refused");
        assert!(err.to_string().contains("admin_token"));
        let mut s = s;
        s.auth.admin_token = SecretString::from("a-real-production-admin-token");
        let err = s
            .check_published_secrets("production")
            .expect_err("dev user secret refused");
        assert!(err.to_string().contains("user_token_secret"));
        assert!(!err.to_string().contains("admin_token"));
        s.auth.user_token_secret = SecretString::from("a-real-production-user-secret");
        assert!(s.check_published_secrets("production").is_ok());
    }

    #[test]
    fn an_identity_provider_needs_issuer_and_audience_off_loopback() {
        let mut s = Settings::load_from(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config"),
            "development",
        )
        .expect("config");
        s.auth.jwks_url = Some("https://idp.example/jwks.json".into());
        s.server.addr = "0.0.0.0:8080".into();
        for (issuer, audience) in [
            (None, None),
            (Some("https://idp.example"), None),
            (None, Some("flashsale")),
        ] {
            s.auth.issuer = issuer.map(str::to_owned);
            s.auth.audience = audience.map(str::to_owned);
            let err = s
                .check_identity_provider()
                .expect_err("refused off loopback");
            assert!(
                err.to_string().contains("auth.issuer and auth.audience"),
                "{err}"
            );
        }
        s.server.addr = "127.0.0.1:8080".into();
        s.check_identity_provider().expect("a warning on loopback");
        s.server.addr = "0.0.0.0:8080".into();
        s.auth.issuer = Some("https://idp.example".into());
        s.auth.audience = Some("flashsale".into());
        s.check_identity_provider().expect("both set");
    }

    #[test]
    fn leeway_and_jwks_timeout_are_bounded() {
        let mut s = Settings::load_from(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config"),
            "development",
        )
        .expect("config");
        s.validate().expect("valid");
        s.auth.leeway_secs = 301;
        assert!(s
            .validate()
            .expect_err("leeway")
            .to_string()
            .contains("auth.leeway_secs"));
        s.auth.leeway_secs = u64::MAX;
        assert!(s.validate().is_err());
        s.auth.leeway_secs = 300;
        s.validate().expect("300 is allowed");
        s.auth.jwks_url = Some("https://idp.example/jwks.json".into());
        s.auth.jwks_timeout_ms = s.server.request_timeout_ms;
        assert!(s
            .validate()
            .expect_err("jwks timeout")
            .to_string()
            .contains("auth.jwks_timeout_ms"));
        s.auth.jwks_timeout_ms = s.server.request_timeout_ms - 1;
        s.validate().expect("shorter than a request");
    }

    #[test]
    fn development_secrets_are_refused_off_loopback_in_any_environment() {
        let dev = Settings::load_from(&config_dir(), "development").expect("default config loads");
        for (addr, allowed) in [
            ("0.0.0.0:8080", false),
            ("[::]:8080", false),
            ("192.168.1.20:8080", false),
            ("10.0.0.7:8080", false),
            ("flashsale.internal:8080", false),
            ("127.0.0.1:8080", true),
            ("127.0.0.1:0", true),
            ("[::1]:8080", true),
            ("[::ffff:127.0.0.1]:8080", true),
            ("localhost:8080", true),
            ("LOCALHOST:8080", true),
        ] {
            let mut s = dev.clone();
            s.server.addr = addr.to_owned();
            for env in ["development", "test", "staging"] {
                let checked = s.check_published_secrets(env);
                assert_eq!(checked.is_ok(), allowed, "{addr} in {env}: {checked:?}");
                if let Err(err) = checked {
                    let text = err.to_string();
                    assert!(text.contains("loopback") && text.contains(addr), "{text}");
                }
            }
            // Production refuses them on loopback too.
            assert!(s.check_published_secrets("production").is_err(), "{addr}");
            // Secrets of one's own are fine anywhere.
            s.auth.admin_token = SecretString::from("an-operator-chosen-admin-token");
            s.auth.user_token_secret = SecretString::from("an-operator-chosen-user-secret");
            assert!(s.check_published_secrets("development").is_ok(), "{addr}");
            assert!(s.check_published_secrets("production").is_ok(), "{addr}");
        }
        // One published secret is enough to refuse.
        let mut s = dev.clone();
        s.server.addr = "0.0.0.0:8080".into();
        s.auth.admin_token = SecretString::from("an-operator-chosen-admin-token");
        let err = s
            .check_published_secrets("development")
            .expect_err("refused");
        assert!(err.to_string().contains("user_token_secret"), "{err}");
        // The operations listener serves no authenticated endpoint: it does not
        // open the way for the published secrets, nor does it close it.
        let mut s = dev.clone();
        s.server.ops_addr = Some("0.0.0.0:9090".into());
        assert!(s.check_published_secrets("development").is_ok());
    }

    #[test]
    fn development_secrets_are_refused_behind_trusted_proxies() {
        let dev = Settings::load_from(&config_dir(), "development").expect("default config loads");
        assert!(dev.server.trusted_proxies.is_empty());
        assert!(dev.check_published_secrets("development").is_ok());
        // On loopback, in any environment: a proxy brings other machines' requests.
        for proxies in [&["127.0.0.1"][..], &["10.0.0.0/8", "::1"][..]] {
            let mut s = dev.clone();
            s.server.trusted_proxies = TrustedProxies::parse(proxies).expect("parses");
            for env in ["development", "test", "staging"] {
                let err = s
                    .check_published_secrets(env)
                    .expect_err("refused behind a proxy");
                let text = err.to_string();
                assert!(
                    text.contains("server.trusted_proxies") && text.contains("admin_token"),
                    "{text}"
                );
            }
            // Secrets of one's own are fine behind proxies.
            s.auth.admin_token = SecretString::from("an-operator-chosen-admin-token");
            s.auth.user_token_secret = SecretString::from("an-operator-chosen-user-secret");
            assert!(s.check_published_secrets("development").is_ok());
        }
    }

    #[test]
    fn each_refusal_names_its_condition() {
        let dev = Settings::load_from(&config_dir(), "development").expect("default config loads");
        // Production, on loopback without proxies.
        let err = dev
            .check_published_secrets("production")
            .expect_err("refused in production");
        assert!(
            err.to_string().contains("FLASHSALE_ENV=production"),
            "{err}"
        );
        // A public address.
        let mut s = dev.clone();
        s.server.addr = "0.0.0.0:8080".into();
        let err = s
            .check_published_secrets("development")
            .expect_err("refused");
        assert!(
            err.to_string().contains("server.addr 0.0.0.0:8080"),
            "{err}"
        );
        // Trusted proxies, on loopback.
        let mut s = dev.clone();
        s.server.trusted_proxies = TrustedProxies::parse(&["10.0.0.0/8"]).expect("parses");
        let err = s
            .check_published_secrets("development")
            .expect_err("refused");
        let text = err.to_string();
        assert!(
            text.contains("server.trusted_proxies is set (10.0.0.0/8)")
                && !text.contains("loopback address"),
            "{text}"
        );
    }

    #[test]
    fn loopback_addresses() {
        for yes in [
            "127.0.0.1:1",
            "127.1.2.3:80",
            "[::1]:1",
            "::1",
            "127.0.0.1",
            "localhost",
            "localhost:9",
        ] {
            assert!(is_loopback(yes), "{yes}");
        }
        for no in [
            "0.0.0.0:1",
            "[::]:1",
            "::",
            "0.0.0.0",
            "192.168.0.1:80",
            "[fe80::1]:80",
            "example.com:80",
            "",
        ] {
            assert!(!is_loopback(no), "{no}");
        }
    }

    #[test]
    fn identity_provider_settings() {
        let dev = Settings::load_from(&config_dir(), "development").expect("default config loads");
        assert!(dev.auth.hs256);
        assert_eq!(dev.auth.leeway_secs, 30);
        assert!(!dev.auth.has_identity_provider());
        // HS256 off needs an identity provider.
        let mut s = dev.clone();
        s.auth.hs256 = false;
        let err = s.validate().expect_err("no way to verify a user");
        assert!(err.to_string().contains("auth.jwks_url"), "{err}");
        s.auth.jwks_url =
            Some("https://idp.example.com/realms/shop/protocol/openid-connect/certs".into());
        s.validate().expect("an https JWKS is fine");
        // With HS256 off, the published secret verifies nothing: not refused.
        s.server.addr = "0.0.0.0:8080".into();
        s.auth.admin_token = SecretString::from("an-operator-chosen-admin-token");
        assert!(s.check_published_secrets("production").is_ok());
        // Keys in clear text only from this machine.
        for (url, ok) in [
            ("http://127.0.0.1:8081/jwks.json", true),
            ("http://localhost/jwks.json", true),
            ("http://idp.example.com/jwks.json", false),
            ("ftp://idp.example.com/jwks.json", false),
            ("not a url", false),
        ] {
            s.auth.jwks_url = Some(url.into());
            assert_eq!(s.validate().is_ok(), ok, "{url}");
        }
        let mut s = dev.clone();
        s.auth.issuer = Some(" ".into());
        assert!(s.validate().is_err());
        let mut s = dev.clone();
        s.auth.jwks_min_refresh_secs = 0;
        assert!(s.validate().is_err());
    }

    #[test]
    fn secrets_are_not_in_debug_output() {
        let s = Settings::load_from(&config_dir(), "development").expect("default config loads");
        let text = format!("{s:?}");
        assert!(!text.contains(DEV_ADMIN_TOKEN));
        assert!(!text.contains(DEV_USER_TOKEN_SECRET));
    }
}
