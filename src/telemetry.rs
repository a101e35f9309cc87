//! Logs (tracing), traces (OpenTelemetry) and metrics (Prometheus) set-up, each
//! installed once per process.
//!
//! Traces are off unless an OTLP endpoint is configured (`telemetry.*`, or the
//! standard `OTEL_EXPORTER_OTLP_*` variables). Off, nothing below runs but one
//! atomic load per traced step: no exporter thread, no layer, no trace headers,
//! and the detail spans below the request are never made. On, the spans
//! `log.filter` enables are sent in batches
//! over OTLP/HTTP with JSON bodies, a reservation's trace context travels in its
//! Kafka message's headers (`crate::kafka::trace`), and the request span's
//! `trace_id` names its trace in every log line of the request.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use opentelemetry::trace::{TraceContextExt, TracerProvider};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracerProvider,
};
use opentelemetry_sdk::Resource;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::{fmt, prelude::*, EnvFilter};

use crate::config::{LogFormat, LogSettings, TelemetrySettings};

/// Whether this process exports traces: set once its subscriber holds the
/// OpenTelemetry layer.
static TRACES_ON: AtomicBool = AtomicBool::new(false);

/// Whether this process exports traces (and so carries trace context in the
/// messages it publishes). One atomic load: the check every traced step makes
/// before it does anything.
pub fn traces_enabled() -> bool {
    TRACES_ON.load(Ordering::Relaxed)
}

/// The process's tracing set-up; [`Telemetry::shutdown`] sends the spans still
/// waiting before the process exits.
#[must_use = "shut it down before exiting, or the last spans are lost"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Sends the spans still waiting and stops the exporter (no-op when traces
    /// are off).
    pub async fn shutdown(self) {
        let Some(provider) = self.provider else {
            return;
        };
        TRACES_ON.store(false, Ordering::Relaxed);
        // The exporter's client blocks: not on a runtime thread.
        match tokio::task::spawn_blocking(move || provider.shutdown()).await {
            Ok(Ok(())) => {}
            Ok(Err(err)) => {
                tracing::warn!(error = %err, "the last spans may not have been exported")
            }
            Err(err) => tracing::warn!(error = %err, "the trace exporter's shutdown task failed"),
        }
    }
}

/// Installs the global tracing subscriber: the logs (`RUST_LOG` wins over
/// `log.filter`) and, when an OTLP endpoint is configured, the trace exporter.
/// A second call (tests build many
/// apps in one process) installs nothing and exports nothing.
pub fn init_tracing(log: &LogSettings, telemetry: &TelemetrySettings) -> anyhow::Result<Telemetry> {
    // An exporter the service's own setting asks for must work; one that only
    // the platform's OTEL_* variables ask for never keeps the service from
    // starting: traces are then off, with a warning.
    let explicit = !telemetry.otlp_endpoint.trim().is_empty();
    let wanted = traces_url(telemetry, |k| std::env::var(k).ok()).and_then(|url| match url {
        Some(url) => tracer_provider(&url, telemetry).map(|p| Some((url, p))),
        None => Ok(None),
    });
    let (url, provider, unusable) = match wanted {
        Ok(Some((url, provider))) => (Some(url), Some(provider), None),
        Ok(None) => (None, None, None),
        Err(err) if !explicit => (None, None, Some(err)),
        Err(err) => return Err(err),
    };
    let mut logs_filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(&log.filter));
    if provider.is_some() {
        // A collector that is down would otherwise log an error for every
        // failed export; spans are dropped, never requests.
        if let Ok(quiet) = "opentelemetry_sdk=off".parse() {
            logs_filter = logs_filter.add_directive(quiet);
        }
    }
    // One filter for everything: the spans exported are those the logs' filter
    // enables. The detail spans below the request are made only while traces
    // are on (see `detail_span!`), so with traces off the logs are as before.
    let traces = provider
        .as_ref()
        .map(|p| tracing_opentelemetry::layer().with_tracer(p.tracer("flashsale")));
    let installed = tracing_subscriber::registry()
        .with(logs_filter)
        .with(logs_layer(log.format, provider.is_some()))
        .with(traces)
        .try_init()
        .is_ok();
    if let Some(err) = unusable {
        tracing::warn!(
            error = format!("{err:#}"),
            "traces are off: the OTEL_* environment asks for an exporter this service cannot use"
        );
    }
    match provider {
        Some(provider) if installed => {
            TRACES_ON.store(true, Ordering::Relaxed);
            tracing::info!(
                endpoint = url.as_deref().unwrap_or_default(),
                "exporting traces"
            );
            Ok(Telemetry {
                provider: Some(provider),
            })
        }
        // Err only means a subscriber is already installed, which is fine; its
        // exporter, if any, is that subscriber's.
        Some(provider) => {
            // Its shutdown blocks on the exporter's thread: not on this one.
            std::thread::spawn(move || provider.shutdown());
            Ok(Telemetry { provider: None })
        }
        None => Ok(Telemetry { provider: None }),
    }
}

