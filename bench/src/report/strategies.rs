//! The strategies side by side: the machine, the headline, the targets, the
//! ceilings, half rate, the sale, the side query, the CPU, plots and method.

use std::fmt::Write as _;

use super::format::{answers, ms, ratio, side_cell, thousands, verdict};
use crate::ceiling::BrokerCeiling;
use crate::machine::CpuWindow;
use crate::model::{Phase, Summary};
use crate::server::StrategyKind;

/// The sections before the extra measurements, in order.
pub fn before(md: &mut String, summary: &Summary) {
    title_and_machine(md, summary);
    headline(md, summary);
    targets(md, summary);
    ceilings(md, summary);
    half_rate(md, summary);
    small_sale(md, summary);
    side_query(md, summary);
    cpu(md, summary);
}

/// The sections after the extra measurements, in order.
pub fn after(md: &mut String, summary: &Summary) {
    plots(md);
    method(md, summary);
}

fn noop_rps(summary: &Summary) -> Option<f64> {
    summary
        .strategy(StrategyKind::Noop)
        .and_then(|s| s.saturation.as_ref())
        .map(|p| p.load.throughput_rps)
}

/// The broker ceiling with as many publishes in flight as the load had connections.
pub fn broker_at_concurrency(summary: &Summary) -> Option<&BrokerCeiling> {
    summary
        .broker_ceiling
        .iter()
        .find(|b| b.in_flight == summary.options.concurrency)
}

fn redis_ceiling_rps(summary: &Summary) -> Option<f64> {
    summary
        .redis_ceiling
        .iter()
        .find(|c| c.pipeline == 1)
        .map(|c| c.rps)
}

/// What bounds a strategy by construction, when the figures show it.
fn structural_bound(summary: &Summary, kind: StrategyKind, p: &Phase) -> Option<String> {
    match kind {
        StrategyKind::Service => broker_at_concurrency(summary).map(|b| {
            format!(
                "each 202 waits for the broker's acknowledgement: {:.0} % of the broker ceiling at the same in-flight count",
                p.load.throughput_rps / b.rps.max(1.0) * 100.0
            )
        }),
        StrategyKind::Mysql => Some(format!(
            "every request queues on one row lock, held from the UPDATE through the commit's redo-log flush (innodb_flush_log_at_trx_commit = {})",
            summary.machine.innodb_flush_log_at_trx_commit
        )),
        StrategyKind::RedisLock => Some(format!(
            "one lock: critical sections run one at a time, four round trips each, and waiters poll every {} ms",
            summary.options.lock_retry_ms
        )),
        _ => None,
    }
}

/// One phrase on what bounded a run, from its CPU split (and, when known, from how
/// the strategy works).
fn bound_hint(cpu: &CpuWindow, cpus: usize, structural: Option<String>) -> String {
    let hint = cpu_hint(cpu, cpus);
    match structural {
        Some(s) => format!("{s}; {hint}"),
        None => hint,
    }
}

fn cpu_hint(cpu: &CpuWindow, cpus: usize) -> String {
    let capacity = cpus as f64 * 100.0;
    if cpu.seconds <= 0.0 {
        return "no CPU samples".into();
    }
    let mut procs: Vec<(&String, &f64)> = cpu.by_process.iter().collect();
    procs.sort_by(|a, b| b.1.total_cmp(a.1));
    let top: Vec<String> = procs
        .iter()
        .take(3)
        .map(|(k, v)| format!("{k} {v:.0} %"))
        .collect();
    if cpu.machine_busy >= 0.9 * capacity {
        format!(
            "CPU-bound: machine {:.0} % of {capacity:.0} % ({})",
            cpu.machine_busy,
            top.join(", ")
        )
    } else {
        format!(
            "not CPU-bound: machine {:.0} % of {capacity:.0} % ({})",
            cpu.machine_busy,
            top.join(", ")
        )
    }
}

