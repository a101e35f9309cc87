//! The mega-sale: `--mega-units` units (100,000) for `--mega-users` users
//! (1,000,000) with a token each, every user clicking `--mega-clicks` times
//! (twice), once with open admission and once through a waiting room that all
//! of them join before the start, for each of `--mega-shards` (1 and 3). The
//! service runs as a deployment configures it (`FLASHSALE_ENV=production`:
//! JSON logs at info); beside it, the flood's compared phases run with both
//! that configuration and the quiet test one, for the floors and to show what
//! the logging costs.
//!
//! Per sale: the time to sell out, every answer by code, the time until every
//! order is in MySQL, Redis's memory per buyer and per joiner (`MEMORY USAGE`
//! of the sale's keys), the service's peak RSS, the draw's duration, joins per
//! second, the time until every waiting user knows their outcome, and CPU and
//! Redis commands per request by phase (cut from the crowd's timeline). Then
//! [`scale`]: what a sale of `--mega-target-users` in `--mega-target-seconds`
//! needs, from these figures.
//!
//! The crowd ([`crowd`]) talks to the public HTTP API only, so this section
//! measures whatever the service's stock, waiting room and auth do today.

pub mod crowd;
pub mod scale;
pub mod tokens;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use hyper::{Method, StatusCode};
use secrecy::ExposeSecret;
use testkit::sale::SaleSpec;

use crate::ceiling::BrokerCeiling;
use crate::client::expect_json;
use crate::context::Bench;
use crate::loadgen::signer;
use crate::machine;
use crate::model::{EnvFlood, KeysMemory, MegaSection, MegaVariant, PhaseCost, ServerCheck};
use crate::process::{keep_log_head, ServerChild};
use crate::server::StrategyKind;
use crate::with_database;
use crowd::{CrowdPlan, CrowdRun, Sample};
use scale::ScaleInputs;
use tokens::TokenBook;

/// The configuration a deployment runs (`config/production.toml`).
pub const DEPLOYED_ENV: &str = "production";
/// The quiet configuration the tests run.
pub const QUIET_ENV: &str = "test";

/// Settings every server of the section gets on top of its configuration.
fn server_env() -> Vec<(&'static str, String)> {
    vec![
        // The broker on the development machine is tansu 0.6: its known
        // defects worked around (the producer without idempotence); real
        // Kafka runs with "none".
        ("FLASHSALE__KAFKA__BROKER_QUIRKS", "tansu-0.6".into()),
        // Stopping a benchmark server waits for no load balancer.
        ("FLASHSALE__SERVER__DRAIN_DELAY_SECS", "0".into()),
        // Its buyers mark their own orders paid (payments.provider = none),
        // which production refuses unless told it is meant.
        ("FLASHSALE__PAYMENTS__ALLOW_UNVERIFIED", "true".into()),
    ]
}

pub async fn section(
    bench: &mut Bench,
    broker: Option<&BrokerCeiling>,
) -> anyhow::Result<MegaSection> {
    let o = bench.opts.clone();
    let mut envs = Vec::new();
    if o.flood_duration > 0.0 {
        for env in [DEPLOYED_ENV, QUIET_ENV] {
            eprintln!("== mega: the flood's compared phases with FLASHSALE_ENV={env}");
            let (runs, log_bytes) =
                crate::flood::compared_in(bench, env, &server_env(), env).await?;
            envs.push(EnvFlood {
                env: env.to_owned(),
                runs,
                log_bytes,
            });
        }
    }
    eprintln!("== mega: signing {} user tokens", o.mega_users);
    let auth = signer(&bench.settings.auth)?;
    let book = Arc::new(TokenBook::sign(&auth, "mega-", o.mega_users, 6 * 3600)?);
    eprintln!(
        "== mega: {} tokens in {:.1} s, {:.0} MiB held",
        book.len(),
        book.signed_in_s,
        book.bytes_held() as f64 / 1048576.0
    );
    let mut variants = Vec::new();
    for &shards in &o.mega_shards {
        for room in [false, true] {
            variants.push(variant(bench, &book, shards, room).await?);
        }
    }
    let scale = variants
        .iter()
        .filter(|v| v.admission == "open")
        .filter_map(|v| scale_inputs(v, broker, &bench.settings, &o))
        .map(scale::plan)
        .collect();
    Ok(MegaSection {
        users: o.mega_users,
        units: o.mega_units,
        clicks: o.mega_clicks,
        connections: o.concurrency,
        env: DEPLOYED_ENV.into(),
        tokens_signed_in_s: book.signed_in_s,
        token_bytes: book.bytes_held() as u64,
        envs,
        variants,
        scale,
        classes: crowd::CLASSES.iter().map(|c| (*c).to_owned()).collect(),
        kinds: crowd::KINDS.iter().map(|c| (*c).to_owned()).collect(),
    })
}

