//! Logging (tracing) and metrics (Prometheus) set-up, each installed once per process.

use std::sync::Mutex;
use std::time::Instant;

use anyhow::Context;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tracing_subscriber::{fmt, prelude::*, EnvFilter};

use crate::config::{LogFormat, LogSettings};

/// Installs the global tracing subscriber. `RUST_LOG` wins over `log.filter`.
/// A second call (tests build many apps in one process) is a no-op.
pub fn init_tracing(settings: &LogSettings) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(&settings.filter));
    let registry = tracing_subscriber::registry().with(filter);
    let result = match settings.format {
        LogFormat::Json => registry
            .with(
                fmt::layer()
                    .json()
                    .with_current_span(true)
                    .with_span_list(false),
            )
            .try_init(),
        LogFormat::Text => registry.with(fmt::layer()).try_init(),
    };
    // Err only means a subscriber is already installed, which is fine.
    let _ = result;
}

/// When `/metrics` last read the activities' figures from Redis. Scrapes queue
/// on the lock, so a flood of them makes one read, not one each.
pub struct LiveFigures {
    /// The last read; `/metrics` holds the lock while it reads.
    pub read_at: tokio::sync::Mutex<Option<Instant>>,
    /// When this instance started.
    pub started: Instant,
}

impl LiveFigures {
    /// Figures of an instance starting now.
    pub fn new() -> Self {
        LiveFigures {
            read_at: tokio::sync::Mutex::new(None),
            started: Instant::now(),
        }
    }
}

impl Default for LiveFigures {
    fn default() -> Self {
        Self::new()
    }
}

static PROMETHEUS: Mutex<Option<PrometheusHandle>> = Mutex::new(None);

/// Latency buckets in seconds, fine-grained below 10 ms where the reserve path lives.
const LATENCY_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

/// Installs the Prometheus recorder once per process and returns its handle.
/// Tests build several apps in one process; they share the one recorder.
pub fn metrics_handle() -> anyhow::Result<PrometheusHandle> {
    // A poisoned lock only means another thread panicked mid-install; the Option
    // inside is still either fully set or empty.
    let mut slot = PROMETHEUS.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(handle) = slot.as_ref() {
        return Ok(handle.clone());
    }
    let recorder = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
        .context("invalid histogram buckets")?
        .build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder)
        .map_err(|_| anyhow::anyhow!("another metrics recorder is already installed"))?;
    describe_metrics();
    metrics::gauge!("flashsale_build_info", "version" => env!("CARGO_PKG_VERSION")).set(1.0);
    register_alerted_counters();
    *slot = Some(handle.clone());
    Ok(handle)
}

/// The counters the alert rules (`deploy/prometheus/alerts.yml`) watch, at 0 from
/// the start. Prometheus sees an increase only between two samples: a counter
/// whose series first appears at 1, with its first incident, would never fire
/// `increase(…) > 0`. The rules' gauges come from their own sources: the
/// per-activity figures and `redis_up` from the scrape itself, the lag and the
/// drift from the reconciler's first pass, which a scrape after a start waits for.
fn register_alerted_counters() {
    metrics::counter!("flashsale_promises_broken_total").increment(0);
    metrics::counter!("flashsale_consumer_dead_letters_total").increment(0);
    for sent in ["no", "unknown"] {
        metrics::counter!("flashsale_kafka_publish_failures_total", "sent" => sent).increment(0);
    }
}

