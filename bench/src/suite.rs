//! The whole comparison, as `scripts/bench.sh` runs it:
//!
//! 1. the side query starts (and runs to the end); an idle window measures it alone;
//! 2. the Redis ceiling: `redis-benchmark` EVALSHA of the reserve script;
//! 3. for each strategy, a fresh `bench-server` child process, then three runs of
//!    the `loadtest` child process against it:
//!    - **saturation**: fixed concurrency, one click per user, stock = users so the
//!      sale cannot end during the measurement;
//!    - **half rate**: open loop at half of the throughput just measured;
//!    - **small stock**: the flash sale itself (default 100 units, 20,000 users
//!      double-clicking): the sold-out phase and the invariants;
//! 4. the summary (JSON) and the markdown report.
//!
//! Server, load generator and orchestrator are separate processes: on two cores the
//! fairest split is the kernel's, and no strategy shares a runtime with the load.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use chrono::Utc;
use flashsale::config::{KafkaSettings, Settings};
use hyper::{Method, StatusCode};
use secrecy::ExposeSecret;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sqlx::migrate::MigrateDatabase;
use sqlx::{Connection, MySql, MySqlConnection};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::ceiling::{self, BrokerCeiling, RedisCeiling};
use crate::client::{call_json, expect_json};
use crate::cluster::{ClusterPlan, ShardRun};
use crate::loadgen::LoadReport;
use crate::machine::{self, CpuSampler, CpuWindow, Machine};
use crate::server::{Announce, RateLimitMode, StrategyKind};
use crate::side::{SideQuery, SideStats};
use crate::with_database;
use testkit::invariants::{Figures, Probe};
use testkit::sale::SaleSpec;

/// Every size and duration of a comparison; the defaults fit the whole suite in
/// about four minutes on two cores (ten is the budget).
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
    /// Rate-limit layers of every server: off, or on with buckets that never refuse.
    #[arg(long, value_enum, default_value = "off")]
    pub rate_limits: RateLimitMode,
}

/// The Cluster section's plan and its two runs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClusterSection {
    pub plan: ClusterPlan,
    pub runs: Vec<ShardRun>,
}

/// A server-side verdict on a run.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ServerCheck {
    pub ok: bool,
    pub notes: Vec<String>,
}

/// One load run against one strategy, with what happened around it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Phase {
    pub load: LoadReport,
    pub side: SideStats,
    pub cpu: CpuWindow,
    /// The busiest processes outside the benchmark while the load generator ran
    /// (name, % of one core).
    pub others: Vec<(String, f64)>,
    /// The server's own view after the run (`/bench/sales/{sku}` or the admin API).
    pub server: Value,
    pub check: ServerCheck,
    /// Service only: seconds after the load until MySQL held every order.
    pub drain_s: Option<f64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StrategyResult {
    pub strategy: StrategyKind,
    pub name: String,
    pub description: String,
    pub saturation: Option<Phase>,
    pub half_rate: Option<Phase>,
    pub small: Option<Phase>,
    pub error: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Summary {
    pub started_at: String,
    pub finished_at: String,
    pub seconds: f64,
    pub command: String,
    pub options: SuiteOptions,
    pub machine: Machine,
    pub side_idle: SideStats,
    pub cpu_idle: CpuWindow,
    pub redis_ceiling: Vec<RedisCeiling>,
    /// One publish in flight, then as many as the load test's connections.
    pub broker_ceiling: Vec<BrokerCeiling>,
    pub strategies: Vec<StrategyResult>,
    /// The hot SKU on a Redis Cluster, stock_shards 1 and 3 (`None`: skipped).
    #[serde(default)]
    pub cluster: Option<ClusterSection>,
}

impl Summary {
    pub fn strategy(&self, kind: StrategyKind) -> Option<&StrategyResult> {
        self.strategies.iter().find(|s| s.strategy == kind)
    }
}

fn now_unix_ms() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64() * 1000.0)
        .unwrap_or(0.0)
}

/// The sibling binaries (`loadtest`, `bench-server`) built with this one.
fn sibling(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("cannot find this executable")?;
    let path = exe
        .parent()
        .context("this executable has no folder")?
        .join(name);
    if !path.is_file() {
        bail!(
            "{} is missing: build the bench crate's binaries together (cargo build --release -p flashsale-bench)",
            path.display()
        );
    }
    Ok(path)
}

