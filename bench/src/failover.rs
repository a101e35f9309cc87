//! A Redis Cluster failover under a sale, as the buyers see it.
//!
//! The service runs on a Cluster of its own (3 primaries, 2 replicas each,
//! `cluster-node-timeout` 2 s) with `redis.min_replicas_acked = 1`, as the fault
//! suite's `cluster_failover` runs it: every `202` was on a replica first. The
//! service's rate on that Cluster is measured first (the load generator, closed
//! loop at the suite's concurrency, users clicking twice on a sale that never
//! sells out). Then a sale is driven open loop at half that rate, every user
//! clicking twice (a `202` and a `409 already_reserved` while Redis serves). A
//! few seconds in, the primary that owns the sale's slot is SIGKILLed; the
//! Cluster promotes one of its replicas; halfway through the rest of the sale
//! the dead node is started again on its old address, empty, as its supervisor
//! would, and rejoins as a replica; the sale goes on until `--failover-after`
//! seconds past the promotion.
//!
//! Every request is a test-kit [`Sample`] (sent and received instants, status,
//! code, reservation id): the answers per 100 ms by status, the time without
//! service from the kill and from the promotion ([`Outage::measure`], as the
//! fault suite measures it), and, once the sale is quiet, the invariants by the
//! test kit's checker.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use testkit::availability::{Outage, Sample};
use testkit::invariants::{Answer, Probe};
use testkit::process::RedisCluster;
use testkit::sale::SaleSpec;

use crate::context::Bench;
use crate::loadgen::{issue_tokens, signer, UserToken};
use crate::model::{AnswerBucket, FailoverSection, ServerCheck};
use crate::process::{LoadArgs, ServerChild};
use crate::report::format::thousands;
use crate::server::StrategyKind;

/// Seconds of sale before the kill.
const BEFORE_S: f64 = 3.0;
/// The sale's pace, as a share of the rate measured on the same Cluster.
const RATE_SHARE: f64 = 0.5;
/// Every user clicks twice, the clicks sent one after the other.
const CLICKS: u32 = 2;
/// The rate measurement: seconds measured after a second of warm-up, and users
/// enough that it never runs out of them (nor its sale out of units).
const MEASURE_S: f64 = 3.0;
const MEASURE_WARMUP_S: f64 = 1.0;
const MEASURE_USERS: usize = 100_000;
/// How long the Cluster may take to promote a replica, and to be healthy again
/// once the dead node is back.
const PROMOTION_WITHIN: Duration = Duration::from_secs(30);
const HEALTHY_WITHIN: Duration = Duration::from_secs(60);
/// The sale goes on at least this long after the Cluster is healthy again.
const AFTER_HEALTHY: Duration = Duration::from_secs(2);
/// The plot's slices.
const BUCKET: Duration = Duration::from_millis(100);

/// The failover section: a Cluster of its own, the service on it, the rate
/// measured, then the sale through the kill.
pub async fn section(bench: &mut Bench) -> anyhow::Result<FailoverSection> {
    let mut nodes = crate::cluster::start_cluster(&bench.runs_dir.join("failover")).await?;
    let server = bench
        .start_server(
            StrategyKind::Service,
            &[
                ("FLASHSALE__REDIS__URL", nodes.url()),
                ("FLASHSALE__REDIS__MIN_REPLICAS_ACKED", "1".into()),
                // Above a fresh replica's first acknowledgement interval (1 s).
                ("FLASHSALE__REDIS__REPLICA_ACK_TIMEOUT_MS", "1000".into()),
            ],
        )
        .await?;
    let outcome = run(bench, &mut nodes, &server).await;
    let stopped = server.stop().await;
    drop(nodes);
    let section = outcome?;
    stopped?;
    Ok(section)
}

/// When each step of the fault happened.
struct Marks {
    killed: Instant,
    killed_port: u16,
    promoted: Instant,
    promoted_port: u16,
    returned: Instant,
    healthy: Instant,
    ended: Instant,
}

/// The sale to be driven through the fault.
struct FaultSale {
    activity: String,
    /// The key of the sale's stock, whose slot's primary is killed.
    key: String,
    primary: u16,
    url: String,
    users: Vec<UserToken>,
    rate: f64,
}