/// The title, the command and the machine it ran on.
pub(super) fn title_and_machine(md: &mut String, summary: &Summary) {
    let m = &summary.machine;

    let title = if summary.mega.is_some() {
        "flashsale: the mega-sale"
    } else {
        "flashsale: the seed's strategies side by side"
    };
    let _ = writeln!(md, "# {title}\n");
    let _ = writeln!(
        md,
        "Run {} → {} ({:.0} s), command: `{}`\n",
        summary.started_at, summary.finished_at, summary.seconds, summary.command
    );

    let _ = writeln!(md, "## Machine\n");
    let _ = writeln!(md, "| | |\n| --- | --- |");
    let _ = writeln!(md, "| cores | {} × {} |", m.cpus, m.cpu_model);
    let _ = writeln!(md, "| memory | {:.1} GiB |", m.memory_gib);
    let _ = writeln!(md, "| system | {}, kernel {} |", m.os, m.kernel);
    let _ = writeln!(md, "| Rust | {} |", m.rustc);
    let _ = writeln!(md, "| Redis | {} ({}) |", m.redis, m.redis_benchmark);
    let _ = writeln!(
        md,
        "| MariaDB | {} (innodb_flush_log_at_trx_commit = {}) |",
        m.mariadb, m.innodb_flush_log_at_trx_commit
    );
    let _ = writeln!(md, "| Kafka-protocol broker | {} |", m.broker);
    let _ = writeln!(
        md,
        "| load average at start | {} |\n",
        m.load_average_at_start
    );
    let _ = writeln!(
        md,
        "Every process (server, load generator, Redis, MariaDB, broker) shares these {} cores, \
         so each figure is best read as a ratio to the ceilings measured in the same run.\n",
        m.cpus
    );
}

/// Saturation, every strategy: the headline table.
fn headline(md: &mut String, summary: &Summary) {
    let o = &summary.options;
    let noop = noop_rps(summary);
    let redis = redis_ceiling_rps(summary);
    let _ = writeln!(
        md,
        "## Headline: saturation at {} connections\n",
        o.concurrency
    );
    let _ = writeln!(
        md,
        "Closed loop, one click per user, stock = users ({}) so the sale never ends during the \
         measurement ({:.0} s after {:.0} s of warm-up). Latency is per request, from send to \
         the whole answer. Side query: p50 / p99 of the other business's point query during the run \
         (idle: {}).\n",
        thousands(o.users as f64),
        o.duration,
        o.warmup,
        side_cell(&summary.side_idle)
    );
    let _ = writeln!(
        md,
        "| strategy | req/s | × no-op | × Redis EVALSHA ceiling | p50 ms | p90 ms | p99 ms | p99.9 ms | answers | side query ms |"
    );
    let _ = writeln!(
        md,
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"
    );
    for s in &summary.strategies {
        match &s.saturation {
            Some(p) => {
                let l = &p.load;
                let _ = writeln!(
                    md,
                    "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    s.name,
                    thousands(l.throughput_rps),
                    noop.map_or("–".into(), |n| ratio(l.throughput_rps, n)),
                    redis.map_or("–".into(), |r| ratio(l.throughput_rps, r)),
                    ms(l.latency.p50_ms),
                    ms(l.latency.p90_ms),
                    ms(l.latency.p99_ms),
                    ms(l.latency.p999_ms),
                    answers(l),
                    side_cell(&p.side)
                );
            }
            None => {
                let _ = writeln!(
                    md,
                    "| {} | failed: {} | | | | | | | | |",
                    s.name,
                    s.error.as_deref().unwrap_or("no result")
                );
            }
        }
    }
    let _ = writeln!(md);
}

/// The Redis, HTTP and broker ceilings measured in the same run.
pub(super) fn ceilings(md: &mut String, summary: &Summary) {
    let _ = writeln!(md, "## Ceilings, measured in the same run\n");
    let _ = writeln!(
        md,
        "| ceiling | clients | pipeline | ops/s | p50 ms | p99 ms |\n| --- | ---: | ---: | ---: | ---: | ---: |"
    );
    for c in &summary.redis_ceiling {
        let _ = writeln!(
            md,
            "| Redis: `redis-benchmark` EVALSHA of `src/stock/reserve.lua` (random users; {} reserved) | {} | {} | {} | {} | {} |",
            thousands(c.reserved as f64),
            c.clients,
            c.pipeline,
            thousands(c.rps),
            ms(c.p50_ms),
            ms(c.p99_ms)
        );
    }
    if let Some(p) = summary
        .strategy(StrategyKind::Noop)
        .and_then(|s| s.saturation.as_ref())
    {
        let _ = writeln!(
            md,
            "| HTTP: no-op endpoint behind the same auth and protection layers | {} | 1 | {} | {} | {} |",
            p.load.connections,
            thousands(p.load.throughput_rps),
            ms(p.load.latency.p50_ms),
            ms(p.load.latency.p99_ms)
        );
    }
    for b in &summary.broker_ceiling {
        let _ = writeln!(
            md,
            "| Broker: the service's own Kafka publisher alone (acks=all, each publish awaited; idempotence as configured) | {} in flight | – | {} | {} | {} |",
            b.in_flight,
            thousands(b.rps),
            ms(b.latency.p50_ms),
            ms(b.latency.p99_ms)
        );
    }
    let _ = writeln!(
        md,
        "\nThe service's Redis connection is one multiplexed socket, so concurrent requests are \
         pipelined on it: its Redis limit lies between the two Redis rows.\n"
    );
    if let Some(b) = broker_at_concurrency(summary) {
        if let Some(cpu) = &b.cpu {
            // CPU time per acknowledged message, in microseconds.
            let per_message = |role: &str| {
                cpu.by_process.get(role).map_or("–".into(), |pct| {
                    format!("{:.0}", pct / 100.0 / b.rps.max(1.0) * 1e6)
                })
            };
            let _ = writeln!(
                md,
                "While the broker ceiling ran at {} messages/s, the broker used {} µs of CPU per \
                 message and the publisher (librdkafka) {} µs: each `202` of the service carries \
                 that cost on top of its HTTP and Redis work, on the same two cores.\n",
                thousands(b.rps),
                per_message("broker"),
                per_message("publisher")
            );
        }
    }
}

