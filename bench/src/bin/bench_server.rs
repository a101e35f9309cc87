//! `bench-server`: one strategy behind the service's HTTP layers, on a free port of
//! 127.0.0.1. Prints one JSON line (`{"strategy", "port", "database", "topic"}`) once
//! it listens; stops on SIGINT/SIGTERM (or when stdin closes, with
//! `--stop-on-stdin-eof`), then drops its database.
//!
//! ```text
//! cargo run -p flashsale-bench --release --bin bench-server -- --strategy mysql
//! curl -XPOST localhost:PORT/bench/sales -H 'content-type: application/json' \
//!      -d '{"sku":"phone-1","stock":100}'
//! ```

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use flashsale_bench::server::{self, RateLimitMode, ServerOptions, StrategyKind};

/// The allocator of the `flashsale` binary, so every strategy runs on the same.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "bench-server",
    about = "One reserve strategy behind flashsale's HTTP layers"
)]
struct Cli {
    #[arg(long, value_enum)]
    strategy: StrategyKind,
    /// Configuration folder of the service.
    #[arg(long, default_value = "config")]
    config: PathBuf,
    #[arg(long, default_value = "test")]
    env: String,
    #[arg(long, value_enum, default_value = "off")]
    rate_limits: RateLimitMode,
    /// Pool size of the mysql strategy.
    #[arg(long, default_value_t = 64)]
    mysql_pool: u32,
    /// redis-lock: milliseconds between two attempts at a held lock.
    #[arg(long, default_value_t = 1)]
    lock_retry_ms: u64,
    /// redis-lock: milliseconds to wait for the lock before answering 503.
    #[arg(long, default_value_t = 3000)]
    lock_wait_ms: u64,
    /// redis-lock: the lock's expiry in milliseconds.
    #[arg(long, default_value_t = 1000)]
    lock_ttl_ms: u64,
    /// Stop when standard input closes (for a parent process).
    #[arg(long)]
    stop_on_stdin_eof: bool,
    /// Keep the database after stopping.
    #[arg(long)]
    keep: bool,
    /// Run as a second instance of the service of this run id (printed by the
    /// first as `run_id`): same database, topic and consumer group.
    #[arg(long)]
    join: Option<String>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    server::serve(ServerOptions {
        strategy: cli.strategy,
        config_dir: cli.config,
        env: cli.env,
        rate_limits: cli.rate_limits,
        mysql_pool: cli.mysql_pool,
        lock_retry: Duration::from_millis(cli.lock_retry_ms),
        lock_wait: Duration::from_millis(cli.lock_wait_ms),
        lock_ttl: Duration::from_millis(cli.lock_ttl_ms),
        stop_on_stdin_eof: cli.stop_on_stdin_eof,
        keep: cli.keep,
        join: cli.join,
    })
    .await
}