/// The log lines' layer, in the configured format. With traces on, a JSON line
/// also lists every span it is in (`spans`): its current span may then be a
/// detail span, and the request's fields (`request_id`, `trace_id`) are in the
/// list.
fn logs_layer<S>(
    format: LogFormat,
    traces: bool,
) -> Box<dyn tracing_subscriber::Layer<S> + Send + Sync>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    match format {
        LogFormat::Json => fmt::layer()
            .json()
            .with_current_span(true)
            .with_span_list(traces)
            .boxed(),
        LogFormat::Text => fmt::layer().boxed(),
    }
}

/// A span made only while traces are on (`Span::none()` otherwise, at the cost
/// of one atomic load): the steps below the request, which the logs never had.
#[macro_export]
macro_rules! detail_span {
    ($($arg:tt)+) => {
        if $crate::telemetry::traces_enabled() {
            ::tracing::info_span!($($arg)+)
        } else {
            ::tracing::Span::none()
        }
    };
}

/// Where spans go (the full `/v1/traces` URL), or `None` when traces are off:
/// `telemetry.otlp_endpoint`, else `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (used as
/// it is), else `OTEL_EXPORTER_OTLP_ENDPOINT`; `OTEL_SDK_DISABLED=true` wins over
/// all three. `env` reads a variable (a test passes its own).
pub fn traces_url(
    settings: &TelemetrySettings,
    env: impl Fn(&str) -> Option<String>,
) -> anyhow::Result<Option<String>> {
    let var = |key: &str| {
        env(key)
            .map(|v| v.trim().to_owned())
            .filter(|v| !v.is_empty())
    };
    if var("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        return Ok(None);
    }
    let base = |url: &str| format!("{}/v1/traces", url.trim_end_matches('/'));
    let (url, from) = if !settings.otlp_endpoint.trim().is_empty() {
        (
            base(settings.otlp_endpoint.trim()),
            "telemetry.otlp_endpoint",
        )
    } else if let Some(url) = var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") {
        (url, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    } else if let Some(url) = var("OTEL_EXPORTER_OTLP_ENDPOINT") {
        (base(&url), "OTEL_EXPORTER_OTLP_ENDPOINT")
    } else {
        return Ok(None);
    };
    // The exporter's client has no TLS (no native or crypto dependency for
    // it): spans go to a collector next to the service, over plain HTTP.
    if !url.starts_with("http://") {
        bail!("{from} must be an http:// URL (OTLP over HTTP, no TLS), not {url:?}");
    }
    Ok(Some(url))
}