/// A running `bench-server`.
struct ServerChild {
    child: Child,
    announce: Announce,
    addr: SocketAddr,
}

impl ServerChild {
    async fn start(
        bin: &Path,
        opts: &SuiteOptions,
        strategy: StrategyKind,
        env: &[(&str, String)],
    ) -> anyhow::Result<ServerChild> {
        let mut child = Command::new(bin)
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .arg("--strategy")
            .arg(strategy.name())
            .arg("--config")
            .arg(opts.repo.join("config"))
            .args(["--env", &opts.env])
            .args(["--mysql-pool", &opts.mysql_pool.to_string()])
            .args(["--lock-retry-ms", &opts.lock_retry_ms.to_string()])
            .args([
                "--rate-limits",
                match opts.rate_limits {
                    RateLimitMode::Off => "off",
                    RateLimitMode::Permissive => "permissive",
                },
            ])
            .arg("--stop-on-stdin-eof")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            // If this process dies, the child goes with it (and its stdin closes).
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("failed to start {}", bin.display()))?;
        let stdout = child
            .stdout
            .take()
            .context("the server's stdout is not piped")?;
        let mut lines = BufReader::new(stdout).lines();
        let first = tokio::time::timeout(Duration::from_secs(90), lines.next_line())
            .await
            .context("the server did not start within 90 s")?
            .context("failed to read the server's first line")?
            .context("the server exited before announcing its port")?;
        let announce: Announce = serde_json::from_str(&first)
            .with_context(|| format!("unexpected first line from the server: {first}"))?;
        // Keep reading, so the child can never block on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        let addr = SocketAddr::from(([127, 0, 0, 1], announce.port));
        Ok(ServerChild {
            child,
            announce,
            addr,
        })
    }

    fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Closes the child's stdin (its stop signal) and waits for a clean exit.
    async fn stop(mut self) -> anyhow::Result<()> {
        drop(self.child.stdin.take());
        match tokio::time::timeout(Duration::from_secs(40), self.child.wait()).await {
            Ok(status) => {
                let status = status.context("failed to wait for the server")?;
                if !status.success() {
                    bail!("the server exited with {status}");
                }
                Ok(())
            }
            Err(_) => {
                self.child.kill().await.ok();
                bail!("the server did not stop within 40 s and was killed")
            }
        }
    }
}

/// What one loadtest run is asked to do.
struct LoadArgs {
    label: String,
    sku: String,
    users: usize,
    clicks: u32,
    rate: Option<f64>,
    duration: f64,
    warmup: f64,
    units: Option<u64>,
}

struct Suite {
    opts: SuiteOptions,
    settings: Settings,
    loadtest: PathBuf,
    server_bin: PathBuf,
    runs_dir: PathBuf,
    cpu: CpuSampler,
    side: SideQuery,
    sale_counter: u32,
    /// For the test kit's sale set-up.
    http: reqwest::Client,
}

impl Suite {
    fn admin_token(&self) -> String {
        self.settings.auth.admin_token.expose_secret().to_owned()
    }

    fn next_sku(&mut self, strategy: StrategyKind, what: &str) -> String {
        self.sale_counter += 1;
        format!(
            "bench-{}-{what}-{}-{}",
            strategy.name(),
            self.sale_counter,
            &uuid::Uuid::new_v4().simple().to_string()[..6]
        )
    }

