//! Every size and duration of a comparison, as `compare` takes them.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::server::{RateLimitMode, StrategyKind};

/// Every size and duration of a comparison; the defaults fit the whole suite in
/// about five minutes on two cores (ten is the budget).
#[derive(Debug, Clone, clap::Args, Serialize, Deserialize)]
pub struct SuiteOptions {
    /// Repository root: `config/` and `src/stock/reserve.lua` are read from it.
    #[arg(long, default_value = ".")]
    pub repo: PathBuf,
    /// Configuration environment (`config/{env}.toml`).
    #[arg(long, default_value = "test")]
    pub env: String,
    /// Folder for report.md, summary.json, the runs' JSON and the plots.
    #[arg(long, default_value = "results")]
    pub out: PathBuf,
    /// Strategies to compare, in this order.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "noop,mysql,redis-decr,redis-lock,service"
    )]
    pub strategies: Vec<StrategyKind>,
    /// Connections (= concurrency) of the saturation and small-stock runs, and the
    /// connections of the half-rate runs.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Users of the saturation and half-rate runs (one click each; stock = users).
    #[arg(long, default_value_t = 300_000)]
    pub users: usize,
    /// Seconds of the saturation run, after the warm-up.
    #[arg(long, default_value_t = 10.0)]
    pub duration: f64,
    /// Seconds of load before measuring starts.
    #[arg(long, default_value_t = 1.0)]
    pub warmup: f64,
    /// Seconds of the half-rate run; 0 skips it.
    #[arg(long, default_value_t = 8.0)]
    pub half_rate_duration: f64,
    /// Units of the small-stock sale; 0 skips it.
    #[arg(long, default_value_t = 100)]
    pub small_stock: u64,
    #[arg(long, default_value_t = 20_000)]
    pub small_users: usize,
    #[arg(long, default_value_t = 2)]
    pub small_clicks: u32,
    /// Upper bound on the small-stock run, in seconds.
    #[arg(long, default_value_t = 20.0)]
    pub small_max_duration: f64,
    /// Side queries per second.
    #[arg(long, default_value_t = 50.0)]
    pub side_rate: f64,
    /// Seconds of the idle side-query baseline.
    #[arg(long, default_value_t = 10.0)]
    pub idle_duration: f64,
    #[arg(long, default_value_t = 50)]
    pub redis_bench_clients: u32,
    /// Calls of the unpipelined redis-benchmark run (the pipelined one makes twice
    /// as many); 0 skips the Redis ceiling.
    #[arg(long, default_value_t = 200_000)]
    pub redis_bench_requests: u64,
    /// Seconds of the broker ceiling (the service's publisher alone); 0 skips it.
    #[arg(long, default_value_t = 5.0)]
    pub broker_ceiling_duration: f64,
    /// Pool size of the mysql strategy.
    #[arg(long, default_value_t = 64)]
    pub mysql_pool: u32,
    /// redis-lock: milliseconds between two attempts at a held lock.
    #[arg(long, default_value_t = 1)]
    pub lock_retry_ms: u64,
    /// Seconds to wait for the service's consumer to write every order after a run.
    #[arg(long, default_value_t = 120.0)]
    pub drain_timeout: f64,
    /// Seconds before a request without an answer counts as a timeout.
    #[arg(long, default_value_t = 10.0)]
    pub request_timeout: f64,
    /// Units of the Cluster section's sale (sold with stock_shards 1, then 3 on a
    /// Redis Cluster of its own); 0 skips the section.
    #[arg(long, default_value_t = 2_000)]
    pub cluster_units: u32,
    /// Users of the Cluster section's sale (each clicks `small_clicks` times).
    #[arg(long, default_value_t = 20_000)]
    pub cluster_users: usize,
    /// Units of the failover section's sale (on a Redis Cluster of its own, the
    /// primary of the sale's slot killed mid-sale); 0 skips the section.
    #[arg(long, default_value_t = 100_000)]
    pub failover_units: u32,
    /// Seconds the failover section's sale goes on after the replica's promotion.
    #[arg(long, default_value_t = 10.0)]
    pub failover_after: f64,
    /// Seconds of each `wrk` run of the flood section (healthz, the no-op, the
    /// service sold out, refused by its window, winning); 0 skips the section.
    #[arg(long, default_value_t = 5.0)]
    pub flood_duration: f64,
    /// Rounds in which healthz, the no-op, sold out and refused by window take
    /// turns; the median round of each is reported.
    #[arg(long, default_value_t = 3)]
    pub flood_rounds: usize,
    /// Units the gate section returns to a sold-out sale during a flood, through a
    /// second instance; 0 skips the section.
    #[arg(long, default_value_t = 20)]
    pub gate_units: u32,
    /// Seconds of each producer-settings run (the service's publisher alone against
    /// the broker, one setting changed at a time); 0 skips the section.
    #[arg(long, default_value_t = 3.0)]
    pub producer_duration: f64,
    /// Users of the fairness section (a tenth of them bots, 100 units), sold open
    /// and through the waiting room; 0 skips the section.
    #[arg(long, default_value_t = 1_000)]
    pub fairness_users: usize,
    /// Rate-limit layers of every server: off, or on with buckets that never refuse.
    #[arg(long, value_enum, default_value = "off")]
    pub rate_limits: RateLimitMode,
    /// Run the mega-sale section alone (`scripts/bench.sh mega`): the Redis and
    /// broker ceilings, the flood's compared phases with the deployed and the
    /// quiet configuration, then the mega-sales; the other sections are skipped.
    #[arg(long)]
    #[serde(default)]
    pub mega: bool,
    /// Users of each mega-sale, each with a token of their own.
    #[arg(long, default_value_t = 1_000_000)]
    #[serde(default)]
    pub mega_users: usize,
    /// Units of each mega-sale.
    #[arg(long, default_value_t = 100_000)]
    #[serde(default)]
    pub mega_units: u32,
    /// Clicks of each user on reserve (at once: a double click).
    #[arg(long, default_value_t = 2)]
    #[serde(default)]
    pub mega_clicks: u32,
    /// The stock_shards each mega-sale is sold with, open and through the room.
    #[arg(long, value_delimiter = ',', default_value = "1,3")]
    #[serde(default)]
    pub mega_shards: Vec<u8>,
    /// Upper bound on one mega-sale's crowd, in seconds.
    #[arg(long, default_value_t = 1800.0)]
    #[serde(default)]
    pub mega_max_duration: f64,
    /// The sale the scale-out table plans for: this many users...
    #[arg(long, default_value_t = 1_000_000)]
    #[serde(default)]
    pub mega_target_users: u64,
    /// ... in this many seconds.
    #[arg(long, default_value_t = 10.0)]
    #[serde(default)]
    pub mega_target_seconds: f64,
}
