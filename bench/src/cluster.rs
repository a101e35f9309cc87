//! The hot SKU on a Redis Cluster: the same sale with its stock in one hash tag
//! (`stock_shards = 1`) and split over three (`stock_shards = 3`), side by side on
//! one Cluster of its own (3 primaries, 2 replicas each) and one service.
//!
//! Each run reports the service's throughput and p99, and each primary's share of
//! the reserve-path script calls and of Redis CPU (from `INFO commandstats` and
//! `INFO cpu`, before and after). Two cores cannot show three primaries tripling
//! anything, so the section ends with a projection to machines where each primary
//! has a core of its own, from the measured cost of one call.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use flashsale::auth::Auth;
use flashsale::config::Settings;
use secrecy::ExposeSecret;
use serde::{Deserialize, Serialize};
use testkit::process::RedisCluster;
use testkit::sale::SaleSpec;

use crate::loadgen::{self, ClickOrder, LoadReport, Plan};
use crate::report::{ms, thousands};

/// What the Cluster section sells.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClusterPlan {
    pub units: u32,
    pub users: usize,
    pub clicks: u32,
    pub connections: usize,
    pub request_timeout: Duration,
}

/// One Redis primary's share of a run.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PrimaryShare {
    pub port: u16,
    /// Which of the sale's stock shards it owns.
    pub shards: Vec<u8>,
    /// EVALSHA and EVAL calls it served during the run.
    pub script_calls: u64,
    /// CPU seconds it spent (user + system), all threads.
    pub cpu_s: f64,
}

/// One sale on the Cluster.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ShardRun {
    pub stock_shards: u8,
    pub load: LoadReport,
    pub primaries: Vec<PrimaryShare>,
    /// CPU seconds of the service process during the run.
    pub service_cpu_s: Option<f64>,
}

impl ShardRun {
    fn script_calls(&self) -> u64 {
        self.primaries.iter().map(|p| p.script_calls).sum()
    }

    fn redis_cpu_s(&self) -> f64 {
        self.primaries.iter().map(|p| p.cpu_s).sum()
    }

    /// Script calls per answered request.
    fn calls_per_request(&self) -> f64 {
        self.script_calls() as f64 / self.load.answered.max(1) as f64
    }

    /// Redis CPU microseconds per script call, over every primary.
    fn us_per_call(&self) -> f64 {
        self.redis_cpu_s() * 1e6 / self.script_calls().max(1) as f64
    }

    /// The busiest primary's share of the calls.
    fn hottest_share(&self) -> f64 {
        let most = self
            .primaries
            .iter()
            .map(|p| p.script_calls)
            .max()
            .unwrap_or(0);
        most as f64 / self.script_calls().max(1) as f64
    }
}

/// Counters read from one primary.
#[derive(Debug, Clone, Copy, Default)]
struct Counters {
    script_calls: u64,
    cpu_s: f64,
}

async fn counters(port: u16) -> anyhow::Result<Counters> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}"))?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn)
        .await?;
    let cpu: String = redis::cmd("INFO").arg("cpu").query_async(&mut conn).await?;
    let calls = |name: &str| -> u64 {
        stats
            .lines()
            .find_map(|l| l.strip_prefix(&format!("cmdstat_{name}:calls=")))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    let seconds = |name: &str| -> f64 {
        cpu.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}:")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0)
    };
    Ok(Counters {
        script_calls: calls("evalsha") + calls("eval"),
        cpu_s: seconds("used_cpu_user") + seconds("used_cpu_sys"),
    })
}

/// CPU seconds (user + system) a process has used so far.
fn process_cpu_s(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) start after ')'.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    // Linux reports clock ticks of 1/100 s on every platform this runs on.
    Some((utime + stime) / 100.0)
}

/// A Redis Cluster of its own (3 primaries, 2 replicas each) in `dir`, healthy.
pub async fn start_cluster(dir: &std::path::Path) -> anyhow::Result<RedisCluster> {
    let dir = dir.to_owned();
    tokio::task::spawn_blocking(move || {
        let c = RedisCluster::start(&dir);
        c.wait_healthy(Duration::from_secs(60));
        c
    })
    .await
    .context("the Redis Cluster did not start")
}