    async fn run_loadtest(
        &self,
        addr: SocketAddr,
        args: &LoadArgs,
        file: &str,
    ) -> anyhow::Result<(LoadReport, Option<u32>)> {
        let json_path = self.runs_dir.join(file);
        let mut cmd = Command::new(&self.loadtest);
        cmd.args(["--url", &format!("http://{addr}")])
            .args(["--sku", &args.sku])
            .args(["--users", &args.users.to_string()])
            .args(["--clicks", &args.clicks.to_string()])
            .args(["--concurrency", &self.opts.concurrency.to_string()])
            .args(["--duration", &(args.duration + args.warmup).to_string()])
            .args(["--warmup", &args.warmup.to_string()])
            .args(["--timeout", &self.opts.request_timeout.to_string()])
            .arg("--config")
            .arg(self.opts.repo.join("config"))
            .args(["--env", &self.opts.env])
            .args(["--label", &args.label])
            .arg("--json")
            .arg(&json_path)
            .stdin(Stdio::null())
            .kill_on_drop(true);
        if let Some(rate) = args.rate {
            cmd.args(["--rate", &format!("{rate:.1}")]);
        }
        if let Some(units) = args.units {
            cmd.args(["--stock", &units.to_string()]);
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("failed to start {}", self.loadtest.display()))?;
        let pid = child.id();
        if let Some(pid) = pid {
            self.cpu.track("loadgen", pid);
        }
        let bound = Duration::from_secs_f64(args.duration + args.warmup + 120.0);
        let status = tokio::time::timeout(bound, child.wait())
            .await
            .context("the load generator overran its time bound")?
            .context("failed to wait for the load generator")?;
        self.cpu.untrack("loadgen");
        if !status.success() {
            bail!("the load generator failed ({status})");
        }
        let text = std::fs::read_to_string(&json_path)
            .with_context(|| format!("failed to read {}", json_path.display()))?;
        let report =
            serde_json::from_str(&text).context("the load generator's JSON does not parse")?;
        Ok((report, pid))
    }

    /// Opens a sale on the server: `/bench/sales` for a–c and the no-op, the test
    /// kit's operator sequence for the service (create, preload). Returns the
    /// activity id for the service.
    async fn open_sale(
        &self,
        server: &ServerChild,
        sku: &str,
        stock: u64,
    ) -> anyhow::Result<Option<String>> {
        if server.announce.strategy != StrategyKind::Service {
            expect_json(
                server.addr,
                Method::POST,
                "/bench/sales",
                None,
                Some(&json!({ "sku": sku, "stock": stock })),
                StatusCode::CREATED,
            )
            .await?;
            return Ok(None);
        }
        let spec = SaleSpec {
            sku: Some(sku.to_owned()),
            payment_timeout_secs: 3600,
            ..SaleSpec::new(u32::try_from(stock).context("stock too large for a sale")?)
        };
        let base = format!("http://{}", server.addr);
        let sale = testkit::sale::open_sale(&self.http, &base, &self.admin_token(), &spec)
            .await
            .map_err(|e| anyhow::anyhow!(e))
            .context("the sale did not open")?;
        let id = sale.id;
        Ok(Some(id))
    }

    /// The server's view of a sale after a run, and the verdict on it. For the
    /// service, first waits until the consumer has written every order to MySQL.
    async fn inspect(
        &self,
        server: &ServerChild,
        sku: &str,
        activity: Option<&str>,
        load: &LoadReport,
    ) -> anyhow::Result<(Value, ServerCheck, Option<f64>)> {
        match (server.announce.strategy, activity) {
            (StrategyKind::Service, Some(id)) => self.inspect_service(server, id, load).await,
            (StrategyKind::Noop, _) => Ok((
                Value::Null,
                ServerCheck {
                    ok: true,
                    notes: vec!["no sale: the no-op holds nothing".into()],
                },
                None,
            )),
            _ => {
                let (status, state) = call_json(
                    server.addr,
                    Method::GET,
                    &format!("/bench/sales/{sku}"),
                    None,
                    None,
                )
                .await?;
                if status != StatusCode::OK {
                    bail!("sale state: {status} {state}");
                }
                let check = check_strategy(&state, load);
                Ok((state, check, None))
            }
        }
    }

