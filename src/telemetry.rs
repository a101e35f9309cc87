//! Logging (tracing) and metrics (Prometheus) set-up, each installed once per process.

use std::sync::Mutex;

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
    *slot = Some(handle.clone());
    Ok(handle)
}
