//! `loadtest`: a flash sale of U users × C clicks against a running flashsale (or
//! any server with the same `POST /flash/{sku}/reserve` shape).
//!
//! ```text
//! cargo run -p flashsale-bench --release --bin loadtest -- \
//!     --url http://127.0.0.1:8080 --sku phone-1 --users 20000 --clicks 2 --stock 100
//! ```
//!
//! Tokens are signed with `auth.user_token_secret` from the configuration (the same
//! files and environment variables as the service). Prints a summary; `--json`
//! writes everything measured. Exits 0 whatever the invariants say: it measures,
//! it does not judge (`compare` and the report do).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use flashsale::config::Settings;
use flashsale_bench::loadgen::{self, ClickOrder, Plan};

#[derive(Parser)]
#[command(
    name = "loadtest",
    about = "Load generator for flashsale's reserve endpoint"
)]
struct Cli {
    /// Base URL of the server (http only).
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// The SKU on sale.
    #[arg(long)]
    sku: String,
    #[arg(long, default_value_t = 1000)]
    users: usize,
    /// Clicks (requests) per user.
    #[arg(long, default_value_t = 1)]
    clicks: u32,
    /// Open connections; without --rate also the concurrency.
    #[arg(long, visible_alias = "connections", default_value_t = 64)]
    concurrency: usize,
    /// Target requests per second (open loop) instead of a fixed concurrency.
    #[arg(long)]
    rate: Option<f64>,
    /// Upper bound on the run, in seconds (it ends earlier when every click is sent).
    #[arg(long, default_value_t = 60.0)]
    duration: f64,
    /// Seconds at the start whose requests are not timed.
    #[arg(long, default_value_t = 0.0)]
    warmup: f64,
    /// Units on sale: enables the check winners = units.
    #[arg(long)]
    stock: Option<u64>,
    #[arg(long, value_enum, default_value = "adjacent")]
    order: ClickOrder,
    /// User ids are PREFIX0, PREFIX1, …
    #[arg(long, default_value = "u")]
    user_prefix: String,
    /// Seconds before a request without an answer counts as a timeout.
    #[arg(long, default_value_t = 10.0)]
    timeout: f64,
    /// Configuration folder (for the user-token secret).
    #[arg(long, default_value = "config")]
    config: PathBuf,
    /// Configuration environment; defaults to FLASHSALE_ENV or "development".
    #[arg(long)]
    env: Option<String>,
    /// Name of the run in the output.
    #[arg(long, default_value = "loadtest")]
    label: String,
    /// Write the full report as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Never show the progress bar (it is hidden anyway when stderr is not a terminal).
    #[arg(long)]
    no_progress: bool,
}

async fn resolve(url: &str) -> anyhow::Result<std::net::SocketAddr> {
    let rest = url
        .strip_prefix("http://")
        .context("only http:// URLs are supported")?;
    let hostport = rest.split('/').next().unwrap_or(rest);
    let hostport = if hostport.contains(':') {
        hostport.to_owned()
    } else {
        format!("{hostport}:80")
    };
    let mut addrs = tokio::net::lookup_host(&hostport)
        .await
        .with_context(|| format!("cannot resolve {hostport}"))?;
    addrs
        .next()
        .with_context(|| format!("{hostport} has no address"))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let env = cli.env.unwrap_or_else(flashsale::config::environment);
    let settings = Settings::load_from(&cli.config, &env)?;
    let auth = loadgen::signer(&settings.auth)?;
    let addr = resolve(&cli.url).await?;
    // Tokens outlive any run: an hour.
    let users = loadgen::issue_tokens(&auth, &cli.user_prefix, cli.users, 3600)?;
    let plan = Plan {
        label: cli.label,
        addr,
        sku: cli.sku,
        users,
        clicks: cli.clicks,
        connections: cli.concurrency,
        rate: cli.rate,
        max_duration: Duration::from_secs_f64(cli.duration),
        warmup: Duration::from_secs_f64(cli.warmup),
        order: cli.order,
        request_timeout: Duration::from_secs_f64(cli.timeout),
        units: cli.stock,
        progress: !cli.no_progress,
    };
    let report = loadgen::run(plan).await?;
    print!("{}", report.human());
    if let Some(path) = cli.json {
        std::fs::write(&path, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("failed to write {}", path.display()))?;
    }
    Ok(())
}
