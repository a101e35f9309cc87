//! The day's figures that need a measurement of their own (the cost of a
//! poll), and the markdown report of the whole run.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use sqlx::{Connection, MySqlConnection};
use testkit::api::Caller;
use testkit::sale::Sale;
use tokio::task::JoinSet;

use super::shop::Shop;
use super::watch::{commands_between, questions_on, redis_figures, Point};
use super::{DayRun, Deployment};
use crate::side::SideQuery;

/// What one poll costs MySQL and Redis, measured on a quiet deployment: the
/// counters' growth over the polls, less their growth over as long with no
/// polls (the background work of every instance), less the side query's and
/// the measurement's own statements.
#[derive(Debug, Clone, Serialize)]
pub struct PollCost {
    pub kind: String,
    pub polls: usize,
    pub seconds: f64,
    pub answers: BTreeMap<u16, usize>,
    pub mysql_per_poll: f64,
    pub redis_per_poll: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct PollCosts {
    /// Statements and commands a second with no polls at all.
    pub background_mysql_per_s: f64,
    pub background_redis_per_s: f64,
    pub kinds: Vec<PollCost>,
}

/// Counters at one moment.
struct Counters {
    at: Instant,
    side: u64,
    questions: u64,
    commands: Vec<(u16, u64)>,
}

async fn counters(
    conn: &mut MySqlConnection,
    ports: &[u16],
    side: &SideQuery,
) -> anyhow::Result<Counters> {
    let at = Instant::now();
    let side = side.sent();
    let questions = questions_on(conn)
        .await
        .context("MariaDB's statement counter")?;
    let (_, _, commands) = redis_figures(ports).await;
    Ok(Counters {
        at,
        side,
        questions,
        commands,
    })
}

/// (statements, commands, seconds) between two looks, the side query's and
/// the look's own statement taken off. Each look asks every node `INFO` four
/// times, and the primaries `INFO` and `DBSIZE` once more (6 commands a node
/// at most), counted in Redis's total as well.
fn between(a: &Counters, b: &Counters, nodes: usize) -> (f64, f64, f64) {
    let side_queries = b.side.saturating_sub(a.side) as f64;
    let statements = b.questions.saturating_sub(a.questions) as f64 - side_queries - 1.0;
    let own_commands = (nodes * 6) as f64;
    let commands = commands_between(&a.commands, &b.commands) as f64 - own_commands;
    (statements, commands, (b.at - a.at).as_secs_f64())
}

/// Reservation polls of the sale's winners and waiting-room polls of its
/// joiners, `polls` of each at 200 a second over both instances, after a
/// quiet stretch as long as each. The sale's state must be in Redis
/// throughout (its retention not passed), or the figures are refused.
pub async fn poll_costs(
    dep: &Deployment,
    shop: &Shop,
    side: &SideQuery,
    sale: &Sale,
    joined: &[String],
    ports: &[u16],
    polls: usize,
) -> anyhow::Result<PollCosts> {
    let pool = sqlx::MySqlPool::connect(&dep.mysql_url).await?;
    let winners: Vec<String> = sqlx::query_scalar(
        "SELECT CAST(user_id AS CHAR) FROM orders WHERE activity_id = ? LIMIT 1000",
    )
    .bind(&sale.id)
    .fetch_all(&pool)
    .await?;
    let removed = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT CAST(redis_removing AS SIGNED) FROM activities WHERE id = ?",
        )
        .bind(&sale.id)
        .fetch_one(&pool)
        .await
    };
    anyhow::ensure!(removed().await? == 0, "the sale's state is gone already");
    let mut conn = MySqlConnection::connect(&dep.mysql_url).await?;
    let rate = 200.0;
    let secs = polls as f64 / rate;
    eprintln!("== day: the cost of a poll ({polls} of each kind, {secs:.0} s each)");
    let a = counters(&mut conn, ports, side).await?;
    tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    let b = counters(&mut conn, ports, side).await?;
    let (bq, br, bs) = between(&a, &b, ports.len());
    let (bg_q, bg_r) = (bq / bs, br / bs);
    let mut kinds = Vec::new();
    for (kind, users) in [
        ("reservation", &winners),
        ("waiting room", &joined.to_vec()),
    ] {
        if users.is_empty() {
            continue;
        }
        let a = counters(&mut conn, ports, side).await?;
        let answers = fire(shop, &sale.sku, kind, users, polls, rate).await;
        let b = counters(&mut conn, ports, side).await?;
        let (q, r, s) = between(&a, &b, ports.len());
        kinds.push(PollCost {
            kind: kind.to_owned(),
            polls,
            seconds: s,
            answers,
            mysql_per_poll: ((q - bg_q * s) / polls as f64).max(0.0),
            redis_per_poll: ((r - bg_r * s) / polls as f64).max(0.0),
        });
    }
    anyhow::ensure!(
        removed().await? == 0,
        "the sale's state went during the measurement"
    );
    pool.close().await;
    Ok(PollCosts {
        background_mysql_per_s: bg_q,
        background_redis_per_s: bg_r,
        kinds,
    })
}