/// The exporter: batches of spans, JSON over HTTP, on the SDK's own thread.
fn tracer_provider(url: &str, settings: &TelemetrySettings) -> anyhow::Result<SdkTracerProvider> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpJson)
        .with_endpoint(url)
        .build()
        .with_context(|| format!("cannot build the OTLP exporter for {url}"))?;
    let batches = BatchSpanProcessor::builder(exporter)
        .with_batch_config(
            BatchConfigBuilder::default()
                .with_scheduled_delay(Duration::from_millis(settings.export_delay_ms))
                .build(),
        )
        .build();
    let service = std::env::var("OTEL_SERVICE_NAME")
        .ok()
        .filter(|s| !s.trim().is_empty())
        .unwrap_or_else(|| "flashsale".to_owned());
    let resource = Resource::builder()
        .with_service_name(service)
        .with_attribute(opentelemetry::KeyValue::new(
            "service.version",
            env!("CARGO_PKG_VERSION"),
        ))
        .build();
    Ok(SdkTracerProvider::builder()
        .with_span_processor(batches)
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            settings.sample_ratio,
        ))))
        .with_resource(resource)
        .build())
}

/// The W3C trace-context propagator (`traceparent`, `tracestate`).
pub fn propagator() -> TraceContextPropagator {
    TraceContextPropagator::new()
}