/// One sale on a service of its own (so its peak memory is this sale's).
async fn variant(
    bench: &mut Bench,
    book: &Arc<TokenBook>,
    shards: u8,
    room: bool,
) -> anyhow::Result<MegaVariant> {
    let label = format!("{}-k{shards}", if room { "room" } else { "open" });
    let log = bench.runs_dir.join(format!("mega-{label}.log"));
    let server = bench
        .start_server_in(
            StrategyKind::Service,
            DEPLOYED_ENV,
            &server_env(),
            Some(&log),
        )
        .await?;
    let rss_at_start_kib = server
        .pid()
        .and_then(machine::process_memory_kib)
        .map(|m| m.0);
    let sold = sell(bench, &server, book, shards, room).await;
    let peak_rss_kib = server
        .pid()
        .and_then(machine::process_memory_kib)
        .map(|m| m.1);
    let stopped = server.stop().await;
    let log_bytes = keep_log_head(&log)?;
    // Once the service is gone (a running one would rebuild a sale it finds
    // missing from Redis): a million users' keys must not stay in a shared Redis.
    let redis_url = &bench.settings.redis.url;
    for id in bench.forget.drain(..) {
        forget_keys(redis_url, &id).await;
    }
    let mut v = sold?;
    stopped?;
    v.rss_at_start_kib = rss_at_start_kib;
    v.peak_rss_kib = peak_rss_kib;
    v.log_bytes = log_bytes;
    Ok(v)
}