/// `polls` polls of `kind` at `rate`, users in turn; answers by status.
async fn fire(
    shop: &Shop,
    sku: &str,
    kind: &str,
    users: &[String],
    polls: usize,
    rate: f64,
) -> BTreeMap<u16, usize> {
    let answers = Arc::new(std::sync::Mutex::new(BTreeMap::new()));
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    let mut tasks = JoinSet::new();
    for k in 0..polls {
        tick.tick().await;
        let api = shop.apis[k % shop.apis.len()].clone();
        let user = users[k % users.len()].clone();
        let request = if kind == "reservation" {
            api.reservation(sku, Caller::User(&user))
        } else {
            api.queue_place(sku, Caller::User(&user))
        };
        let answers = answers.clone();
        tasks.spawn(async move {
            let status = match request.send().await {
                Ok(r) => r.status().as_u16(),
                Err(_) => 0,
            };
            *answers
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .entry(status)
                .or_insert(0) += 1;
        });
    }
    while tasks.join_next().await.is_some() {}
    let out = answers.lock().unwrap_or_else(|e| e.into_inner()).clone();
    out
}

/// Requests in one look for its figures a request to count.
const BUSY_LOOK: f64 = 100.0;

fn mib(bytes: u64) -> f64 {
    bytes as f64 / 1_048_576.0
}

/// Statements and commands between two looks (the watch's own statements
/// and the side query's taken off); `None` where MySQL's counter was not read.
fn spent(a: &Point, b: &Point) -> (Option<f64>, f64) {
    let statements = match (a.mysql_questions, b.mysql_questions) {
        (Some(qa), Some(qb)) => Some(
            qb.saturating_sub(qa) as f64
                - (b.own_statements - a.own_statements) as f64
                - b.side_queries.saturating_sub(a.side_queries) as f64,
        ),
        _ => None,
    };
    let commands = commands_between(&a.redis_commands, &b.redis_commands) as f64;
    (statements, commands)
}

/// Statements a request and commands a request between each two looks with
/// at least [`BUSY_LOOK`] requests between them.
fn per_request(points: &[Point]) -> Vec<(f64, Option<f64>, f64)> {
    points
        .windows(2)
        .filter_map(|w| {
            let (a, b) = (&w[0], &w[1]);
            let requests = b.requests.saturating_sub(a.requests) as f64;
            // A look with few requests says more about the background than
            // about a request.
            if requests < BUSY_LOOK {
                return None;
            }
            let (statements, commands) = spent(a, b);
            Some((
                b.t_s,
                statements.map(|q| q.max(0.0) / requests),
                commands / requests,
            ))
        })
        .collect()
}

/// The reconciler's passes over the day, both instances: (passes, mean ms a
/// pass, mean sales a pass went through, ms a pass per sale), from each
/// look's figures (the sales passed are the last pass's, sampled).
fn pass_cost(points: &[Point]) -> Option<(f64, f64, f64, f64)> {
    let (mut passes, mut seconds, mut sales, mut looks) = (0.0, 0.0, 0.0, 0.0);
    for w in points.windows(2) {
        for (a, b) in w[0].reconcile.iter().zip(&w[1].reconcile) {
            let n = b.1 - a.1;
            if n <= 0.0 {
                continue;
            }
            passes += n;
            seconds += b.0 - a.0;
            sales += b.2;
            looks += 1.0;
        }
    }
    if passes == 0.0 || looks == 0.0 {
        return None;
    }
    let (ms, per) = (seconds * 1000.0 / passes, sales / looks);
    Some((passes, ms, per, if per > 0.0 { ms / per } else { ms }))
}