    /// The service's sale once quiet, checked by the test kit's invariant checker
    /// (the same one the fault suite uses), plus: every `202` is an order.
    async fn inspect_service(
        &self,
        server: &ServerChild,
        activity: &str,
        load: &LoadReport,
    ) -> anyhow::Result<(Value, ServerCheck, Option<f64>)> {
        let announce = &server.announce;
        let probe = Probe {
            mysql_url: with_database(self.settings.mysql.url.expose_secret(), &announce.database),
            redis_url: self.settings.redis.url.clone(),
            activity_id: activity.to_owned(),
            kafka: KafkaSettings {
                topic: announce.topic.clone().unwrap_or_default(),
                group_id: announce.group.clone().unwrap_or_default(),
                ..self.settings.kafka.clone()
            },
        };
        let started = Instant::now();
        let quiet = probe
            .wait_quiet(Duration::from_secs_f64(self.opts.drain_timeout))
            .await;
        let drain_s = quiet.is_ok().then(|| started.elapsed().as_secs_f64());
        let checked = probe.check(&[]).await;
        let state = expect_json(
            server.addr,
            Method::GET,
            &format!("/admin/activities/{activity}"),
            Some(&self.admin_token()),
            None,
            StatusCode::OK,
        )
        .await?;
        let check = check_service(quiet, checked, load);
        Ok((state, check, drain_s))
    }

    async fn phase(
        &mut self,
        server: &ServerChild,
        args: LoadArgs,
        stock: u64,
        file: &str,
    ) -> anyhow::Result<Phase> {
        let activity = self.open_sale(server, &args.sku, stock).await?;
        // Everything else that ran meanwhile, to name the noise.
        let before = machine::process_table();
        let started = Instant::now();
        let mut known = self.cpu.tracked_pids();
        known.push(std::process::id());
        let (load, loadgen_pid) = self.run_loadtest(server.addr, &args, file).await?;
        known.extend(loadgen_pid);
        let others = machine::busiest_others(
            &before,
            &machine::process_table(),
            &known,
            started.elapsed().as_secs_f64(),
            3,
        );
        let (server_state, check, drain_s) = self
            .inspect(server, &args.sku, activity.as_deref(), &load)
            .await?;
        let side = self
            .side
            .window(load.window_start_unix_ms, load.window_end_unix_ms)?;
        let cpu = self
            .cpu
            .window(load.window_start_unix_ms, load.window_end_unix_ms);
        Ok(Phase {
            load,
            side,
            cpu,
            others,
            server: server_state,
            check,
            drain_s,
        })
    }

    /// The Cluster section: a Cluster of its own, the service on it, two sales.
    async fn cluster(&mut self) -> anyhow::Result<ClusterSection> {
        let plan = ClusterPlan {
            units: self.opts.cluster_units,
            users: self.opts.cluster_users,
            clicks: self.opts.small_clicks,
            connections: self.opts.concurrency,
            request_timeout: Duration::from_secs_f64(self.opts.request_timeout),
        };
        let dir = self.runs_dir.join("cluster");
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("failed to create {}", dir.display()))?;
        let nodes = crate::cluster::start_cluster(&dir).await?;
        let server = ServerChild::start(
            &self.server_bin,
            &self.opts,
            StrategyKind::Service,
            &[("FLASHSALE__REDIS__URL", nodes.url())],
        )
        .await?;
        let runs =
            crate::cluster::run(&self.settings, &plan, &nodes, server.addr, server.pid()).await;
        server.stop().await?;
        drop(nodes);
        Ok(ClusterSection { plan, runs: runs? })
    }

    async fn strategy(&mut self, kind: StrategyKind) -> anyhow::Result<StrategyResult> {
        let mut result = StrategyResult {
            strategy: kind,
            name: kind.name().to_owned(),
            description: kind.describe().to_owned(),
            saturation: None,
            half_rate: None,
            small: None,
            error: None,
        };
        eprintln!("== {}: starting the server", kind.name());
        let server = ServerChild::start(&self.server_bin, &self.opts, kind, &[]).await?;
        if let Some(pid) = server.pid() {
            self.cpu.track("server", pid);
        }
        let outcome = self.strategy_runs(kind, &server, &mut result).await;
        self.cpu.untrack("server");
        let stopped = server.stop().await;
        if let Err(err) = outcome {
            result.error = Some(format!("{err:#}"));
            eprintln!("== {}: FAILED: {err:#}", kind.name());
        }
        if let Err(err) = stopped {
            eprintln!("== {}: {err:#}", kind.name());
        }
        Ok(result)
    }

    async fn strategy_runs(
        &mut self,
        kind: StrategyKind,
        server: &ServerChild,
        result: &mut StrategyResult,
    ) -> anyhow::Result<()> {
        let name = kind.name();
        let users = self.opts.users;

        eprintln!(
            "== {name}: saturation, {} connections",
            self.opts.concurrency
        );
        let sku = self.next_sku(kind, "sat");
        let args = LoadArgs {
            label: format!("{name} saturation"),
            sku,
            users,
            clicks: 1,
            rate: None,
            duration: self.opts.duration,
            warmup: self.opts.warmup,
            units: Some(users as u64),
        };
        let saturation = self
            .phase(
                server,
                args,
                users as u64,
                &format!("{name}-saturation.json"),
            )
            .await?;
        let rate = saturation.load.throughput_rps / 2.0;
        result.saturation = Some(saturation);

        if self.opts.half_rate_duration > 0.0 && rate > 0.0 {
            eprintln!("== {name}: half of saturation, {rate:.0} req/s");
            let sku = self.next_sku(kind, "half");
            let args = LoadArgs {
                label: format!("{name} half rate"),
                sku,
                users,
                clicks: 1,
                rate: Some(rate),
                duration: self.opts.half_rate_duration,
                warmup: self.opts.warmup.min(self.opts.half_rate_duration / 4.0),
                units: Some(users as u64),
            };
            result.half_rate = Some(
                self.phase(
                    server,
                    args,
                    users as u64,
                    &format!("{name}-half-rate.json"),
                )
                .await?,
            );
        }

        if self.opts.small_stock > 0 && kind != StrategyKind::Noop {
            let stock = self.opts.small_stock;
            eprintln!(
                "== {name}: small stock, {} units for {} users × {} clicks",
                stock, self.opts.small_users, self.opts.small_clicks
            );
            let sku = self.next_sku(kind, "small");
            let args = LoadArgs {
                label: format!("{name} small stock"),
                sku,
                users: self.opts.small_users,
                clicks: self.opts.small_clicks,
                rate: None,
                duration: self.opts.small_max_duration,
                warmup: 0.0,
                units: Some(stock),
            };
            result.small = Some(
                self.phase(server, args, stock, &format!("{name}-small-stock.json"))
                    .await?,
            );
        }
        Ok(())
    }
}