async fn sell(
    bench: &mut Bench,
    server: &ServerChild,
    book: &Arc<TokenBook>,
    shards: u8,
    room: bool,
) -> anyhow::Result<MegaVariant> {
    let o = bench.opts.clone();
    let admission = if room { "waiting room" } else { "open" };
    let redis_url = bench.settings.redis.url.clone();
    let (calibrated, lead) = if room {
        let rate = calibrate_joins(bench, server, book).await?;
        // Every join and one poll each before the start (a poll costs less
        // than a join), with a margin for a slower moment.
        let lead = (o.mega_users as f64 / rate.max(1.0) * 2.3 + 5.0).ceil();
        if lead > 590.0 {
            eprintln!(
                "== mega: warning: {lead:.0} s of joins and polls is past the room's 600 s opening; some users will join late or not poll before the start"
            );
        }
        (Some(rate), Some(lead.min(590.0)))
    } else {
        (None, None)
    };
    let spec = SaleSpec {
        sku: Some(bench.next_sku(StrategyKind::Service, &format!("mega-k{shards}"))),
        stock_shards: shards,
        payment_timeout_secs: 3600,
        starts_in_secs: lead.map_or(-5, |l| l as i64),
        waiting_room: room,
        ..SaleSpec::new(o.mega_units)
    };
    eprintln!(
        "== mega: {admission}, stock_shards = {shards}: {} units, {} users × {} clicks{}",
        o.mega_units,
        o.mega_users,
        o.mega_clicks,
        lead.map_or(String::new(), |l| format!(
            ", the start {l:.0} s ahead ({:.0} joins/s measured)",
            calibrated.unwrap_or(0.0)
        ))
    );
    let activity = bench.open_service_sale(server, &spec).await?;
    bench.forget.push(activity.clone());
    let starts_at = if room {
        Some(starts_at(bench, server, &activity).await?)
    } else {
        None
    };
    let mysql_url = with_database(
        bench.settings.mysql.url.expose_secret(),
        &server.announce.database,
    );
    let crowd_t0 = Instant::now();
    let watch = OrdersWatch::start(&mysql_url, &activity, crowd_t0).await?;
    let after_joins: Arc<Mutex<Option<KeysMemory>>> = Arc::default();
    let plan = CrowdPlan {
        addr: server.addr,
        sku: spec.sku.clone().unwrap_or_default(),
        tokens: book.clone(),
        users: o.mega_users,
        clicks: o.mega_clicks,
        connections: o.concurrency,
        request_timeout: Duration::from_secs_f64(o.request_timeout),
        max_duration: Duration::from_secs_f64(o.mega_max_duration),
        server_pid: server.pid(),
        redis_url: redis_url.clone(),
        room_starts_at: starts_at,
    };
    let crowd = {
        let after_joins = after_joins.clone();
        let (url, id) = (redis_url.clone(), activity.clone());
        crowd::run(plan, move || async move {
            let m = keys_memory(&url, &id).await.ok();
            *after_joins.lock().unwrap_or_else(|p| p.into_inner()) = m;
        })
        .await?
    };
    let redis_at_end = keys_memory(&redis_url, &activity).await?;
    let probe = bench.probe(server, redis_url.clone(), &activity);
    let quiet = probe
        .wait_quiet(Duration::from_secs_f64(o.drain_timeout))
        .await;
    let checked = probe.check(&[]).await;
    let (orders, orders_done_s) = watch.finish().await?;
    let redis_after_drain = keys_memory(&redis_url, &activity).await?;
    let check = verdict(quiet, checked, &crowd, orders);
    let phases = phases(&crowd);
    let redis_after_joins = *after_joins.lock().unwrap_or_else(|p| p.into_inner());
    Ok(MegaVariant {
        admission: admission.into(),
        stock_shards: shards,
        activity_id: activity,
        units: o.mega_units,
        calibrated_joins_per_s: calibrated,
        lead_s: lead,
        crowd,
        orders_done_s,
        orders,
        redis_after_joins,
        redis_at_end,
        redis_after_drain,
        rss_at_start_kib: None,
        peak_rss_kib: None,
        log_bytes: 0,
        phases,
        check,
    })
}

/// Joins per second on a room of its own (a twentieth of the users, at least
/// 2,000), to set the real room's start far enough ahead.
async fn calibrate_joins(
    bench: &mut Bench,
    server: &ServerChild,
    book: &Arc<TokenBook>,
) -> anyhow::Result<f64> {
    let o = bench.opts.clone();
    let spec = SaleSpec {
        sku: Some(bench.next_sku(StrategyKind::Service, "mega-calibration")),
        starts_in_secs: 590,
        waiting_room: true,
        ..SaleSpec::new(1)
    };
    let activity = bench.open_service_sale(server, &spec).await?;
    bench.forget.push(activity);
    let users = (o.mega_users / 20).max(2_000).min(o.mega_users);
    let plan = CrowdPlan {
        addr: server.addr,
        sku: spec.sku.clone().unwrap_or_default(),
        tokens: book.clone(),
        users,
        clicks: 1,
        connections: o.concurrency,
        request_timeout: Duration::from_secs_f64(o.request_timeout),
        max_duration: Duration::from_secs(300),
        server_pid: None,
        redis_url: String::new(),
        room_starts_at: None,
    };
    crowd::join_rate(plan).await
}

/// The room's `starts_at` as an instant of this process's clock.
async fn starts_at(bench: &Bench, server: &ServerChild, activity: &str) -> anyhow::Result<Instant> {
    let a = expect_json(
        server.addr,
        Method::GET,
        &format!("/admin/activities/{activity}"),
        Some(&bench.admin_token()),
        None,
        StatusCode::OK,
    )
    .await?;
    let at: chrono::DateTime<chrono::Utc> = a["starts_at"]
        .as_str()
        .context("the activity has no starts_at")?
        .parse()
        .context("starts_at is not a date")?;
    let ahead = (at - chrono::Utc::now()).to_std().unwrap_or(Duration::ZERO);
    Ok(Instant::now() + ahead)
}

