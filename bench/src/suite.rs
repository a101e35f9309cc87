//! The whole comparison, as `scripts/bench.sh` runs it:
//!
//! 1. the machine and the servers' versions; the side query starts (and runs to
//!    the end) and an idle window measures it alone;
//! 2. the ceilings: `redis-benchmark` EVALSHA of the reserve script, and the
//!    service's Kafka publisher alone;
//! 3. the strategies side by side ([`crate::strategies`]);
//! 4. the flood measured with `wrk` and the CPU per request ([`crate::flood`]), the
//!    sold-out gate reopening across instances ([`crate::gate`]), the producer's
//!    settings ([`crate::producer`]), bots among the winners with and without the
//!    waiting room ([`crate::fairness`]), the hot SKU on a Redis Cluster
//!    ([`crate::cluster`]) and a sale through the loss of a Cluster primary
//!    ([`crate::failover`]);
//! 5. the summary (JSON) and the markdown report ([`crate::report`]).
//!
//! With `--mega`, steps 3 and 4 give way to the mega-sale ([`crate::mega`]).
//!
//! Server, load generator and orchestrator are separate processes: on two cores the
//! fairest split is the kernel's, and no strategy shares a runtime with the load.

use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::Utc;
use flashsale::config::Settings;
use secrecy::ExposeSecret;
use sqlx::{Connection, MySqlConnection};

use crate::ceiling::{self, BrokerCeiling, RedisCeiling};
use crate::clock::now_unix_ms;
use crate::context::Bench;
use crate::machine::{self, Machine};
use crate::model::Summary;
use crate::options::SuiteOptions;
use crate::redis_info;
use crate::with_database;

/// Runs the comparison and writes `summary.json` and `report.md` into `opts.out`.
pub async fn run(opts: SuiteOptions, command: String) -> anyhow::Result<Summary> {
    let started_at = Utc::now();
    let t0 = Instant::now();
    let settings = Settings::load_from(&opts.repo.join("config"), &opts.env)?;
    let machine = describe_machine(&settings).await?;
    let mut bench = Bench::start(opts.clone(), settings).await?;
    let summary = sections(&mut bench, started_at, t0, command, machine).await;
    bench.stop().await;
    let summary = summary?;
    let json_path = opts.out.join("summary.json");
    std::fs::write(&json_path, serde_json::to_vec_pretty(&summary)?)
        .with_context(|| format!("failed to write {}", json_path.display()))?;
    let report_path = opts.out.join("report.md");
    std::fs::write(&report_path, crate::report::render(&summary))
        .with_context(|| format!("failed to write {}", report_path.display()))?;
    Ok(summary)
}