fn as_i64(v: &Value) -> Option<i64> {
    v.as_i64()
}

/// The verdict on strategies a–c from their own counters.
fn check_strategy(state: &Value, load: &LoadReport) -> ServerCheck {
    let mut notes = Vec::new();
    let mut ok = true;
    let stock = as_i64(&state["stock"]).unwrap_or(0);
    let left = as_i64(&state["stock_left"]);
    let sold = as_i64(&state["units_sold"]).unwrap_or(0);
    let buyers = as_i64(&state["buyers"]["distinct_buyers"]).unwrap_or(0);
    if let Some(left) = left {
        if left < 0 {
            ok = false;
            notes.push(format!("stock ended below zero ({left})"));
        }
    }
    if sold > stock {
        ok = false;
        notes.push(format!("oversold: {sold} units of {stock}"));
    }
    if sold != load.sale.accepted as i64 {
        ok = false;
        notes.push(format!(
            "{sold} units taken but {} answered 202",
            load.sale.accepted
        ));
    }
    if buyers < sold {
        ok = false;
        notes.push(format!(
            "{sold} units went to {buyers} distinct buyers: someone holds several"
        ));
    }
    if let Some(orders) = as_i64(&state["buyers"]["orders"]) {
        if orders != sold {
            ok = false;
            notes.push(format!("{orders} orders for {sold} units"));
        }
    }
    for (key, what) in [
        (
            "double_wins",
            "users recorded twice (a second click won too)",
        ),
        (
            "negative_decrements",
            "DECRs below zero (stock read negative until INCR)",
        ),
        (
            "lock_timeouts",
            "requests gave up waiting for the lock (503)",
        ),
        ("locks_lost", "locks expired while held"),
    ] {
        let n = as_i64(&state[key]).unwrap_or(0);
        if n > 0 {
            notes.push(format!("{n} {what}"));
            if key == "double_wins" || key == "locks_lost" {
                ok = false;
            }
        }
    }
    let lowest = as_i64(&state["lowest_stock_seen"]).unwrap_or(0);
    if lowest < 0 {
        notes.push(format!("lowest stock seen: {lowest}"));
    }
    if notes.is_empty() {
        notes.push(format!("{sold} units to {buyers} distinct buyers"));
    }
    ServerCheck { ok, notes }
}