/// Keys of the sale (any key naming its activity id, every shard and the
/// room) and their memory (`MEMORY USAGE … SAMPLES 0`: every element counted).
pub async fn keys_memory(redis_url: &str, activity: &str) -> anyhow::Result<KeysMemory> {
    let mut conn = redis_conn(redis_url).await?;
    let keys = sale_keys(&mut conn, activity).await?;
    let mut bytes = 0u64;
    for key in &keys {
        let b: Option<u64> = redis::cmd("MEMORY")
            .arg("USAGE")
            .arg(key)
            .arg("SAMPLES")
            .arg(0)
            .query_async(&mut conn)
            .await
            .with_context(|| format!("MEMORY USAGE {key}"))?;
        bytes += b.unwrap_or(0);
    }
    Ok(KeysMemory {
        keys: keys.len() as u64,
        bytes,
    })
}

async fn redis_conn(url: &str) -> anyhow::Result<redis::aio::MultiplexedConnection> {
    redis::Client::open(url)
        .context("invalid redis url")?
        .get_multiplexed_async_connection()
        .await
        .context("failed to connect to Redis")
}

async fn sale_keys(
    conn: &mut redis::aio::MultiplexedConnection,
    activity: &str,
) -> anyhow::Result<Vec<String>> {
    let mut keys = Vec::new();
    let mut cursor: u64 = 0;
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("*{activity}*"))
            .arg("COUNT")
            .arg(10_000)
            .query_async(conn)
            .await
            .context("SCAN failed")?;
        keys.extend(batch);
        if next == 0 {
            return Ok(keys);
        }
        cursor = next;
    }
}

/// Deletes the sale's keys (a failure is only reported).
async fn forget_keys(redis_url: &str, activity: &str) {
    let result: anyhow::Result<()> = async {
        let mut conn = redis_conn(redis_url).await?;
        let keys = sale_keys(&mut conn, activity).await?;
        for chunk in keys.chunks(100) {
            let _: i64 = redis::cmd("UNLINK")
                .arg(chunk)
                .query_async(&mut conn)
                .await
                .context("UNLINK failed")?;
        }
        Ok(())
    }
    .await;
    if let Err(e) = result {
        eprintln!("== mega: could not delete the keys of {activity}: {e:#}");
    }
}

/// Counts the sale's orders in MySQL every 200 ms while the sale goes on.
struct OrdersWatch {
    stop: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<anyhow::Result<Vec<(f64, i64)>>>,
    pool: sqlx::MySqlPool,
    activity: String,
    t0: Instant,
}

impl OrdersWatch {
    async fn start(mysql_url: &str, activity: &str, t0: Instant) -> anyhow::Result<OrdersWatch> {
        let pool = sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(1)
            .connect(mysql_url)
            .await
            .context("failed to connect to the sale's database")?;
        let stop = tokio_util::sync::CancellationToken::new();
        let task = {
            let (pool, stop, activity) = (pool.clone(), stop.clone(), activity.to_owned());
            tokio::spawn(async move {
                let mut counts: Vec<(f64, i64)> = Vec::new();
                let mut tick = tokio::time::interval(Duration::from_millis(200));
                loop {
                    tokio::select! {
                        _ = stop.cancelled() => return Ok(counts),
                        _ = tick.tick() => {}
                    }
                    let n = count_orders(&pool, &activity).await?;
                    if counts.last().is_none_or(|(_, last)| *last != n) {
                        counts.push((t0.elapsed().as_secs_f64(), n));
                    }
                }
            })
        };
        Ok(OrdersWatch {
            stop,
            task,
            pool,
            activity: activity.to_owned(),
            t0,
        })
    }

    /// The final count, and when it was first seen (seconds from `t0`).
    async fn finish(self) -> anyhow::Result<(i64, Option<f64>)> {
        self.stop.cancel();
        let counts = self.task.await.context("the orders watch failed")??;
        let last = count_orders(&self.pool, &self.activity).await?;
        let at = counts
            .iter()
            .find(|(_, n)| *n == last)
            .map(|(t, _)| *t)
            .or_else(|| Some(self.t0.elapsed().as_secs_f64()));
        self.pool.close().await;
        Ok((last, at.filter(|_| last > 0)))
    }
}