/// A scrape: this process's figures read now, then every metric in the
/// Prometheus text format (`/metrics` of `serve` and of `consume`).
pub fn prometheus_text(
    handle: &PrometheusHandle,
) -> ([(axum::http::HeaderName, &'static str); 1], String) {
    record_process_metrics();
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        handle.render(),
    )
}

/// HELP text of every metric the service records (`# HELP` in `/metrics`).
const METRICS: &[(Kind, &str, &str)] = &[
    (Kind::Gauge, "flashsale_build_info", "Always 1; the version label names the running build."),
    (Kind::Counter, "flashsale_http_requests_total", "HTTP requests answered, by method, route and status."),
    (Kind::Histogram, "flashsale_http_request_duration_seconds", "Time to answer an HTTP request, by method and route."),
    (Kind::Counter, "flashsale_http_requests_shed_total", "Requests answered 503 because the instance was at its concurrency limit."),
    (Kind::Counter, "flashsale_rate_limited_total", "Requests answered 429 by a per-IP or per-user token bucket."),
    (Kind::Counter, "flashsale_jwks_refreshes_total", "Fetches of the identity provider's JWKS, by trigger (scheduled, unknown_kid) and outcome (ok; unreachable or invalid, the keys in hand kept)."),
    (Kind::Counter, "flashsale_jwks_unknown_kid_total", "Tokens naming a kid the key set lacked; fetched=yes when they fetched the JWKS again, no when a fetch for an unknown kid had just been made."),
    (Kind::Gauge, "flashsale_jwks_keys", "Signing keys in the identity provider's JWKS as last fetched."),
    (Kind::Gauge, "flashsale_jwks_last_success_timestamp_seconds", "When the identity provider's JWKS was last fetched whole, in seconds since the Unix epoch."),
    (Kind::Counter, "flashsale_audit_write_failures_total", "Admin actions whose audit entry could not be written to MySQL (the action stands; the entry is in the error log)."),
    (Kind::Counter, "flashsale_reservations_total", "Reservation attempts by outcome: reserved, or the error code answered."),
    (Kind::Histogram, "flashsale_kafka_publish_duration_seconds", "Time for the broker to acknowledge a reservation message."),
    (Kind::Counter, "flashsale_kafka_publish_failures_total", "Reservation publishes that failed; sent=no were never sent (units returned), sent=unknown were withdrawn through MySQL."),
    (Kind::Counter, "flashsale_kafka_producer_replaced_total", "Kafka producers rebuilt after a fatal producer error."),
    (Kind::Counter, "flashsale_redis_replica_ack_failures_total", "Reservations refused because Redis replicas did not acknowledge them in time (redis.min_replicas_acked)."),
    (Kind::Counter, "flashsale_redis_script_eval_fallbacks_total", "Lua scripts sent whole with EVAL because the Redis node did not hold them (restarted, failed over or flushed)."),
    (Kind::Counter, "flashsale_redis_reconnects_total", "Redis Cluster or Sentinel connections rebuilt because a call said the topology moved (a failover)."),
    (Kind::Counter, "flashsale_redis_lost_reservations_total", "Orders whose reservation Redis had lost, adopted back into Redis by the consumer."),
    (Kind::Counter, "flashsale_redis_stale_state_total", "Reconciler passes that found Redis holding an older build of an activity than MySQL (a failover that lost writes)."),
    (Kind::Counter, "flashsale_redis_stock_lowered_total", "Units Redis's stock was lowered by because MySQL refused a reservation for lack of units."),
    (Kind::Counter, "flashsale_promises_broken_total", "Reservations answered 202 that ended failed because MySQL had no units: incidents."),
    (Kind::Counter, "flashsale_units_returned_total", "Units returned to Redis's stock, by reason."),
    (Kind::Counter, "flashsale_reservations_withdrawn_total", "Reservations withdrawn before they reached an order (their publish failed or timed out)."),
    (Kind::Counter, "flashsale_orders_created_total", "Orders written to MySQL by the consumer."),
    (Kind::Counter, "flashsale_orders_paid_total", "Orders paid."),
    (Kind::Counter, "flashsale_orders_failed_total", "Reservation messages MySQL refused (no units, or a withdrawn reservation lost to its order)."),
    (Kind::Counter, "flashsale_orders_cancelled_total", "Unpaid orders cancelled past their payment deadline."),
    (Kind::Counter, "flashsale_orders_duplicate_deliveries_total", "Reservation messages delivered again and found already decided."),
    (Kind::Counter, "flashsale_consumer_transient_errors_total", "MySQL or Redis errors the consumer retried."),
    (Kind::Counter, "flashsale_consumer_dead_letters_total", "Reservation messages sent to the dead-letter topic."),
    (Kind::Gauge, "flashsale_consumer_assigned_partitions", "Partitions of the reservation topic assigned to this instance's consumer."),
    (Kind::Counter, "flashsale_consumer_rejoins_total", "Times this instance's consumer left and rejoined its group because a partition it did not hold had messages nobody committed."),
    (Kind::Gauge, "flashsale_consumer_lag_messages", "Messages of the reservation topic the consumer group has not committed, as the reconciler last measured."),
    (Kind::Counter, "flashsale_reconcile_runs_total", "Reconciler passes over an activity."),
    (Kind::Counter, "flashsale_reconcile_drift_found_total", "Reconciler passes that found Redis's stock differing from what MySQL implies."),
    (Kind::Counter, "flashsale_reconcile_drift_repaired_total", "Drifts the reconciler repaired."),
    (Kind::Counter, "flashsale_reconcile_honoured_reservations_total", "Acknowledged reservations past the deadline the reconciler turned into orders."),
    (Kind::Counter, "flashsale_reconcile_withdrawn_reservations_total", "Unacknowledged reservations past the deadline the reconciler withdrew."),
    (Kind::Counter, "flashsale_activity_rebuilt_total", "Activities rebuilt in Redis from MySQL after a loss."),
    (Kind::Counter, "flashsale_activity_auto_paused_total", "Activities paused by the service itself because Redis lost them."),
    (Kind::Counter, "flashsale_sold_out_gate_answers_total", "Reservations answered sold_out from this instance's memory, without a Redis call."),
    (Kind::Counter, "flashsale_stock_shard_transfers_total", "Units lent between an activity's stock shards (a dry home shard borrowing)."),
    (Kind::Counter, "flashsale_stock_shard_transfers_finished_total", "Transfers between stock shards the reconciler finished for a borrower that died."),
    (Kind::Gauge, "flashsale_activity_units_left", "Units Redis may still hand out, per current activity (summed over its shards)."),
    (Kind::Gauge, "flashsale_activity_available_mysql", "Units MySQL has not given to orders, per current activity."),
    (Kind::Gauge, "flashsale_activity_reservations_pending", "Reservations in Redis not yet decided in MySQL, per current activity."),
    (Kind::Gauge, "flashsale_activity_oldest_pending_age_seconds", "Age of the oldest reservation pending in Redis, per current activity (0 when none)."),
    (Kind::Gauge, "flashsale_activity_paused", "1 while the activity is paused in Redis, per current activity."),
    (Kind::Gauge, "flashsale_activity_drift_units", "Redis's stock minus what MySQL implies, as the reconciler last saw it, per activity."),
    (Kind::Counter, "flashsale_waiting_room_joins_total", "Users who joined a waiting room through this instance."),
    (Kind::Gauge, "flashsale_waiting_room_joined", "Users who joined the activity's waiting room, before and after its start."),
    (Kind::Gauge, "flashsale_waiting_room_waiting", "Users in line in the activity's waiting room (before the draw: everyone who joined)."),
    (Kind::Gauge, "flashsale_waiting_room_admitted", "Users of the activity's waiting room holding a turn to reserve now."),
    (Kind::Gauge, "flashsale_waiting_room_turns_given", "Turns the activity's waiting room has given."),
    (Kind::Gauge, "flashsale_waiting_room_turns_expired", "Turns of the activity's waiting room that ran out before their user reserved."),
    (Kind::Gauge, "flashsale_waiting_room_draw_seed", "The seed of the activity's waiting-room draw (-1 before the draw); with the arrival order it replays the draw."),
    (Kind::Gauge, "flashsale_waiting_room_closed", "1 once no unit of the activity can come back and everyone still waiting was told sold_out."),
    (Kind::Gauge, "flashsale_redis_up", "1 when this instance's last look at Redis answered."),
    (Kind::Counter, "flashsale_process_cpu_seconds_total", "CPU time this process used, user and system."),
    (Kind::Gauge, "flashsale_process_resident_memory_bytes", "Resident memory of this process."),
    (Kind::Gauge, "flashsale_process_open_fds", "File descriptors this process holds open."),
    (Kind::Gauge, "flashsale_process_start_time_seconds", "When this process started, in seconds since the Unix epoch."),
];

#[derive(Clone, Copy)]
enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// The name of every metric the service records.
pub fn metric_names() -> impl Iterator<Item = &'static str> {
    METRICS.iter().map(|(_, name, _)| *name)
}

