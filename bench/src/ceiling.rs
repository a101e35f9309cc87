//! The ceilings of the service's two hops, measured without HTTP in front.
//!
//! **Redis**: `redis-benchmark` driving the service's own reserve script. The script (`src/stock/reserve.lua`) is loaded with SCRIPT LOAD and called with
//! EVALSHA on a sale with stock to spare, every call for a random user
//! (`__rand_int__`), so nearly every call takes the full path: check the buyer,
//! decrement, record the buyer and the pending reservation. That is the most the
//! hot SKU's single Redis can do for the reserve step, with nothing in front of it.
//!
//! **Broker**: the service's own `Publisher` (`acks=all`, every publish
//! awaits its acknowledgement), with as many publishes in flight as the load test
//! has connections. The service answers `202` only after this acknowledgement, so
//! at a fixed concurrency its reserve path can go no faster than this.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use flashsale::config::KafkaSettings;
use flashsale::kafka::{self, Publisher, ReservationMessage};
use flashsale::stock::Keys;
use redis::aio::MultiplexedConnection;
use serde::{Deserialize, Serialize};
use tokio::process::Command;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RedisCeiling {
    pub clients: u32,
    pub pipeline: u32,
    pub requests: u64,
    pub rps: f64,
    pub avg_ms: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// Reservations the script recorded: proves the calls did the real work.
    pub reserved: i64,
    /// Redis's commands (those the script runs included) and CPU microseconds
    /// per call, from `INFO` before and after: the floor of a reserve's cost.
    #[serde(default)]
    pub commands_per_call: Option<f64>,
    #[serde(default)]
    pub redis_cpu_us_per_call: Option<f64>,
}

/// What the broker acknowledged with `in_flight` publishes outstanding.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct BrokerCeiling {
    pub in_flight: usize,
    pub seconds: f64,
    pub acknowledged: u64,
    pub failed: u64,
    pub rps: f64,
    pub latency: crate::loadgen::Latency,
    /// CPU of the broker and the publisher meanwhile (filled in by the suite).
    pub cpu: Option<crate::machine::CpuWindow>,
}

/// Publishes reservation messages to a topic of its own for `duration`, with
/// `in_flight` publishes outstanding at all times.
pub async fn broker_publish(
    kafka: &KafkaSettings,
    in_flight: usize,
    duration: Duration,
) -> anyhow::Result<BrokerCeiling> {
    let mut kafka = kafka.clone();
    let id = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
    kafka.topic = format!("flash.bench.ceiling.{id}");
    kafka::ensure_topics(&kafka, &[kafka.topic.as_str()])
        .await
        .context("failed to create the ceiling's topic")?;
    let publisher = Publisher::new(&kafka)?;
    // The first publish fetches the topic's metadata: keep it out of the figures.
    publisher
        .publish(&ceiling_message(&id, 0)?)
        .await
        .context("the broker did not acknowledge a first message")?;

    let next = Arc::new(std::sync::atomic::AtomicU64::new(1));
    let started = Instant::now();
    let deadline = started + duration;
    let mut tasks = Vec::with_capacity(in_flight);
    for _ in 0..in_flight {
        let publisher = publisher.clone();
        let next = next.clone();
        let id = id.clone();
        tasks.push(tokio::spawn(async move {
            let mut hist = crate::loadgen::new_histogram()?;
            let mut failed = 0u64;
            while Instant::now() < deadline {
                let n = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let msg = ceiling_message(&id, n)?;
                let t = Instant::now();
                match publisher.publish(&msg).await {
                    Ok(()) => {
                        let us = u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX);
                        hist.saturating_record(us.max(1));
                    }
                    Err(_) => failed += 1,
                }
            }
            anyhow::Ok((hist, failed))
        }));
    }
    let mut hist = crate::loadgen::new_histogram()?;
    let mut failed = 0;
    for t in tasks {
        let (h, f) = t.await.context("a publishing task failed")??;
        hist.add(&h).context("histograms differ in bounds")?;
        failed += f;
    }
    let seconds = started.elapsed().as_secs_f64();
    let flusher = publisher.clone();
    tokio::task::spawn_blocking(move || flusher.flush(Duration::from_secs(5)))
        .await
        .context("flush task failed")?;
    Ok(BrokerCeiling {
        in_flight,
        seconds,
        acknowledged: hist.len(),
        failed,
        rps: hist.len() as f64 / seconds,
        latency: crate::loadgen::Latency::of(&hist),
        cpu: None,
    })
}

/// One message like the service's. Built from JSON, so a field the service adds
/// with a default does not break this benchmark's build.
fn ceiling_message(id: &str, n: u64) -> anyhow::Result<ReservationMessage> {
    serde_json::from_value(serde_json::json!({
        "reservation_id": format!("{id}-{n}"),
        "activity_id": format!("ceiling-{id}"),
        "sku": "ceiling",
        "user_id": format!("u{n}"),
        "quantity": 1,
        "reserved_at": chrono::Utc::now(),
    }))
    .context("ReservationMessage changed shape")
}

/// `host`, `port` of a `redis://[user:pass@]host[:port][/db]` URL.
pub fn host_port(url: &str) -> (String, u16) {
    let rest = url
        .trim()
        .strip_prefix("redis://")
        .unwrap_or(url)
        .split('/')
        .next()
        .unwrap_or("");
    let hostport = rest.rsplit_once('@').map_or(rest, |(_, h)| h);
    match hostport.rsplit_once(':') {
        Some((h, p)) => (h.to_owned(), p.parse().unwrap_or(6379)),
        None if !hostport.is_empty() => (hostport.to_owned(), 6379),
        None => ("127.0.0.1".to_owned(), 6379),
    }
}