/// While traces are on: the request's span starts a trace of its own, takes
/// its name from the route (`otel_name`), and records its `trace_id` for the
/// logs. Off: nothing.
///
/// A caller's `traceparent` is not continued: the request path is public, and
/// a client's header would choose whether the trace is sampled, the trace id
/// written in the service's logs, and (through `tracestate`) how much every
/// span and message carries.
pub fn trace_request(span: &Span, otel_name: impl FnOnce() -> String) {
    if !traces_enabled() {
        return;
    }
    span.record("otel.name", otel_name());
    span.record("otel.kind", "server");
    let trace_id = span.context().span().span_context().trace_id();
    if trace_id != opentelemetry::trace::TraceId::INVALID {
        span.record("trace_id", tracing::field::display(trace_id));
    }
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
    (Kind::Gauge, "flashsale_clock_own_ahead_seconds", "How far this instance's own clock is ahead of the shared clock (Redis TIME) every time rule follows; negative when behind."),
    (Kind::Counter, "flashsale_redis_unreplicated_reservations_total", "Reservations answered 202 without waiting for a replica: redis.min_replicas_acked = auto and the sale's primary had none online (a failover now could lose them)."),
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
    (Kind::Counter, "flashsale_consumer_rejoins_total", "Times this instance's consumer left and rejoined its group because a partition it did not hold had messages nobody committed (only under kafka.broker_quirks = tansu-0.6)."),
    (Kind::Counter, "flashsale_consumer_batches_abandoned_total", "Batches this instance's consumer dropped unwritten because a rebalance gave their partitions to another member while MySQL refused them (the new holder reads them again)."),
    (Kind::Gauge, "flashsale_consumer_lag_messages", "Messages of the reservation topic the consumer group has not committed, as the reconciler last measured."),
    (Kind::Counter, "flashsale_reconcile_runs_total", "Reconciler passes over an activity."),
    (Kind::Counter, "flashsale_reconcile_drift_found_total", "Reconciler passes that found Redis's stock differing from what MySQL implies."),
    (Kind::Counter, "flashsale_reconcile_drift_repaired_total", "Drifts the reconciler repaired."),
    (Kind::Counter, "flashsale_reconcile_honoured_reservations_total", "Acknowledged reservations past the deadline the reconciler turned into orders."),
    (Kind::Counter, "flashsale_reconcile_withdrawn_reservations_total", "Unacknowledged reservations past the deadline the reconciler withdrew."),
    (Kind::Counter, "flashsale_activity_rebuilt_total", "Activities rebuilt in Redis from MySQL after a loss."),
    (Kind::Gauge, "flashsale_consumer_pace_duty", "The share of time the order consumer spends writing to MySQL (1: no pause; lower while its commits are slow)."),
    (Kind::Histogram, "flashsale_consumer_pause_seconds", "Pauses the order consumer made after a batch to keep MySQL's pace (its budget, or its commits slowing down)."),
    (Kind::Gauge, "flashsale_reconcile_pass_activities", "Activities the reconciler's last pass went through in full (the live ones, and those that lost their state)."),
    (Kind::Histogram, "flashsale_reconcile_pass_seconds", "How long one reconciler pass over the activities took."),
    (Kind::Counter, "flashsale_reconcile_in_flight_orders_total", "Orders a rebuild wrote itself from its sale's messages still in the topic (the consumers had not reached them)."),
    (Kind::Counter, "flashsale_activities_removed_total", "Ended sales whose Redis state was removed after redis.retain_after_end_secs."),
    (Kind::Counter, "flashsale_reservation_polls_total", "Reservation-status polls, by what answered them: redis (a pending reservation, or the cached view of an unchanged order) or mysql."),
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
    (Kind::Counter, "flashsale_waiting_room_answers_from_memory_total", "Waiting-room polls answered from this instance's memory, without a Redis call: before the start, and after the draw while the line has not moved."),
    (Kind::Gauge, "flashsale_waiting_room_remembered_joins", "Users this instance remembers as joined before a room's start (bounded by waiting_room.remembered_joins)."),
    (Kind::Gauge, "flashsale_waiting_room_remembered_places", "Answers this instance remembers after a room's draw, to answer again while the room has not moved (bounded by waiting_room.remembered_joins)."),
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
    use crate::config::TelemetrySettings;

    fn settings(endpoint: &str) -> TelemetrySettings {
        TelemetrySettings {
            otlp_endpoint: endpoint.to_owned(),
            export_delay_ms: 5000,
            sample_ratio: 1.0,
        }
    }

    fn url(endpoint: &str, vars: &[(&str, &str)]) -> anyhow::Result<Option<String>> {
        super::traces_url(&settings(endpoint), |key| {
            vars.iter()
                .find(|(k, _)| *k == key)
                .map(|(_, v)| (*v).to_owned())
        })
    }

    /// Off unless something names a collector; the key first, then the
    /// standard variables; `OTEL_SDK_DISABLED=true` wins over everything.
    #[test]
    fn where_traces_go() {
        assert_eq!(url("", &[]).expect("valid"), None);
        assert_eq!(
            url("  ", &[("OTEL_EXPORTER_OTLP_ENDPOINT", "")]).expect("valid"),
            None
        );
        assert_eq!(
            url(
                "http://collector:4318/",
                &[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://other:4318")]
            )
            .expect("valid")
            .as_deref(),
            Some("http://collector:4318/v1/traces")
        );
        assert_eq!(
            url(
                "",
                &[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")]
            )
            .expect("valid")
            .as_deref(),
            Some("http://collector:4318/v1/traces")
        );
        assert_eq!(
            url(
                "",
                &[
                    ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318"),
                    (
                        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                        "http://traces:4318/custom"
                    ),
                ]
            )
            .expect("valid")
            .as_deref(),
            Some("http://traces:4318/custom")
        );
        for off in ["true", "TRUE"] {
            assert_eq!(
                url("http://collector:4318", &[("OTEL_SDK_DISABLED", off)]).expect("valid"),
                None
            );
        }
        assert!(
            url("http://collector:4318", &[("OTEL_SDK_DISABLED", "false")])
                .expect("valid")
                .is_some()
        );
    }

    /// The exporter speaks plain HTTP only: anything else is refused at start,
    /// naming where it came from.
    #[test]
    fn an_endpoint_that_is_not_plain_http_is_refused() {
        let err = url("https://collector:4318", &[]).expect_err("no TLS");
        assert!(err.to_string().contains("telemetry.otlp_endpoint"), "{err}");
        let err =
            url("", &[("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318")]).expect_err("not a URL");
        assert!(
            err.to_string().contains("OTEL_EXPORTER_OTLP_ENDPOINT"),
            "{err}"
        );
    }

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