/// The verdict on the service: quiet in time, the invariants hold, and MySQL holds
/// an order for every `202`.
fn check_service(
    quiet: Result<(), String>,
    checked: Result<Figures, String>,
    load: &LoadReport,
) -> ServerCheck {
    let mut notes = Vec::new();
    if let Err(e) = quiet {
        notes.push(format!("not quiet when the wait ended: {e}"));
    }
    match checked {
        Ok(f) => {
            let orders = f.live_orders + f.cancelled;
            if orders != load.sale.accepted as i64 {
                notes.push(format!(
                    "{orders} orders in MySQL for {} answers 202",
                    load.sale.accepted
                ));
            }
            if notes.is_empty() {
                notes.push(format!(
                    "{orders} orders in MySQL = 202s; invariants hold (no oversell, one per user, stock conserved in Redis and MySQL)"
                ));
                return ServerCheck { ok: true, notes };
            }
        }
        Err(problems) => notes.push(problems),
    }
    ServerCheck { ok: false, notes }
}

/// Drops benchmark databases an interrupted run left behind.
async fn drop_stale_databases(conn: &mut MySqlConnection) -> anyhow::Result<()> {
    let stale: Vec<String> = sqlx::query_scalar(
        "SELECT schema_name FROM information_schema.schemata WHERE schema_name LIKE 'flashsale\\_bench\\_%'",
    )
    .fetch_all(&mut *conn)
    .await?;
    for db in stale {
        sqlx::query(&format!("DROP DATABASE `{db}`"))
            .execute(&mut *conn)
            .await
            .with_context(|| format!("failed to drop {db}"))?;
    }
    Ok(())
}