/// Latency at half of each strategy's own saturation rate.
fn half_rate(md: &mut String, summary: &Summary) {
    let _ = writeln!(
        md,
        "## Latency at half of each strategy's own saturation rate (open loop)\n"
    );
    let _ = writeln!(
        md,
        "Requests are due at a fixed rate; a request that had to wait for a free connection is \
         timed from when it was due (no coordinated omission).\n"
    );
    let _ = writeln!(
        md,
        "| strategy | target req/s | achieved req/s | p50 ms | p90 ms | p99 ms | p99.9 ms | max ms | late starts |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    for s in &summary.strategies {
        if let Some(p) = &s.half_rate {
            let l = &p.load;
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                s.name,
                thousands(l.target_rate.unwrap_or(0.0)),
                thousands(l.throughput_rps),
                ms(l.latency.p50_ms),
                ms(l.latency.p90_ms),
                ms(l.latency.p99_ms),
                ms(l.latency.p999_ms),
                ms(l.latency.max_ms),
                thousands(l.late_starts as f64)
            );
        }
    }
    let _ = writeln!(md);
}

/// The flash sale itself: the sold-out phase and the invariants.
fn small_sale(md: &mut String, summary: &Summary) {
    let o = &summary.options;
    let _ = writeln!(
        md,
        "## The flash sale: {} units, {} users × {} clicks (the sold-out phase)\n",
        o.small_stock,
        thousands(o.small_users as f64),
        o.small_clicks
    );
    let _ = writeln!(
        md,
        "A user's clicks are sent back to back, so they are in flight together (a double click). \
         Closed loop at {} connections, at most {:.0} s. \"last 202 at\" is when the sale sold out, \
         seen from the clients.\n",
        o.concurrency, o.small_max_duration
    );
    let _ = writeln!(
        md,
        "| strategy | req/s | p50 ms | p99 ms | last 202 at s | 202s | winners | users with 2+ wins | winners = units | answers | server check |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |"
    );
    for s in &summary.strategies {
        if let Some(p) = &s.small {
            let l = &p.load;
            let c = &l.sale;
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} {} |",
                s.name,
                thousands(l.throughput_rps),
                ms(l.latency.p50_ms),
                ms(l.latency.p99_ms),
                c.last_accept_after_s
                    .map_or("–".into(), |t| format!("{t:.2}")),
                c.accepted,
                c.winners,
                c.users_with_several_wins,
                match c.winners_equal_units {
                    Some(true) => "yes",
                    Some(false) => "**no**",
                    None => "not sold out",
                },
                answers(l),
                if p.check.ok { "ok:" } else { "**BROKEN**:" },
                p.check.notes.join("; ")
            );
        }
    }
    let _ = writeln!(md);
    let _ = writeln!(md, "Server-side checks of the saturation runs:\n");
    for s in &summary.strategies {
        if let Some(p) = &s.saturation {
            let drain = p
                .drain_s
                .map(|d| format!(" (MySQL had every order {d:.1} s after the load)"))
                .unwrap_or_default();
            let _ = writeln!(
                md,
                "- {}: {} {}{}",
                s.name,
                if p.check.ok { "ok:" } else { "**BROKEN**:" },
                p.check.notes.join("; "),
                drain
            );
        }
    }
    let _ = writeln!(md);
}