/// Runs `redis-benchmark` with `clients` connections and `pipeline` commands in
/// flight on each, `requests` calls in all.
pub async fn redis_evalsha(
    redis_url: &str,
    script_path: &Path,
    clients: u32,
    pipeline: u32,
    requests: u64,
) -> anyhow::Result<RedisCeiling> {
    let script = std::fs::read_to_string(script_path)
        .with_context(|| format!("failed to read {}", script_path.display()))?;
    let client = redis::Client::open(redis_url).context("invalid redis url")?;
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .context("failed to connect to Redis")?;
    let sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(&script)
        .query_async(&mut conn)
        .await
        .context("SCRIPT LOAD failed")?;
    let k = ceiling_sale(&mut conn).await?;
    let (host, port) = host_port(redis_url);
    let before = crate::redis_info::counters(redis_url).await.ok();
    let output = Command::new("redis-benchmark")
        .args(["-h", &host, "-p", &port.to_string()])
        .args(["-c", &clients.to_string()])
        .args(["-P", &pipeline.to_string()])
        .args(["-n", &requests.to_string()])
        .args(["-r", "1000000000", "--csv"])
        // The reserve script's KEYS and ARGV, in the order StockStore::reserve sends them.
        .args(["EVALSHA", &sha])
        .arg(k.reserve_script_keys().len().to_string())
        .args(k.reserve_script_keys())
        .args(["u__rand_int__", "1", "r__rand_int__", "1700000000000"])
        .output()
        .await
        .context("failed to run redis-benchmark (is it installed? it comes with redis)")?;
    let after = crate::redis_info::counters(redis_url).await.ok();
    let reserved = remove_ceiling_sale(&mut conn, &k).await;
    if !output.status.success() {
        bail!(
            "redis-benchmark failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let (rps, avg_ms, p50_ms, p99_ms) = parse_csv(&stdout)
        .with_context(|| format!("unexpected redis-benchmark output: {stdout}"))?;
    if reserved == 0 {
        bail!("the reserve script reserved nothing: its keys or arguments no longer match src/stock/reserve.lua");
    }
    Ok(RedisCeiling {
        clients,
        pipeline,
        requests,
        rps,
        avg_ms,
        p50_ms,
        p99_ms,
        reserved,
        commands_per_call: before
            .zip(after)
            .map(|(b, a)| a.commands.saturating_sub(b.commands) as f64 / requests.max(1) as f64),
        redis_cpu_us_per_call: before
            .zip(after)
            .map(|(b, a)| (a.cpu_s - b.cpu_s) * 1e6 / requests.max(1) as f64),
    })
}

/// A sale of its own, loaded the way preload.lua leaves one: stock and state set.
async fn ceiling_sale(conn: &mut MultiplexedConnection) -> anyhow::Result<Keys> {
    let activity = format!(
        "benchceil{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let k = Keys::new(&activity);
    let _: () = redis::pipe()
        .set(&k.stock, 1_000_000_000_i64)
        .ignore()
        .set(&k.state, "open")
        .ignore()
        .query_async(conn)
        .await
        .context("failed to set up the ceiling's sale")?;
    Ok(k)
}

/// Removes the ceiling's sale; returns how many buyers the script recorded in it
/// (0 when Redis cannot say).
async fn remove_ceiling_sale(conn: &mut MultiplexedConnection, k: &Keys) -> i64 {
    let reserved: i64 = redis::cmd("HLEN")
        .arg(&k.buyers)
        .query_async(conn)
        .await
        .unwrap_or(0);
    let _: redis::RedisResult<i64> = redis::cmd("UNLINK")
        .arg(&[
            &k.stock,
            &k.buyers,
            &k.pending,
            &k.res,
            &k.state,
            &k.refunded,
        ])
        .query_async(conn)
        .await;
    reserved
}

/// (rps, avg, p50, p99) from `redis-benchmark --csv`:
/// `"test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms","p95_latency_ms","p99_latency_ms","max_latency_ms"`.
fn parse_csv(out: &str) -> Option<(f64, f64, f64, f64)> {
    let line = out
        .lines()
        .find(|l| l.starts_with('"') && !l.starts_with("\"test\""))?;
    let fields: Vec<&str> = line.trim().trim_matches('"').split("\",\"").collect();
    let n = fields.len();
    // The test name may itself contain anything; the seven numbers are the last ones.
    let num = |i: usize| fields.get(n.checked_sub(7)? + i)?.parse::<f64>().ok();
    Some((num(0)?, num(1)?, num(3)?, num(5)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_line() {
        let out = "\"test\",\"rps\",\"avg_latency_ms\",\"min_latency_ms\",\"p50_latency_ms\",\"p95_latency_ms\",\"p99_latency_ms\",\"max_latency_ms\"\n\"EVALSHA abc 5 a b\",\"24691.36\",\"0.253\",\"0.064\",\"0.239\",\"0.447\",\"0.647\",\"1.983\"\n";
        assert_eq!(parse_csv(out), Some((24691.36, 0.253, 0.239, 0.647)));
    }

    #[test]
    fn urls() {
        assert_eq!(
            host_port("redis://127.0.0.1:6379"),
            ("127.0.0.1".into(), 6379)
        );
        assert_eq!(host_port("redis://u:p@h:7000/0"), ("h".into(), 7000));
        assert_eq!(host_port("redis://h"), ("h".into(), 6379));
    }
}