async fn run(
    bench: &mut Bench,
    nodes: &mut RedisCluster,
    server: &ServerChild,
) -> anyhow::Result<FailoverSection> {
    let opts = bench.opts.clone();
    let units = opts.failover_units;
    let after = Duration::from_secs_f64(opts.failover_after.max(1.0));
    let measured_rps = measure_rate(bench, nodes, server).await?;
    let sale = open_fault_sale(bench, nodes, server, measured_rps * RATE_SHARE, after).await?;
    eprintln!(
        "== failover: {units} units, {:.0} req/s (half of the measured {measured_rps:.0}), users clicking twice; the primary on {} killed after {BEFORE_S:.0} s",
        sale.rate, sale.primary
    );
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs_f64(opts.request_timeout))
        .build()
        .context("failed to build the HTTP client")?;
    let stop = Arc::new(AtomicBool::new(false));
    let t0 = Instant::now();
    let driver = tokio::spawn(drive(
        client,
        sale.url,
        sale.users,
        sale.rate,
        t0,
        stop.clone(),
    ));
    let marks = fault(nodes, &sale.key, sale.primary, t0, after).await;
    stop.store(true, Ordering::SeqCst);
    let samples = driver.await.context("the sale's driver failed")?;
    let marks = marks?;
    let last_answer = samples
        .iter()
        .map(|s| s.received)
        .max()
        .unwrap_or_else(Instant::now);

    eprintln!("== failover: the sale done, waiting for it to be quiet");
    let answers: Vec<Answer> = samples.iter().map(|s| s.answer.clone()).collect();
    let checker = bench.probe(server, nodes.url(), &sale.activity);
    let quiet = checker
        .wait_quiet(Duration::from_secs_f64(opts.drain_timeout))
        .await;
    let drain_s = quiet.is_ok().then(|| last_answer.elapsed().as_secs_f64());
    let invariants = match quiet {
        Err(e) => ServerCheck {
            ok: false,
            notes: vec![e],
        },
        Ok(()) => check(&checker, &answers).await,
    };
    let run = RunFigures {
        units,
        measured_rps,
        measure_connections: opts.concurrency,
        rate: sale.rate,
        invariants,
        drain_s,
    };
    Ok(section_of(run, &samples, &marks, t0))
}

/// The service's rate on this Cluster, with its replica barrier; its orders
/// written before the sale begins, so the consumer's backlog is not the failover's.
async fn measure_rate(
    bench: &mut Bench,
    nodes: &RedisCluster,
    server: &ServerChild,
) -> anyhow::Result<f64> {
    let sku = bench.next_sku(StrategyKind::Service, "failover-rate");
    let activity = bench
        .open_sale(server, &sku, MEASURE_USERS as u64)
        .await?
        .context("the service's sale has no id")?;
    eprintln!(
        "== failover: the service's rate on the Cluster (min_replicas_acked = 1), {} connections",
        bench.opts.concurrency
    );
    let (measured, _) = bench
        .loadtest
        .run(
            &bench.cpu,
            server.addr,
            &LoadArgs {
                label: "failover: the rate on the Cluster".into(),
                sku,
                users: MEASURE_USERS,
                clicks: CLICKS,
                rate: None,
                duration: MEASURE_S,
                warmup: MEASURE_WARMUP_S,
                units: Some(MEASURE_USERS as u64),
            },
            bench.runs_dir.join("failover-rate.json"),
        )
        .await?;
    let measured_rps = measured.throughput_rps;
    if measured_rps < 10.0 {
        bail!(
            "the service answered {measured_rps:.0} req/s on the Cluster ({})",
            crate::report::format::answers(&measured)
        );
    }
    bench
        .probe(server, nodes.url(), &activity)
        .wait_quiet(Duration::from_secs_f64(bench.opts.drain_timeout))
        .await
        .map_err(anyhow::Error::msg)
        .context("the rate measurement's sale never went quiet")?;
    Ok(measured_rps)
}

/// Opens the sale of `--failover-units`, finds the primary of its slot and signs
/// enough users for the whole fault at `rate`.
async fn open_fault_sale(
    bench: &mut Bench,
    nodes: &RedisCluster,
    server: &ServerChild,
    rate: f64,
    after: Duration,
) -> anyhow::Result<FaultSale> {
    let span = BEFORE_S
        + PROMOTION_WITHIN.as_secs_f64()
        + after.as_secs_f64()
        + HEALTHY_WITHIN.as_secs_f64() / 4.0;
    let users_n = (rate * span / f64::from(CLICKS)).ceil() as usize;
    let sku = bench.next_sku(StrategyKind::Service, "failover");
    let spec = SaleSpec {
        sku: Some(sku.clone()),
        payment_timeout_secs: 3600,
        ..SaleSpec::new(bench.opts.failover_units)
    };
    let activity = bench.open_service_sale(server, &spec).await?;
    let key = flashsale::stock::Keys::shard(&activity, 1, 0).stock;
    let primary = tokio::task::block_in_place(|| nodes.primary_for(&key))
        .context("no primary serves the sale's slot")?;
    let auth = signer(&bench.settings.auth)?;
    let users = issue_tokens(
        &auth,
        &format!("failover-{}-", &activity[..8.min(activity.len())]),
        users_n,
        3600,
    )?;
    Ok(FaultSale {
        activity,
        key,
        primary,
        url: format!("http://{}/flash/{sku}/reserve", server.addr),
        users,
        rate,
    })
}