async fn count_orders(pool: &sqlx::MySqlPool, activity: &str) -> anyhow::Result<i64> {
    sqlx::query_scalar("SELECT COUNT(*) FROM orders WHERE activity_id = ?")
        .bind(activity)
        .fetch_one(pool)
        .await
        .context("failed to count the orders")
}

/// The test kit's invariants once quiet, and what the crowd saw.
fn verdict(
    quiet: Result<(), String>,
    checked: Result<testkit::invariants::Figures, String>,
    crowd: &CrowdRun,
    orders: i64,
) -> ServerCheck {
    let mut notes = Vec::new();
    if let Err(e) = quiet {
        notes.push(format!("not quiet when the wait ended: {e}"));
    }
    if let Err(e) = checked {
        notes.push(e);
    }
    if orders != crowd.accepted as i64 {
        notes.push(format!(
            "{orders} orders in MySQL for {} answers 202",
            crowd.accepted
        ));
    }
    if crowd.users_with_several_wins > 0 {
        notes.push(format!("{} users won twice", crowd.users_with_several_wins));
    }
    if crowd.timed_out || crowd.known as usize != crowd.users {
        notes.push(format!(
            "{} of {} users never learnt their outcome",
            crowd.users - crowd.known as usize,
            crowd.users
        ));
    }
    let ok = notes.is_empty();
    if ok {
        notes.push(format!(
            "{orders} orders in MySQL = 202s; no user twice; every user learnt their outcome; invariants hold"
        ));
    }
    ServerCheck { ok, notes }
}

/// The crowd's timeline cut into its phases.
fn phases(c: &CrowdRun) -> Vec<PhaseCost> {
    let end = c.ended_s;
    let mut cuts: Vec<(&str, f64, f64)> = Vec::new();
    match (c.joins_ended_s, c.starts_s) {
        (Some(joined), Some(start)) => {
            cuts.push(("joining", 0.0, joined));
            let mut waited_from = joined;
            if let Some(polled) = c.early_polls_ended_s {
                cuts.push(("polling before the start", joined, polled));
                waited_from = polled;
            }
            if start > waited_from {
                cuts.push(("waiting for the start", waited_from, start));
            }
            let sold = c.last_accept_s.unwrap_or(end).max(start);
            cuts.push(("selling", start, sold));
            cuts.push((
                "after the sell-out",
                sold,
                c.last_known_s.unwrap_or(end).max(sold),
            ));
        }
        _ => {
            let sold = c.last_accept_s.unwrap_or(end);
            cuts.push(("selling", 0.0, sold));
            cuts.push(("sold out", sold, end));
        }
    }
    cuts.push(("whole sale", 0.0, end));
    cuts.into_iter()
        .filter_map(|(name, from, to)| phase_cost(&c.samples, name, from, to))
        .collect()
}

/// The samples around `[from_s, to_s]`: the last at or before its start, the
/// first at or after its end.
fn phase_cost(samples: &[Sample], name: &str, from_s: f64, to_s: f64) -> Option<PhaseCost> {
    let a = samples.iter().rposition(|s| s.t_s <= from_s).unwrap_or(0);
    let b = samples
        .iter()
        .position(|s| s.t_s >= to_s)
        .unwrap_or(samples.len().checked_sub(1)?);
    if b <= a {
        return None;
    }
    let (sa, sb) = (&samples[a], &samples[b]);
    let diff_u = |x: Option<u64>, y: Option<u64>| x.zip(y).map(|(x, y)| y.saturating_sub(x));
    let diff_f = |x: Option<f64>, y: Option<f64>| x.zip(y).map(|(x, y)| y - x);
    let by_kind: Vec<u64> = sb
        .kinds
        .iter()
        .zip(&sa.kinds)
        .map(|(b, a)| b.saturating_sub(*a))
        .collect();
    let requests = by_kind.iter().sum();
    let seconds = sb.t_s - sa.t_s;
    Some(PhaseCost {
        name: name.to_owned(),
        from_s: sa.t_s,
        to_s: sb.t_s,
        by_kind,
        requests,
        accepted: sb.accepted.saturating_sub(sa.accepted),
        rps: requests as f64 / seconds.max(1e-9),
        service_cpu_s: diff_f(sa.server_cpu_s, sb.server_cpu_s),
        redis_commands: diff_u(sa.redis_commands, sb.redis_commands),
        redis_script_calls: diff_u(sa.redis_script_calls, sb.redis_script_calls),
        redis_cpu_s: diff_f(sa.redis_cpu_s, sb.redis_cpu_s),
    })
}