/// What each run did to the other business's query.
fn side_query(md: &mut String, summary: &Summary) {
    let o = &summary.options;
    let _ = writeln!(md, "## Collateral damage: the other business's query\n");
    let _ = writeln!(
        md,
        "A point `SELECT` by primary key on a 10,000-row table in another database of the same \
         MariaDB, {:.0} per second, from its own pool of 4 connections. The no-op touches no database: \
         its rows show what CPU contention alone does to the query on this two-core machine, and the \
         last column divides that out.\n",
        o.side_rate
    );
    let idle = &summary.side_idle;
    let _ = writeln!(
        md,
        "| during | queries | p50 ms | p99 ms | max ms | p99 ÷ idle p99 | p99 ÷ no-op's p99 in the same kind of run |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: |"
    );
    let _ = writeln!(
        md,
        "| idle | {} | {} | {} | {} | 1.00× | |",
        idle.queries,
        ms(idle.latency.p50_ms),
        ms(idle.latency.p99_ms),
        ms(idle.latency.max_ms)
    );
    let noop = summary.strategy(StrategyKind::Noop);
    for s in &summary.strategies {
        for (what, p, control) in [
            (
                "saturation",
                s.saturation.as_ref(),
                noop.and_then(|n| n.saturation.as_ref()),
            ),
            (
                "half rate",
                s.half_rate.as_ref(),
                noop.and_then(|n| n.half_rate.as_ref()),
            ),
            ("small-stock sale", s.small.as_ref(), None),
        ] {
            if let Some(p) = p {
                let _ = writeln!(
                    md,
                    "| {} {} | {} | {} | {} | {} | {} | {} |",
                    s.name,
                    what,
                    p.side.queries,
                    ms(p.side.latency.p50_ms),
                    ms(p.side.latency.p99_ms),
                    ms(p.side.latency.max_ms),
                    ratio(p.side.latency.p99_ms, idle.latency.p99_ms),
                    control.map_or(String::new(), |c| ratio(
                        p.side.latency.p99_ms,
                        c.side.latency.p99_ms
                    ))
                );
            }
        }
    }
    let _ = writeln!(md);
}

/// Where the CPU went in each run, and what bounded it.
fn cpu(md: &mut String, summary: &Summary) {
    let m = &summary.machine;
    let _ = writeln!(
        md,
        "## Where the CPU went (% of one core; the machine has {} %)\n",
        m.cpus * 100
    );
    let _ = writeln!(
        md,
        "| run | server | load generator | redis | mariadb | broker | other | machine | what bounds it |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
    );
    let cell = |c: &CpuWindow, k: &str| {
        c.by_process
            .get(k)
            .map_or("–".into(), |v| format!("{v:.0}"))
    };
    let _ = writeln!(
        md,
        "| idle | – | – | {} | {} | {} | {:.0} | {:.0} | |",
        cell(&summary.cpu_idle, "redis"),
        cell(&summary.cpu_idle, "mariadb"),
        cell(&summary.cpu_idle, "broker"),
        summary.cpu_idle.other,
        summary.cpu_idle.machine_busy
    );
    for s in &summary.strategies {
        for (what, p) in [
            ("saturation", s.saturation.as_ref()),
            ("half rate", s.half_rate.as_ref()),
            ("small stock", s.small.as_ref()),
        ] {
            if let Some(p) = p {
                let c = &p.cpu;
                let others: Vec<String> = p
                    .others
                    .iter()
                    .map(|(name, pct)| format!("{name} {pct:.0}"))
                    .collect();
                let other = if others.is_empty() {
                    format!("{:.0}", c.other)
                } else {
                    format!("{:.0} ({})", c.other, others.join(", "))
                };
                let _ = writeln!(
                    md,
                    "| {} {} | {} | {} | {} | {} | {} | {} | {:.0} | {} |",
                    s.name,
                    what,
                    cell(c, "server"),
                    cell(c, "loadgen"),
                    cell(c, "redis"),
                    cell(c, "mariadb"),
                    cell(c, "broker"),
                    other,
                    c.machine_busy,
                    if what == "saturation" {
                        bound_hint(c, m.cpus, structural_bound(summary, s.strategy, p))
                    } else {
                        String::new()
                    }
                );
            }
        }
    }
    let _ = writeln!(
        md,
        "\n\"other\" is CPU used by processes outside the benchmark (a compiler, say): a large \
         figure marks a noisy run.\n"
    );
}

/// The plots `scripts/plots.py` draws beside the report.
fn plots(md: &mut String) {
    let _ = writeln!(md, "## Plots\n");
    let _ = writeln!(md, "![throughput per strategy](throughput.png)\n");
    let _ = writeln!(md, "![latency CDF per strategy](latency_cdf.png)\n");
    let _ = writeln!(md, "![side-query latency](side_query.png)\n");
    let _ = writeln!(md, "![the small-stock sale over time](sale_timeline.png)\n");
}

