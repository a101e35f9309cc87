//! The flood with `wrk` and the CPU per request by phase; the sold-out gate
//! reopening across instances; the producer's settings against the broker; bots
//! among the winners with and without the waiting room.

use std::fmt::Write as _;

use super::format::{ms, thousands, verdict};
use crate::model::{FairnessSection, FloodSection, GateSection, ProducerSection};
use testkit::stats::binomial_interval;

/// The flood: the service's reserve route by phase against `/healthz` and the
/// authenticated no-op, with the service's CPU and Redis's commands per request.
pub fn flood(md: &mut String, f: &FloodSection) {
    let _ = writeln!(
        md,
        "## The flood, measured with wrk: CPU per request by phase\n"
    );
    let _ = writeln!(
        md,
        "`{}`, {} thread, {} connections, rate limits off, {} users each with a token of their own \
         (the requests are built once and sent in turn). The first four phases take turns for several \
         rounds and each shows its median round. CPU is the server process's own (user + \
         system, all threads, from `/proc`) divided by the requests; Redis commands are \
         `total_commands_processed` over the same run (the commands a script runs count too).\n",
        f.wrk,
        f.threads,
        f.connections,
        thousands(f.users as f64)
    );
    let healthz = f.run("healthz").map(|r| r.rps);
    let noop = f.run("no-op").map(|r| r.rps);
    let _ = writeln!(
        md,
        "| phase | request | answer (one probe) | req/s | × healthz | × no-op | p50 ms | p99 ms | non-2xx | server CPU µs / request | Redis commands / request | req/s of each round |"
    );
    let _ = writeln!(
        md,
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
    );
    let share = |rps: f64, of: Option<f64>| of.map_or("–".into(), |o| format!("{:.2}", rps / o));
    for r in &f.runs {
        let _ = writeln!(
            md,
            "| {} | `{}` | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            r.phase,
            r.request,
            if r.probe == r.expected {
                r.probe.clone()
            } else {
                format!("**{}** (expected {})", r.probe, r.expected)
            },
            thousands(r.rps),
            share(r.rps, healthz),
            share(r.rps, noop),
            ms(r.p50_ms),
            ms(r.p99_ms),
            thousands(r.non_2xx as f64),
            r.cpu_us_per_request()
                .map_or("–".into(), |c| format!("{c:.1}")),
            r.redis_commands_per_request()
                .map_or("–".into(), |c| format!("{c:.3}")),
            r.rps_rounds
                .iter()
                .map(|x| thousands(*x))
                .collect::<Vec<_>>()
                .join(", "),
        );
    }
    if let Some(sold) = f.run("sold out") {
        sold_out_verdicts(md, sold.rps, healthz, noop);
    }
    let _ = writeln!(
        md,
        "\nThe winning phase's CPU includes the order consumer in the same process (it writes \
         the orders while the run goes on).\n"
    );
}

/// The sold-out phase against the two it must keep up with.
fn sold_out_verdicts(md: &mut String, sold_rps: f64, healthz: Option<f64>, noop: Option<f64>) {
    let _ = writeln!(md);
    if let Some(n) = noop {
        let r = sold_rps / n;
        let _ = writeln!(
            md,
            "- Sold out ≥ 0.85 × the authenticated no-op: {r:.2} → {}",
            verdict(r >= 0.85)
        );
    }
    if let Some(h) = healthz {
        let r = sold_rps / h;
        let _ = writeln!(
            md,
            "- Sold out ≥ 0.7 × `GET /healthz`: {r:.2} → {}",
            verdict(r >= 0.7)
        );
    }
}

