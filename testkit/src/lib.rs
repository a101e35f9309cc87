//! The one test kit of flashsale, in the spirit of crates.io's test-support crates:
//! every harness (the API tests, the fault suite, the benchmarks) starts processes,
//! opens sales, waits and checks the invariants through it, so a fix to any of
//! these lands once.
//!
//! - [`api`]: the service's endpoints, one method each, as a client calls them;
//! - [`database`]: a test's own MySQL database, dropped when the test is done;
//! - [`identity`]: an identity provider: test-only keys signing RS256/ES256
//!   tokens, and a JWKS endpoint a test can rotate, break or stop;
//! - [`process`]: real processes on loopback (the `flashsale` binary, its clock
//!   skewed if asked, and a Redis, replica, MariaDB or broker of a test's own),
//!   killable, pausable, restartable;
//! - [`relay`]: a TCP relay a test can cut or point elsewhere (an outage, a
//!   failover behind one address);
//! - [`rng`]: a seeded generator, so a random schedule replays from its seed;
//! - [`sale`]: creating and loading a sale through the admin API;
//! - [`invariants`]: waiting until a sale is quiet, then checking docs/DESIGN.md's
//!   invariants against MySQL, Redis and the answers the clients got;
//! - [`otlp`]: an OpenTelemetry trace receiver (OTLP/HTTP, JSON) that keeps
//!   the spans a service exports;
//! - [`stripe`]: a fake Stripe (Checkout Sessions with Stripe's own error
//!   answers, a switch to fail or stall, signed events);
//! - [`mock_kafka`]: librdkafka's mock cluster with its fault injection.

pub mod api;
pub mod availability;
pub mod browser;
pub mod database;
pub mod identity;
pub mod invariants;
pub mod mock_kafka;
pub mod otlp;
pub mod process;
pub mod redis_watch;
pub mod relay;
pub mod rng;
pub mod sale;
pub mod stats;
pub mod stripe;

use std::time::{Duration, Instant};

/// The Kafka-protocol broker the tests use when they start none of their own.
pub fn kafka_brokers() -> String {
    std::env::var("FLASHSALE_TEST_KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

/// A name no other test uses: databases, topics, groups, SKUs.
pub fn unique(prefix: &str) -> String {
    format!("{prefix}{}", uuid::Uuid::new_v4().simple())
}

/// Polls `check` every 50 ms until it gives a value; panics after `within`,
/// naming `what` it waited for.
pub async fn eventually<T, F, Fut>(within: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `eventually` for harnesses that report failures instead of panicking.
pub async fn within<T, F, Fut>(limit: Duration, what: &str, mut check: F) -> Result<T, String>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = check().await {
            return Ok(v);
        }
        if Instant::now() > deadline {
            return Err(format!("timed out after {limit:?} waiting for {what}"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