/// How the strategies and the load were run.
fn method(md: &mut String, summary: &Summary) {
    let o = &summary.options;
    let _ = writeln!(md, "## Method\n");
    for s in &summary.strategies {
        let _ = writeln!(md, "- **{}**: {}.", s.name, s.description);
    }
    let _ = writeln!(
        md,
        "- Strategies a–c and the no-op run in `bench-server`, behind the service's own layers \
         (request id, trace span, metrics, load shedding, concurrency limit, timeout, rate limits \
         ({:?}), `require_user` JWT auth). `redis-decr` and `redis-lock` do their Redis part only \
         (no queue hand-off, no order): they are upper bounds for their approach.",
        o.rate_limits
    );
    let _ = writeln!(
        md,
        "- The service is the real `flashsale::startup::Application` in its own `bench-server` process \
         (own database, topic and consumer group; rate limits off; consumer, sweeper and reconciler on)."
    );
    let _ = writeln!(
        md,
        "- The load generator (`loadtest`) is a separate process: HTTP/1.1 keep-alive, one request \
         in flight per connection, every user with their own signed token, latencies in an HDR \
         histogram (1 µs to 5 min, 3 significant digits)."
    );
    let _ = writeln!(
        md,
        "- Raw data: `summary.json` and `runs/*.json` next to this report."
    );
}

/// The service's targets against the figures (not assertions).
fn targets(md: &mut String, summary: &Summary) {
    let service = summary.strategy(StrategyKind::Service);
    let sat = service.and_then(|s| s.saturation.as_ref());
    let half = service.and_then(|s| s.half_rate.as_ref());
    let small = service.and_then(|s| s.small.as_ref());
    let noop = noop_rps(summary);
    let mysql = summary
        .strategy(StrategyKind::Mysql)
        .and_then(|s| s.saturation.as_ref())
        .map(|p| p.load.throughput_rps);
    let idle_p99 = summary.side_idle.latency.p99_ms;
    let _ = writeln!(md, "## Targets (figures, not assertions)\n");
    let _ = writeln!(md, "| target | measured | verdict |\n| --- | --- | --- |");
    if let (Some(s), Some(n)) = (sat, noop) {
        let r = s.load.throughput_rps / n;
        let _ = writeln!(
            md,
            "| service ≥ 50 % of the no-op's throughput | {:.0} % ({} vs {} req/s) | {} |",
            r * 100.0,
            thousands(s.load.throughput_rps),
            thousands(n),
            verdict(r >= 0.5)
        );
    }
    if let (Some(s), Some(b)) = (sat, broker_at_concurrency(summary)) {
        let _ = writeln!(
            md,
            "| (context) service vs the broker ceiling, same in-flight count | {:.0} % ({} vs {} messages/s) | – |",
            s.load.throughput_rps / b.rps.max(1.0) * 100.0,
            thousands(s.load.throughput_rps),
            thousands(b.rps)
        );
    }
    if let Some(h) = half {
        let p99 = h.load.latency.p99_ms;
        let _ = writeln!(
            md,
            "| service p99 ≤ 5 ms at half of its saturation rate | p99 {} ms at {} req/s | {} |",
            ms(p99),
            thousands(h.load.throughput_rps),
            verdict(p99 <= 5.0)
        );
    }
    if let (Some(s), Some(my)) = (sat, mysql) {
        let r = if my > 0.0 {
            s.load.throughput_rps / my
        } else {
            f64::INFINITY
        };
        let _ = writeln!(
            md,
            "| service ≥ 10× the MySQL strategy's throughput, same concurrency | {r:.1}× ({} vs {} req/s) | {} |",
            thousands(s.load.throughput_rps),
            thousands(my),
            verdict(r >= 10.0)
        );
    }
    for (what, p) in [
        ("the service's small-stock sale", small),
        ("the service's saturation run", sat),
    ] {
        if let Some(p) = p {
            let r = if idle_p99 > 0.0 {
                p.side.latency.p99_ms / idle_p99
            } else {
                f64::INFINITY
            };
            let _ = writeln!(
                md,
                "| side query p99 during {what} ≤ 1.5× idle | {} ms vs {} ms idle ({r:.2}×) | {} |",
                ms(p.side.latency.p99_ms),
                ms(idle_p99),
                verdict(r <= 1.5)
            );
        }
    }
    let _ = writeln!(md);
}