/// The invariants by the test kit's checker, on a sale already quiet.
async fn check(checker: &Probe, answers: &[Answer]) -> ServerCheck {
    match checker.check(answers).await {
        Ok(f) => {
            let mut notes = vec![format!(
                "{} `202`s, each an order; no oversell, one order per user, stock conserved in Redis and MySQL, every answer documented",
                thousands(f.accepted as f64)
            )];
            // One order per user and every 202 an order: the rest are
            // orders of buyers who never got a 202.
            let unanswered = f.live_orders + f.cancelled - f.accepted_ordered as i64;
            if unanswered > 0 {
                notes.push(format!(
                    "{unanswered} orders of buyers never answered `202` (their clicks got `503`, no answer or `409 already_reserved`)"
                ));
            }
            notes.push(format!(
                "live orders {}, failed {}, reservations withdrawn {}",
                thousands(f.live_orders as f64),
                f.failed,
                f.withdrawn
            ));
            ServerCheck { ok: true, notes }
        }
        Err(e) => ServerCheck {
            ok: false,
            notes: e.lines().map(str::to_owned).collect(),
        },
    }
}

/// What the section knows before it reads the answers one by one.
struct RunFigures {
    units: u32,
    measured_rps: f64,
    measure_connections: usize,
    rate: f64,
    invariants: ServerCheck,
    drain_s: Option<f64>,
}

/// The section: the run's figures, and what the answers say about the fault
/// (the gaps, the timeline, the counts).
fn section_of(run: RunFigures, samples: &[Sample], marks: &Marks, t0: Instant) -> FailoverSection {
    let from_kill = Outage::measure(samples, marks.killed);
    let from_promotion = Outage::measure(samples, marks.promoted);
    let after_return: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.sent >= marks.returned)
        .collect();
    let since_kill = |t: Instant| t.saturating_duration_since(marks.killed).as_secs_f64();
    let first_sent = samples.iter().map(|s| s.sent).min().unwrap_or(t0);
    let last_sent = samples.iter().map(|s| s.sent).max().unwrap_or(t0);
    let sent_s = last_sent
        .saturating_duration_since(first_sent)
        .as_secs_f64();
    FailoverSection {
        units: run.units,
        users: samples.len().div_ceil(CLICKS as usize),
        clicks: CLICKS,
        measured_rps: run.measured_rps,
        measure_connections: run.measure_connections,
        rate: run.rate,
        rate_share: RATE_SHARE,
        sent: samples.len(),
        sent_rps: if sent_s > 0.0 {
            samples.len() as f64 / sent_s
        } else {
            0.0
        },
        killed_port: marks.killed_port,
        promoted_port: marks.promoted_port,
        before_s: marks.killed.saturating_duration_since(t0).as_secs_f64(),
        promoted_after_s: since_kill(marks.promoted),
        returned_after_s: since_kill(marks.returned),
        healthy_after_s: since_kill(marks.healthy),
        ended_after_s: since_kill(marks.ended),
        gap_from_kill_ms: from_kill.gap.map(|d| d.as_secs_f64() * 1000.0),
        gap_from_promotion_ms: from_promotion.gap.map(|d| d.as_secs_f64() * 1000.0),
        later_gap_ms: (from_promotion.later_gap != Duration::MAX)
            .then_some(from_promotion.later_gap.as_secs_f64() * 1000.0),
        sent_after_return: after_return.len(),
        unserved_after_return: after_return.iter().filter(|s| !s.served()).count(),
        answers: by_code(samples),
        bucket_ms: BUCKET.as_millis() as u64,
        timeline: timeline(samples, marks.killed),
        invariants: run.invariants,
        drain_s: run.drain_s,
    }
}