fn describe_metrics() {
    for (kind, name, help) in METRICS {
        match kind {
            Kind::Counter => metrics::describe_counter!(*name, *help),
            Kind::Gauge => metrics::describe_gauge!(*name, *help),
            Kind::Histogram => metrics::describe_histogram!(*name, *help),
        }
    }
}

/// Reads this process's CPU time, memory, open files and start time from
/// `/proc` (Linux) into the `flashsale_process_*` metrics; elsewhere it does
/// nothing. Called before each scrape is rendered.
fn record_process_metrics() {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return;
    };
    // Fields after the command name (which may hold spaces) start after ')'.
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok());
    // Linux counts CPU time and start time in ticks of 1/100 s (USER_HZ).
    const TICKS: f64 = 100.0;
    if let (Some(utime), Some(stime)) = (field(11), field(12)) {
        metrics::counter!("flashsale_process_cpu_seconds_total")
            .absolute(((utime + stime) / TICKS) as u64);
    }
    let rss_kb = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        });
    if let Some(kb) = rss_kb {
        metrics::gauge!("flashsale_process_resident_memory_bytes").set(kb * 1024.0);
    }
    if let (Some(start_ticks), Ok(uptime)) = (field(19), std::fs::read_to_string("/proc/uptime")) {
        let since_boot: Option<f64> = uptime
            .split_whitespace()
            .next()
            .and_then(|v| v.parse().ok());
        if let Some(since_boot) = since_boot {
            let now = chrono::Utc::now().timestamp_millis() as f64 / 1000.0;
            metrics::gauge!("flashsale_process_start_time_seconds")
                .set(now - since_boot + start_ticks / TICKS);
        }
    }
    if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
        metrics::gauge!("flashsale_process_open_fds").set(fds.count() as f64);
    }
}