/// The report, in markdown.
pub fn render(day: &DayRun) -> String {
    let o = &day.options;
    let mut md = String::new();
    let _ = writeln!(md, "# A day in production\n");
    let _ = writeln!(
        md,
        "Started {} · {:.0} s in all · {} sales over {:.0} minutes · {} users · seed {}\n",
        day.started_at, day.seconds, o.sales, o.minutes, o.users, o.seed
    );
    let _ = writeln!(
        md,
        "Two API instances and two consumers (`FLASHSALE_ENV=production`) on a Redis Cluster of \
         3 primaries with 2 replicas each (`min_replicas_acked = 1`), one broker, one MariaDB; \
         retention {} s after a sale's end, {} s to pay, {:.0}% of winners pay. Times on two \
         shared cores are relative; only the invariants are asserted.\n",
        o.retain_secs,
        o.payment_timeout_secs,
        o.pay_share * 100.0
    );

    let _ = writeln!(md, "## Other business on the same MariaDB\n");
    let _ = writeln!(
        md,
        "The side query (a point read in another database, {:.0} a second) alone: p50 {:.2} ms, \
         p99 {:.2} ms. During a sale of {:.0} new buyers a second (every click a `202`), windows \
         of 4 s alternate between the consumers writing and the consumers stopped (SIGSTOP), \
         {} of each; the ratio divides out what the sale costs the two cores.\n",
        o.side_rate,
        day.side_idle.latency.p50_ms,
        day.side_idle.latency.p99_ms,
        o.pace_clicks_per_s,
        o.pace_cycles
    );
    let _ = writeln!(
        md,
        "| consumer setting | orders/s written | max lag | p50 writing | p99 writing | p50 paused | p99 paused | p99 ratio (target ≤ 1.5) | drained after |"
    );
    let _ = writeln!(md, "|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for p in &day.pace {
        let _ = writeln!(
            md,
            "| {} | {:.0} | {} | {:.2} ms | {:.2} ms | {:.2} ms | {:.2} ms | {} | {} |",
            p.variant,
            p.orders_per_s_writing,
            p.max_lag,
            p.writing.latency.p50_ms,
            p.writing.latency.p99_ms,
            p.paused.latency.p50_ms,
            p.paused.latency.p99_ms,
            if p.p99_ratio.is_finite() {
                format!("{:.2}×", p.p99_ratio)
            } else {
                format!(
                    "void ({} orders written while stopped)",
                    p.written_while_paused
                )
            },
            p.drained_s
                .map_or("not within 180 s".into(), |s| format!("{s:.1} s"))
        );
    }

    let _ = writeln!(md, "\n## The sales\n");
    let _ = writeln!(
        md,
        "Per sale: its window (seconds from the day's start), how it sold, what its buyers got, \
         and the longest any of its buyers waited for an answer that was not a `5xx` or a lost \
         connection (the operator's pause left out); for a struck sale, the time from the fault \
         to its first real answer.\n"
    );
    let _ = writeln!(
        md,
        "| sale | window | admission | shards | stock | events | clicks | 202 | 409 | 403 | 503 | lost | orders | paid | lapsed | longest without service | after the fault | invariants |"
    );
    let _ = writeln!(
        md,
        "|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
    );
    for s in &day.sales {
        let p = &s.plan;
        let count = |prefix: &str| -> usize {
            s.answers
                .iter()
                .filter(|(k, _)| k.starts_with(prefix))
                .map(|(_, v)| v)
                .sum()
        };
        let events: Vec<String> = day
            .done
            .iter()
            .filter(|d| d.sale == p.index)
            .map(|d| format!("{} at {:.0} s", d.what, d.at_s))
            .collect();
        let _ = writeln!(
            md,
            "| {} | {:.0}–{:.0} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.2} s | {} | {} |",
            p.name(),
            p.starts_at_s,
            p.ends_at_s(),
            if p.waiting_room {
                format!("room ({} joined)", s.joined)
            } else {
                "open".into()
            },
            p.stock_shards,
            p.stock,
            if events.is_empty() { "–".into() } else { events.join("; ") },
            s.answers.values().sum::<usize>(),
            count("202"),
            count("409"),
            count("403"),
            count("503"),
            count("lost"),
            s.orders,
            s.paid,
            s.cancelled,
            s.longest_without_service_s,
            s.after_fault_s.map_or("–".into(), |v| format!("{v:.2} s")),
            match &s.invariants {
                Ok(()) => "hold".to_owned(),
                Err(e) => format!("**broken**: {e}"),
            }
        );
    }
    let broken = day.sales.iter().filter(|s| s.invariants.is_err()).count();
    let _ = writeln!(
        md,
        "\n{} of {} sales hold every invariant.\n",
        day.sales.len() - broken,
        day.sales.len()
    );

    let _ = writeln!(md, "## Over the day\n");
    let pts = &day.points;
    if let (Some(first), Some(last)) = (pts.first(), pts.last()) {
        let peak = pts.iter().map(|p| p.redis_bytes).max().unwrap_or(0);
        let peak_keys = pts.iter().map(|p| p.redis_keys).max().unwrap_or(0);
        let _ = writeln!(
            md,
            "Redis (the primaries): {:.1} MiB and {} keys at the start, {:.1} MiB and {} keys at \
             the peak, {:.1} MiB and {} keys at the end{}.\n",
            mib(first.redis_bytes),
            first.redis_keys,
            mib(peak),
            peak_keys,
            mib(last.redis_bytes),
            last.redis_keys,
            day.removed_after_s.map_or(
                ", some sales' keys still held when the run stopped".into(),
                |s| format!(
                    "; every sale's keys were gone {s:.0} s after the last sale ended \
                     (retention {} s)",
                    o.retain_secs
                )
            )
        );
        let _ = writeln!(md, "| process | RSS at the start | peak | at the end |");
        let _ = writeln!(md, "|---|---:|---:|---:|");
        for (k, (name, _)) in first.rss_bytes.iter().enumerate() {
            let series: Vec<u64> = pts
                .iter()
                .filter_map(|p| p.rss_bytes.get(k).map(|r| r.1))
                .collect();
            let _ = writeln!(
                md,
                "| {name} | {:.1} MiB | {:.1} MiB | {:.1} MiB |",
                mib(series.first().copied().unwrap_or(0)),
                mib(series.iter().copied().max().unwrap_or(0)),
                mib(series.last().copied().unwrap_or(0))
            );
        }
        let rates = per_request(pts);
        let all_requests = last.requests.saturating_sub(first.requests) as f64;
        let (mut statements, mut commands) = (0.0, 0.0);
        for w in pts.windows(2) {
            let (q, r) = spent(&w[0], &w[1]);
            statements += q.unwrap_or(0.0);
            commands += r;
        }
        let busiest = rates
            .iter()
            .filter_map(|(_, q, _)| *q)
            .fold(0.0f64, f64::max);
        let max_lag = pts.iter().filter_map(|p| p.consumer_lag).max().unwrap_or(0);
        let _ = writeln!(
            md,
            "\nOver the whole day: {:.0} requests, {:.2} MySQL statements a request (every \
             statement of the service's instances and consumers, the consumer's writes, the \
             sweeper's and the reconciler's included; the most in one {:.0} s look with 100 \
             requests or more: {:.2}), \
             {:.1} Redis commands a request (every node, the replicas' replication included). \
             The consumer group's lag peaked at {max_lag} messages.\n",
            all_requests,
            if all_requests > 0.0 {
                statements / all_requests
            } else {
                0.0
            },
            o.every_s,
            busiest,
            if all_requests > 0.0 {
                commands / all_requests
            } else {
                0.0
            }
        );
    }
    if let Some(cost) = pass_cost(pts) {
        let _ = writeln!(
            md,
            "The reconciler's passes (both instances, every 30 s and the wake-ups between): \
             {:.0} passes, {:.2} ms a pass on average, through {:.1} sales a pass on average \
             (the live ones; the ended and the upcoming get one Redis look, no pass): \
             {:.2} ms a pass per sale passed.\n",
            cost.0, cost.1, cost.2, cost.3
        );
    }
    if let Some(polls) = &day.polls {
        let _ = writeln!(md, "## The cost of a poll\n");
        let _ = writeln!(
            md,
            "On the last sale once it had ended (its orders written, paid or lapsed, its state \
             still in Redis): with no polls, the deployment's background work runs {:.1} MySQL \
             statements and {:.0} Redis commands a second; the polls' cost is what they add.\n",
            polls.background_mysql_per_s, polls.background_redis_per_s
        );
        let _ = writeln!(
            md,
            "| poll | polls | answers | MySQL statements a poll | Redis commands a poll |"
        );
        let _ = writeln!(md, "|---|---:|---|---:|---:|");
        for k in &polls.kinds {
            let answers: Vec<String> = k.answers.iter().map(|(s, n)| format!("{s}: {n}")).collect();
            let _ = writeln!(
                md,
                "| {} | {} | {} | {:.3} | {:.2} |",
                k.kind,
                k.polls,
                answers.join(", "),
                k.mysql_per_poll,
                k.redis_per_poll
            );
        }
    }
    md
}