/// Every measurement, in order, into the summary.
async fn sections(
    bench: &mut Bench,
    started_at: chrono::DateTime<Utc>,
    t0: Instant,
    command: String,
    machine: Machine,
) -> anyhow::Result<Summary> {
    let opts = bench.opts.clone();
    eprintln!(
        "== idle: side query alone for {:.0} s at {:.0} q/s",
        opts.idle_duration, opts.side_rate
    );
    let idle_from = now_unix_ms();
    tokio::time::sleep(Duration::from_secs_f64(opts.idle_duration)).await;
    let idle_to = now_unix_ms();
    let side_idle = bench.side.window(idle_from, idle_to)?;
    let cpu_idle = bench.cpu.window(idle_from, idle_to);

    let redis_ceiling = redis_ceilings(bench).await?;
    let broker_ceiling = broker_ceilings(bench).await?;
    if opts.mega {
        let broker = broker_ceiling
            .iter()
            .find(|b| b.in_flight == opts.concurrency);
        let mega = crate::mega::section(bench, broker).await?;
        return Ok(Summary {
            started_at: started_at.to_rfc3339(),
            finished_at: Utc::now().to_rfc3339(),
            seconds: t0.elapsed().as_secs_f64(),
            command,
            options: opts,
            machine,
            side_idle,
            cpu_idle,
            redis_ceiling,
            broker_ceiling,
            strategies: Vec::new(),
            cluster: None,
            flood: None,
            gate: None,
            producer: None,
            fairness: None,
            failover: None,
            mega: Some(mega),
        });
    }

    let mut strategies = Vec::new();
    for kind in opts.strategies.clone() {
        strategies.push(bench.strategy(kind).await?);
    }
    let flood = if opts.flood_duration > 0.0 {
        Some(crate::flood::section(bench).await?)
    } else {
        None
    };
    let gate = if opts.gate_units > 0 {
        Some(crate::gate::section(bench).await?)
    } else {
        None
    };
    let producer = if opts.producer_duration > 0.0 {
        Some(crate::producer::section(bench).await?)
    } else {
        None
    };
    let fairness = if opts.fairness_users > 0 {
        Some(crate::fairness::section(bench).await?)
    } else {
        None
    };
    let cluster = if opts.cluster_units > 0 {
        Some(crate::cluster::section(bench).await?)
    } else {
        None
    };
    let failover = if opts.failover_units > 0 {
        Some(crate::failover::section(bench).await?)
    } else {
        None
    };
    Ok(Summary {
        started_at: started_at.to_rfc3339(),
        finished_at: Utc::now().to_rfc3339(),
        seconds: t0.elapsed().as_secs_f64(),
        command,
        options: opts,
        machine,
        side_idle,
        cpu_idle,
        redis_ceiling,
        broker_ceiling,
        strategies,
        cluster,
        flood,
        gate,
        producer,
        fairness,
        failover,
        mega: None,
    })
}

/// The machine, the servers' versions; drops benchmark databases left behind.
async fn describe_machine(settings: &Settings) -> anyhow::Result<Machine> {
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
    let mysql_url = settings.mysql.url.expose_secret();
    let mut admin = MySqlConnection::connect(&with_database(mysql_url, "information_schema"))
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
    machine.redis = redis_info::version(&settings.redis.url).await?;
    Ok(machine)
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

/// `redis-benchmark` EVALSHA of the reserve script, unpipelined and pipelined.
async fn redis_ceilings(bench: &Bench) -> anyhow::Result<Vec<RedisCeiling>> {
    let opts = &bench.opts;
    let mut out = Vec::new();
    if opts.redis_bench_requests == 0 {
        return Ok(out);
    }
    let script = opts.repo.join("src/stock/reserve.lua");
    for pipeline in [1, 16] {
        eprintln!(
            "== ceiling: redis-benchmark EVALSHA reserve.lua, {} clients, pipeline {pipeline}",
            opts.redis_bench_clients
        );
        out.push(
            ceiling::redis_evalsha(
                &bench.settings.redis.url,
                &script,
                opts.redis_bench_clients,
                pipeline,
                opts.redis_bench_requests * u64::from(pipeline.min(2)),
            )
            .await?,
        );
    }
    Ok(out)
}

/// The service's publisher alone: one publish in flight (the broker's
/// acknowledgement latency on its own), then as many as the load has connections.
async fn broker_ceilings(bench: &Bench) -> anyhow::Result<Vec<BrokerCeiling>> {
    let opts = &bench.opts;
    let mut out = Vec::new();
    if opts.broker_ceiling_duration <= 0.0 {
        return Ok(out);
    }
    // This process publishes: its CPU is the publisher's. The sampler needs one
    // tick to see the role before the window opens.
    bench.cpu.track("publisher", std::process::id());
    tokio::time::sleep(Duration::from_millis(400)).await;
    for in_flight in [1, opts.concurrency] {
        eprintln!(
            "== ceiling: the service's Kafka publisher, {in_flight} publishes in flight, {:.0} s",
            opts.broker_ceiling_duration
        );
        let from = now_unix_ms();
        let mut c = ceiling::broker_publish(
            &bench.settings.kafka,
            in_flight,
            Duration::from_secs_f64(opts.broker_ceiling_duration),
        )
        .await?;
        c.cpu = Some(bench.cpu.window(from, now_unix_ms()));
        out.push(c);
    }
    bench.cpu.untrack("publisher");
    Ok(out)
}