#[cfg(test)]
mod tests {
    /// Every metric recorded anywhere in `src/` has its HELP text here.
    #[test]
    fn every_recorded_metric_is_described() {
        let known: Vec<&str> = super::metric_names().collect();
        let mut dirs = vec![std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src")];
        let mut missing = Vec::new();
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).expect("src is readable").flatten() {
                let path = entry.path();
                if path.is_dir() {
                    dirs.push(path);
                    continue;
                }
                if path.extension().and_then(|e| e.to_str()) != Some("rs") {
                    continue;
                }
                let text = std::fs::read_to_string(&path).expect("a source file");
                for macro_name in ["counter!(", "gauge!(", "histogram!("] {
                    for (at, _) in text.match_indices(macro_name) {
                        let tail = text[at + macro_name.len()..].trim_start();
                        let Some(tail) = tail.strip_prefix('"') else {
                            continue;
                        };
                        let name = tail.split('"').next().unwrap_or_default();
                        let is_name = !name.is_empty()
                            && name.bytes().all(|b| b.is_ascii_lowercase() || b == b'_');
                        if is_name && !known.contains(&name) {
                            missing.push(format!("{name} in {}", path.display()));
                        }
                    }
                }
            }
        }
        assert!(missing.is_empty(), "metrics without HELP: {missing:?}");
    }
}
