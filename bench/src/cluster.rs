//! The hot SKU on a Redis Cluster: the same sale with its stock in one hash tag
//! (`stock_shards = 1`) and split over three (`stock_shards = 3`), side by side on
//! one Cluster of its own (3 primaries, 2 replicas each) and one service.
//!
//! Each run reports the service's throughput and p99, and each primary's share of
//! the reserve-path script calls and of Redis CPU (from `INFO commandstats` and
//! `INFO cpu`, before and after). Two cores cannot show three primaries tripling
//! anything, so the section ends with a projection to machines where each primary
//! has a core of its own, from the measured cost of one call.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use flashsale::config::Settings;
use secrecy::ExposeSecret;
use testkit::process::RedisCluster;
use testkit::sale::SaleSpec;

use crate::context::Bench;
use crate::loadgen::{self, ClickOrder, Plan};
use crate::machine;
use crate::model::{ClusterPlan, ClusterSection, PrimaryShare, ShardRun};
use crate::redis_info::counters;
use crate::server::StrategyKind;

/// A Redis Cluster of its own (3 primaries, 2 replicas each) in `dir`, healthy.
///
/// `dir` is emptied first: a node keeps its `nodes.conf` in a folder named after
/// its port, and one that drew the port of an earlier run's node would start as
/// a member of that run's cluster and never join this one.
pub async fn start_cluster(dir: &std::path::Path) -> anyhow::Result<RedisCluster> {
    if dir.exists() {
        std::fs::remove_dir_all(dir)
            .with_context(|| format!("failed to empty {}", dir.display()))?;
    }
    std::fs::create_dir_all(dir).with_context(|| format!("failed to create {}", dir.display()))?;
    let dir = dir.to_owned();
    tokio::task::spawn_blocking(move || {
        let c = RedisCluster::start(&dir);
        c.wait_healthy(Duration::from_secs(60)).map(|()| c)
    })
    .await
    .context("the Redis Cluster did not start")?
    .map_err(anyhow::Error::msg)
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
    let auth = loadgen::signer(&settings.auth)?;
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
        let users = loadgen::issue_tokens(
            &auth,
            &format!("cluster-k{shards}-{}-", &sale.id[..8.min(sale.id.len())]),
            plan.users,
            3600,
        )?;
        let load = Plan {
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
        };
        runs.push(shard_run(plan, cluster, &sale.id, shards, load, pid).await?);
    }
    Ok(runs)
}

/// One sale of `shards` stock shards under `load`, with each primary's share of
/// the script calls and of Redis CPU.
async fn shard_run(
    plan: &ClusterPlan,
    cluster: &RedisCluster,
    activity: &str,
    shards: u8,
    load: Plan,
    pid: Option<u32>,
) -> anyhow::Result<ShardRun> {
    // Which primary owns which shard.
    let owners: Vec<(u8, u16)> = tokio::task::block_in_place(|| {
        flashsale::stock::Keys::all(activity, shards)
            .into_iter()
            .filter_map(|k| cluster.primary_for(&k.stock).map(|p| (k.shard, p)))
            .collect()
    });
    let primaries = tokio::task::block_in_place(|| cluster.primaries());
    eprintln!(
        "== cluster: {} units, {} users × {} clicks, stock_shards = {shards}",
        plan.units, plan.users, plan.clicks
    );
    let mut before = Vec::new();
    for p in &primaries {
        before.push(counters(&node_url(*p)).await?);
    }
    let cpu_before = pid.and_then(machine::process_cpu_s);
    let load = loadgen::run(load).await?;
    let service_cpu_s = pid
        .and_then(machine::process_cpu_s)
        .zip(cpu_before)
        .map(|(a, b)| a - b);
    let mut shares = Vec::new();
    for (p, b) in primaries.iter().zip(before) {
        let a = counters(&node_url(*p)).await?;
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
    Ok(ShardRun {
        stock_shards: shards,
        load,
        primaries: shares,
        service_cpu_s,
    })
}

fn node_url(port: u16) -> String {
    format!("redis://127.0.0.1:{port}")
}

/// The Cluster section: a Cluster of its own, the service on it, two sales.
pub async fn section(bench: &Bench) -> anyhow::Result<ClusterSection> {
    let opts = &bench.opts;
    let plan = ClusterPlan {
        units: opts.cluster_units,
        users: opts.cluster_users,
        clicks: opts.small_clicks,
        connections: opts.concurrency,
        request_timeout: Duration::from_secs_f64(opts.request_timeout),
    };
    let nodes = start_cluster(&bench.runs_dir.join("cluster")).await?;
    let server = bench
        .start_server(
            StrategyKind::Service,
            &[("FLASHSALE__REDIS__URL", nodes.url())],
        )
        .await?;
    let runs = run(&bench.settings, &plan, &nodes, server.addr, server.pid()).await;
    server.stop().await?;
    drop(nodes);
    Ok(ClusterSection { plan, runs: runs? })
}