/// Sells the sale twice, `stock_shards` 1 then 3, through the service at `addr`
/// (process `pid`), which uses `cluster`.
pub async fn run(
    settings: &Settings,
    plan: &ClusterPlan,
    cluster: &RedisCluster,
    addr: SocketAddr,
    pid: Option<u32>,
) -> anyhow::Result<Vec<ShardRun>> {
    let auth = Auth::new(
        settings.auth.admin_token.clone(),
        &settings.auth.user_token_secret,
    )?;
    let http = reqwest::Client::new();
    let mut runs = Vec::new();
    for shards in [1u8, 3] {
        let spec = SaleSpec {
            stock_shards: shards,
            payment_timeout_secs: 3600,
            ..SaleSpec::new(plan.units)
        };
        let sale = testkit::sale::open_sale(
            &http,
            &format!("http://{addr}"),
            settings.auth.admin_token.expose_secret(),
            &spec,
        )
        .await
        .map_err(|e| anyhow::anyhow!(e))
        .context("the Cluster sale did not open")?;
        // Which primary owns which shard.
        let owners: Vec<(u8, u16)> = {
            let id = sale.id.clone();
            tokio::task::block_in_place(|| {
                flashsale::stock::Keys::all(&id, shards)
                    .into_iter()
                    .filter_map(|k| cluster.primary_for(&k.stock).map(|p| (k.shard, p)))
                    .collect()
            })
        };
        let mut primaries = Vec::new();
        for node in &cluster.nodes {
            if is_primary(node.port).await? {
                primaries.push(node.port);
            }
        }
        let users = loadgen::issue_tokens(
            &auth,
            &format!("cluster-k{shards}-{}-", &sale.id[..8.min(sale.id.len())]),
            plan.users,
            3600,
        )?;
        eprintln!(
            "== cluster: {} units, {} users × {} clicks, stock_shards = {shards}",
            plan.units, plan.users, plan.clicks
        );
        let mut before = Vec::new();
        for p in &primaries {
            before.push(counters(*p).await?);
        }
        let cpu_before = pid.and_then(process_cpu_s);
        let load = loadgen::run(Plan {
            label: format!("cluster, stock_shards = {shards}"),
            addr,
            sku: sale.sku.clone(),
            users,
            clicks: plan.clicks,
            connections: plan.connections,
            rate: None,
            max_duration: Duration::from_secs(120),
            warmup: Duration::ZERO,
            order: ClickOrder::Adjacent,
            request_timeout: plan.request_timeout,
            units: Some(u64::from(plan.units)),
            progress: false,
        })
        .await?;
        let service_cpu_s = pid
            .and_then(process_cpu_s)
            .zip(cpu_before)
            .map(|(a, b)| a - b);
        let mut shares = Vec::new();
        for (p, b) in primaries.iter().zip(before) {
            let a = counters(*p).await?;
            shares.push(PrimaryShare {
                port: *p,
                shards: owners
                    .iter()
                    .filter(|(_, o)| o == p)
                    .map(|(s, _)| *s)
                    .collect(),
                script_calls: a.script_calls.saturating_sub(b.script_calls),
                cpu_s: a.cpu_s - b.cpu_s,
            });
        }
        runs.push(ShardRun {
            stock_shards: shards,
            load,
            primaries: shares,
            service_cpu_s,
        });
    }
    Ok(runs)
}

/// Whether the node on `port` is a primary now.
async fn is_primary(port: u16) -> anyhow::Result<bool> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}"))?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let info: String = redis::cmd("INFO")
        .arg("replication")
        .query_async(&mut conn)
        .await?;
    Ok(info.lines().any(|l| l.trim() == "role:master"))
}