/// Runs the comparison and writes `summary.json` and `report.md` into `opts.out`.
pub async fn run(opts: SuiteOptions, command: String) -> anyhow::Result<Summary> {
    let started_at = Utc::now();
    let t0 = Instant::now();
    let settings = Settings::load_from(&opts.repo.join("config"), &opts.env)?;
    let loadtest = sibling("loadtest")?;
    let server_bin = sibling("bench-server")?;
    let runs_dir = opts.out.join("runs");
    std::fs::create_dir_all(&runs_dir)
        .with_context(|| format!("failed to create {}", runs_dir.display()))?;

    // The machine, and the servers' versions.
    let mut machine = machine::describe();
    let load1: f64 = machine
        .load_average_at_start
        .split_whitespace()
        .next()
        .and_then(|l| l.parse().ok())
        .unwrap_or(0.0);
    if load1 > 1.0 {
        eprintln!(
            "== warning: load average {load1:.1} at start: something else is running, the figures will be noisy"
        );
    }
    let mysql_url = settings.mysql.url.expose_secret().to_owned();
    let mut admin = MySqlConnection::connect(&with_database(&mysql_url, "information_schema"))
        .await
        .context("failed to connect to MariaDB (run scripts/services.sh)")?;
    machine.mariadb = sqlx::query_scalar("SELECT VERSION()")
        .fetch_one(&mut admin)
        .await?;
    let flush: Option<(String, String)> =
        sqlx::query_as("SHOW VARIABLES LIKE 'innodb_flush_log_at_trx_commit'")
            .fetch_optional(&mut admin)
            .await?;
    machine.innodb_flush_log_at_trx_commit = flush.map(|(_, v)| v).unwrap_or_default();
    drop_stale_databases(&mut admin).await?;
    admin.close().await.ok();
    let redis_info: String = {
        let client = redis::Client::open(settings.redis.url.as_str())?;
        let mut conn = client
            .get_multiplexed_async_connection()
            .await
            .context("failed to connect to Redis (run scripts/services.sh)")?;
        redis::cmd("INFO")
            .arg("server")
            .query_async(&mut conn)
            .await?
    };
    machine.redis = redis_info
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:"))
        .map(|v| v.trim().to_owned())
        .unwrap_or_default();

    let cpu = CpuSampler::start()?;
    for (role, name) in [
        ("redis", "redis-server"),
        ("mariadb", "mariadbd"),
        ("broker", "tansu"),
    ] {
        if let Some(pid) = machine::pids_named(name).into_iter().next() {
            cpu.track(role, pid);
        }
    }

    // The other business: its own database on the same server.
    let side_db = format!(
        "flashsale_bench_side_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let side_url = with_database(&mysql_url, &side_db);
    MySql::create_database(&side_url)
        .await
        .context("failed to create the side database")?;
    let side = SideQuery::start(&side_url, opts.side_rate).await?;

    eprintln!(
        "== idle: side query alone for {:.0} s at {:.0} q/s",
        opts.idle_duration, opts.side_rate
    );
    let idle_from = now_unix_ms();
    tokio::time::sleep(Duration::from_secs_f64(opts.idle_duration)).await;
    let idle_to = now_unix_ms();
    let side_idle = side.window(idle_from, idle_to)?;
    let cpu_idle = cpu.window(idle_from, idle_to);

    let mut redis_ceiling = Vec::new();
    if opts.redis_bench_requests > 0 {
        let script = opts.repo.join("src/stock/reserve.lua");
        for pipeline in [1, 16] {
            eprintln!(
                "== ceiling: redis-benchmark EVALSHA reserve.lua, {} clients, pipeline {pipeline}",
                opts.redis_bench_clients
            );
            redis_ceiling.push(
                ceiling::redis_evalsha(
                    &settings.redis.url,
                    &script,
                    opts.redis_bench_clients,
                    pipeline,
                    opts.redis_bench_requests * u64::from(pipeline.min(2)),
                )
                .await?,
            );
        }
    }

    let mut broker_ceiling = Vec::new();
    if opts.broker_ceiling_duration > 0.0 {
        // This process publishes: its CPU is the publisher's. The sampler needs one
        // tick to see the role before the window opens.
        cpu.track("publisher", std::process::id());
        tokio::time::sleep(Duration::from_millis(400)).await;
        // One publish at a time: the broker's acknowledgement latency on its own.
        // Then as many in flight as the load test has connections.
        for in_flight in [1, opts.concurrency] {
            eprintln!(
                "== ceiling: the service's Kafka publisher, {in_flight} publishes in flight, {:.0} s",
                opts.broker_ceiling_duration
            );
            let from = now_unix_ms();
            let mut c = ceiling::broker_publish(
                &settings.kafka,
                in_flight,
                Duration::from_secs_f64(opts.broker_ceiling_duration),
            )
            .await?;
            c.cpu = Some(cpu.window(from, now_unix_ms()));
            broker_ceiling.push(c);
        }
        cpu.untrack("publisher");
    }

    let mut suite = Suite {
        opts: opts.clone(),
        settings,
        loadtest,
        server_bin,
        runs_dir,
        cpu,
        side,
        sale_counter: 0,
        http: reqwest::Client::new(),
    };
    let mut strategies = Vec::new();
    for kind in opts.strategies.clone() {
        strategies.push(suite.strategy(kind).await?);
    }
    let cluster = if opts.cluster_units > 0 {
        Some(suite.cluster().await?)
    } else {
        None
    };

    let Suite { cpu, side, .. } = suite;
    side.stop();
    cpu.stop();
    if let Err(err) = MySql::drop_database(&side_url).await {
        eprintln!("could not drop {side_db}: {err}");
    }

    let summary = Summary {
        started_at: started_at.to_rfc3339(),
        finished_at: Utc::now().to_rfc3339(),
        seconds: t0.elapsed().as_secs_f64(),
        command,
        options: opts.clone(),
        machine,
        side_idle,
        cpu_idle,
        redis_ceiling,
        broker_ceiling,
        strategies,
        cluster,
    };
    let json_path = opts.out.join("summary.json");
    std::fs::write(&json_path, serde_json::to_vec_pretty(&summary)?)
        .with_context(|| format!("failed to write {}", json_path.display()))?;
    let report_path = opts.out.join("report.md");
    std::fs::write(&report_path, crate::report::render(&summary))
        .with_context(|| format!("failed to write {}", report_path.display()))?;
    Ok(summary)
}