/// The scale plan's inputs from an open sale.
fn scale_inputs(
    v: &MegaVariant,
    broker: Option<&BrokerCeiling>,
    settings: &flashsale::config::Settings,
    o: &crate::options::SuiteOptions,
) -> Option<ScaleInputs> {
    let whole = v.phase("whole sale")?;
    let first = v.crowd.first_accept_s?;
    let done = v.orders_done_s?;
    Some(ScaleInputs {
        users: v.crowd.users as u64,
        requests: whole.requests,
        units: v.crowd.accepted,
        stock_shards: v.stock_shards,
        service_cpu_s: whole.service_cpu_s?,
        redis_cpu_s: whole.redis_cpu_s?,
        broker_rps: broker.map_or(0.0, |b| b.rps),
        broker_partitions: settings.kafka.partitions.try_into().unwrap_or(1),
        consumer_orders_per_s: v.orders as f64 / (done - first).max(1e-3),
        target_users: o.mega_target_users,
        target_seconds: o.mega_target_seconds,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(t_s: f64, requests: u64, cpu_s: f64, commands: u64) -> Sample {
        Sample {
            t_s,
            answers: vec![0; crowd::CLASSES.len()],
            kinds: vec![0, 0, requests, 0],
            known: 0,
            accepted: requests / 2,
            server_rss_kib: Some(1),
            server_cpu_s: Some(cpu_s),
            redis_used_memory: Some(1),
            redis_commands: Some(commands),
            redis_script_calls: Some(commands / 10),
            redis_cpu_s: Some(0.0),
        }
    }

    #[test]
    fn a_phase_is_cut_between_the_samples_around_it() {
        let samples = [
            sample(0.0, 0, 0.0, 0),
            sample(0.25, 1_000, 0.02, 10_000),
            sample(0.5, 3_000, 0.06, 30_000),
            sample(0.75, 4_000, 0.08, 40_000),
        ];
        let p = phase_cost(&samples, "selling", 0.3, 0.6).expect("a phase");
        assert_eq!((p.from_s, p.to_s), (0.25, 0.75));
        assert_eq!(p.requests, 3_000);
        assert_eq!(p.accepted, 1_500);
        assert!((p.cpu_us_per_request().expect("cpu") - 20.0).abs() < 1e-6);
        assert!((p.redis_commands_per_request().expect("commands") - 10.0).abs() < 1e-9);
        assert!((p.script_calls_per_request().expect("calls") - 1.0).abs() < 1e-9);
        // A phase past the last sample has nothing to cut.
        assert!(phase_cost(&samples, "later", 0.75, 2.0).is_none());
    }

    #[test]
    fn open_and_room_sales_have_their_phases() {
        let open = CrowdRun {
            last_accept_s: Some(0.3),
            ended_s: 0.7,
            samples: vec![
                sample(0.0, 0, 0.0, 0),
                sample(0.25, 10, 0.0, 0),
                sample(0.5, 20, 0.0, 0),
                sample(0.75, 30, 0.0, 0),
            ],
            ..CrowdRun::default()
        };
        let names: Vec<String> = phases(&open).into_iter().map(|p| p.name).collect();
        assert_eq!(names, ["selling", "sold out", "whole sale"]);
        let room = CrowdRun {
            joins_ended_s: Some(0.2),
            starts_s: Some(0.4),
            last_accept_s: Some(0.55),
            last_known_s: Some(0.7),
            ..open
        };
        let names: Vec<String> = phases(&room).into_iter().map(|p| p.name).collect();
        assert_eq!(
            names,
            [
                "joining",
                "waiting for the start",
                "selling",
                "after the sell-out",
                "whole sale"
            ]
        );
    }
}