/// The Cluster section of the report.
pub fn render(md: &mut String, plan: &ClusterPlan, runs: &[ShardRun]) {
    let _ = writeln!(
        md,
        "## One hot SKU on a Redis Cluster: stock_shards = 1 and 3\n"
    );
    let _ = writeln!(
        md,
        "{} units, {} users × {} clicks (adjacent), {} connections; the service on a Cluster of its own (3 primaries, 2 replicas each). Script calls are the reserve path's EVALSHA/EVAL on each primary; CPU is each primary's `used_cpu_user + used_cpu_sys`.\n",
        thousands(f64::from(plan.units)),
        thousands(plan.users as f64),
        plan.clicks,
        plan.connections
    );
    let _ = writeln!(
        md,
        "| stock_shards | answered | 202 | throughput (req/s) | p50 | p99 | script calls / request | Redis CPU µs / call | busiest primary's share of calls | service CPU µs / request |"
    );
    let _ = writeln!(
        md,
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    for r in runs {
        let service = r.service_cpu_s.map_or_else(
            || "n/a".to_owned(),
            |s| format!("{:.0}", s * 1e6 / r.load.answered.max(1) as f64),
        );
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {:.2} | {:.1} | {:.0} % | {service} |",
            r.stock_shards,
            thousands(r.load.answered as f64),
            thousands(r.load.sale.accepted as f64),
            thousands(r.load.throughput_rps),
            ms(r.load.latency.p50_ms),
            ms(r.load.latency.p99_ms),
            r.calls_per_request(),
            r.us_per_call(),
            r.hottest_share() * 100.0
        );
    }
    let _ = writeln!(md, "\nEach primary's share of the run:\n");
    let _ = writeln!(
        md,
        "| stock_shards | primary | owns shards | script calls | share of calls | Redis CPU (s) | share of Redis CPU |"
    );
    let _ = writeln!(md, "| ---: | ---: | --- | ---: | ---: | ---: | ---: |");
    for r in runs {
        let calls = r.script_calls().max(1) as f64;
        let cpu = r.redis_cpu_s().max(1e-9);
        for p in &r.primaries {
            let owned: Vec<String> = p.shards.iter().map(u8::to_string).collect();
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {:.0} % | {:.2} | {:.0} % |",
                r.stock_shards,
                p.port,
                if owned.is_empty() {
                    "none".to_owned()
                } else {
                    owned.join(", ")
                },
                thousands(p.script_calls as f64),
                p.script_calls as f64 * 100.0 / calls,
                p.cpu_s,
                p.cpu_s * 100.0 / cpu
            );
        }
    }
    render_projection(md, runs);
}

/// Where a machine with a core per primary would go, from the measured costs.
fn render_projection(md: &mut String, runs: &[ShardRun]) {
    let (Some(one), Some(three)) = (
        runs.iter().find(|r| r.stock_shards == 1),
        runs.iter().find(|r| r.stock_shards == 3),
    ) else {
        return;
    };
    // The Redis-side ceiling of one primary, in reserve requests per second, is
    // 1e6 / (µs per call × calls per request); K shards spread the calls, so the
    // ceiling grows with 1 / (the busiest primary's share).
    let ceiling = |r: &ShardRun| {
        1e6 / (r.us_per_call().max(0.1) * r.calls_per_request().max(1e-3))
            / r.hottest_share().max(1e-3)
    };
    let service_us = three
        .service_cpu_s
        .map(|s| s * 1e6 / three.load.answered.max(1) as f64);
    let _ = writeln!(md, "\n### Projection: a core per primary\n");
    let _ = writeln!(
        md,
        "- One primary spends **{:.1} µs** of CPU per script call here (K = 1), {:.1} µs with K = 3. With its own core, one hash tag caps the hot SKU at about **{} requests/s** on the Redis side ({:.2} calls a request, every call on one primary).",
        one.us_per_call(),
        three.us_per_call(),
        thousands(ceiling(one)),
        one.calls_per_request()
    );
    // The same, at the cost one call had with K = 1: three primaries sharing two
    // cores here make each call dearer than it would be on a core of its own.
    let at_one_cost = 1e6
        / (one.us_per_call().max(0.1) * three.calls_per_request().max(1e-3))
        / three.hottest_share().max(1e-3);
    let _ = writeln!(
        md,
        "- With K = 3 the busiest primary serves {:.0} % of the calls and a request costs {:.2} calls (a dry home shard asks its siblings to lend; a sibling found empty is not asked again by that instance for {} ms), so three primaries on three cores cap it at about **{} requests/s** at the per-call cost measured with K = 3 ({:.1}× one hash tag), **{}** at the cost measured with K = 1 ({:.1}×).",
        three.hottest_share() * 100.0,
        three.calls_per_request(),
        flashsale::stock::DRY_SIBLING_TTL.as_millis(),
        thousands(ceiling(three)),
        ceiling(three) / ceiling(one).max(1.0),
        thousands(at_one_cost),
        at_one_cost / ceiling(one).max(1.0)
    );
    if let Some(us) = service_us {
        let _ = writeln!(
            md,
            "- The service spends **{us:.0} µs** of CPU per request, so one service core answers about {} requests/s: past one hash tag, the sale is bound by the service instances (stateless; add instances behind the load balancer) long before the primaries, and the winning requests by the broker's acknowledgement (see the broker ceiling). MySQL sees only the winners, batched by the consumers.",
            thousands(1e6 / us.max(1.0))
        );
    }
    let _ = writeln!(
        md,
        "- On this machine both runs share two cores with the service, the load generator, the broker and MariaDB, so their throughputs differ by what the extra calls cost, not by the shards: the projection above is the figure to plan with."
    );
}