/// The gate reopening on one instance when units come back through another.
pub fn gate(md: &mut String, g: &GateSection) {
    let _ = writeln!(md, "## The sold-out gate reopening under a flood\n");
    let l = &g.flood;
    let _ = writeln!(
        md,
        "Two instances of the service. {} units sold out in the first moments of a flood on the \
         first ({} connections, every request a new user's); {:.0} ms into the flood the operator \
         added {} units through the second. The first instance learns of it only through Redis: \
         its gate re-checks a shut sale every {} ms.\n",
        g.units, l.connections, g.returned_at_ms, g.units, g.recheck_ms
    );
    let first = g.accepts_after_return_ms.first().copied();
    let last = g.accepts_after_return_ms.last().copied();
    let returned_sold = g.accepts_after_return_ms.len();
    let _ = writeln!(md, "| | |\n| --- | --- |");
    let _ = writeln!(
        md,
        "| flood | {} requests, {} req/s, p99 {} ms |",
        thousands(l.answered as f64),
        thousands(l.throughput_rps),
        ms(l.latency.p99_ms)
    );
    let _ = writeln!(
        md,
        "| first `202` after the units came back | {} |",
        first.map_or("none".into(), |t| format!("{t:.0} ms"))
    );
    let _ = writeln!(
        md,
        "| last `202` after the units came back | {} |",
        last.map_or("none".into(), |t| format!("{t:.0} ms"))
    );
    let _ = writeln!(
        md,
        "| returned units sold during the flood | {returned_sold} of {} |",
        g.units
    );
    let _ = writeln!(
        md,
        "| winners in all / units in all | {} / {} ({}) |",
        l.sale.winners,
        g.units * 2,
        if l.sale.no_user_twice {
            "no user twice"
        } else {
            "**a user won twice**"
        }
    );
    let _ = writeln!(
        md,
        "| requests answered after the last `202` | {} (the flood went on) |",
        thousands(g.answered_after_last_accept as f64)
    );
    let _ = writeln!(md);
}

/// The producer's settings against the broker, one changed at a time.
pub fn producer(md: &mut String, p: &ProducerSection) {
    let _ = writeln!(md, "## The winning path: the producer's settings\n");
    let _ = writeln!(
        md,
        "The service's own publisher alone (`acks=all`, each publish awaited, as each `202` is), \
         publishes in flight = the load's connections. Default: {}. Each row changes one setting.\n",
        p.default
    );
    let _ = writeln!(
        md,
        "| setting | in flight | acknowledged / s | p50 ms | p99 ms | failed |\n| --- | ---: | ---: | ---: | ---: | ---: |"
    );
    for r in &p.runs {
        let c = &r.ceiling;
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} |",
            r.setting,
            c.in_flight,
            thousands(c.rps),
            ms(c.latency.p50_ms),
            ms(c.latency.p99_ms),
            c.failed
        );
    }
    let _ = writeln!(md);
}

/// Bots among the winners, open and through the waiting room.
pub fn fairness(md: &mut String, f: &FairnessSection) {
    let _ = writeln!(md, "## Fairness: bots against the waiting room\n");
    let share = f.bots as f64 / f.users.max(1) as f64;
    let (lo, hi) = binomial_interval(f.units as usize, share, 0.01);
    let _ = writeln!(
        md,
        "The same sale twice on one service: {} users want {} units; {} of them ({:.0} %) are bots \
         that start earlier and send ten times as many requests. Every user is a client of its own: \
         it reserves (open) or joins, asks where it stands as often as `Retry-After` says and \
         reserves when admitted (waiting room), and pays its order. If the bots had no edge, the \
         bots among {} winners would lie in [{lo}, {hi}] (99 % binomial interval).\n",
        f.users,
        f.units,
        f.bots,
        share * 100.0,
        f.units
    );
    let _ = writeln!(
        md,
        "| mode | winners | bots among them | bots' share | within the 99 % interval | last user knew their outcome after | HTTP requests | Redis commands / request |\n| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |"
    );
    for r in &f.runs {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {:.0} % | {} | {:.1} s | {} | {:.2} |",
            r.mode,
            r.winners,
            r.bot_winners,
            r.bot_winners as f64 * 100.0 / r.winners.max(1) as f64,
            if (lo..=hi).contains(&r.bot_winners) {
                "yes"
            } else {
                "**no**"
            },
            r.last_outcome_after_s,
            thousands(r.requests as f64),
            r.redis_commands as f64 / r.requests.max(1) as f64
        );
    }
    let _ = writeln!(md);
}