/// The fault while the sale runs: the kill after [`BEFORE_S`], the promotion,
/// the dead node back on its old address halfway through `after`, and the end
/// `after` past the promotion (and at least [`AFTER_HEALTHY`] past the Cluster's
/// recovery).
async fn fault(
    nodes: &mut RedisCluster,
    key: &str,
    primary: u16,
    t0: Instant,
    after: Duration,
) -> anyhow::Result<Marks> {
    tokio::time::sleep_until((t0 + Duration::from_secs_f64(BEFORE_S)).into()).await;
    let killed = Instant::now();
    tokio::task::block_in_place(|| nodes.kill(primary));
    let (promoted_port, promoted) = loop {
        let now = tokio::task::block_in_place(|| nodes.primary_for(key));
        if let Some(p) = now.filter(|p| *p != primary) {
            break (p, Instant::now());
        }
        if killed.elapsed() > PROMOTION_WITHIN {
            bail!("no replica was promoted within {PROMOTION_WITHIN:?} of the kill");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    eprintln!(
        "== failover: {primary} killed, {promoted_port} promoted {:.2} s later",
        promoted.duration_since(killed).as_secs_f64()
    );
    tokio::time::sleep_until((promoted + after / 2).into()).await;
    let returned = Instant::now();
    tokio::task::block_in_place(|| nodes.restart(primary));
    tokio::task::block_in_place(|| nodes.wait_healthy(HEALTHY_WITHIN))
        .map_err(anyhow::Error::msg)
        .context("the Cluster was not healthy again after the node's return")?;
    let healthy = Instant::now();
    eprintln!(
        "== failover: {primary} back on its old address, the Cluster healthy {:.2} s later",
        healthy.duration_since(returned).as_secs_f64()
    );
    tokio::time::sleep_until((promoted + after).max(healthy + AFTER_HEALTHY).into()).await;
    Ok(Marks {
        killed,
        killed_port: primary,
        promoted,
        promoted_port,
        returned,
        healthy,
        ended: Instant::now(),
    })
}

/// Open loop: request `i` leaves at `t0 + i / rate` whatever the answers do,
/// each user's two clicks one after the other, until `stop` (or the users run
/// out). Returns every answer once the last is in.
async fn drive(
    client: reqwest::Client,
    url: String,
    users: Vec<UserToken>,
    rate: f64,
    t0: Instant,
    stop: Arc<AtomicBool>,
) -> Vec<Sample> {
    let clicks = CLICKS as usize;
    let mut requests = Vec::with_capacity(users.len() * clicks);
    for i in 0..users.len() * clicks {
        let due = t0 + Duration::from_secs_f64(i as f64 / rate);
        tokio::time::sleep_until(due.into()).await;
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let request = client.post(&url).header(
            reqwest::header::AUTHORIZATION,
            users[i / clicks].authorization.clone(),
        );
        requests.push(tokio::spawn(Sample::take(request, 0)));
    }
    let mut samples = Vec::with_capacity(requests.len());
    for r in requests {
        if let Ok(s) = r.await {
            samples.push(s);
        }
    }
    samples
}

/// The status of an answer as the plot groups them.
fn status(s: &Sample) -> String {
    s.answer
        .status
        .map_or_else(|| "lost".to_owned(), |c| c.to_string())
}

/// Every answer by status and code, as the checker names them.
fn by_code(samples: &[Sample]) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for s in samples {
        let key = match (s.answer.status, &s.answer.code) {
            (Some(st), Some(c)) => format!("{st} {c}"),
            (Some(st), None) => st.to_string(),
            (None, _) => "lost".into(),
        };
        *out.entry(key).or_insert(0) += 1;
    }
    out
}

/// Answers per [`BUCKET`] by the instant they arrived, from the kill; every
/// slice from the first answer to the last, empty ones included.
fn timeline(samples: &[Sample], killed: Instant) -> Vec<AnswerBucket> {
    let step = BUCKET.as_millis() as i64;
    let mut slices: BTreeMap<i64, BTreeMap<String, u64>> = BTreeMap::new();
    for s in samples {
        *slices
            .entry(s.received_ms_from(killed).div_euclid(step))
            .or_default()
            .entry(status(s))
            .or_insert(0) += 1;
    }
    let (Some(first), Some(last)) = (
        slices.keys().next().copied(),
        slices.keys().next_back().copied(),
    ) else {
        return Vec::new();
    };
    (first..=last)
        .map(|k| AnswerBucket {
            t_s: (k * step) as f64 / 1000.0,
            codes: slices.remove(&k).unwrap_or_default(),
        })
        .collect()
}
