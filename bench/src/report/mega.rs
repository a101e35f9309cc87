//! The mega-sale: a million users, open and through the waiting room, the
//! floors it is held against, the deployed configuration beside the quiet one,
//! and the scale-out plan computed from the run.

use std::fmt::Write as _;

use super::format::{ms, thousands};
use crate::mega::{DEPLOYED_ENV, QUIET_ENV};
use crate::model::Summary;
use crate::model::{MegaSection, MegaVariant, PhaseCost};

fn secs(x: Option<f64>) -> String {
    x.map_or("–".into(), |s| format!("{s:.2} s"))
}

fn bytes(b: f64) -> String {
    if b >= 1048576.0 {
        format!("{:.1} MiB", b / 1048576.0)
    } else if b >= 1024.0 {
        format!("{:.1} KiB", b / 1024.0)
    } else {
        format!("{b:.0} B")
    }
}

fn opt(x: Option<f64>, digits: usize) -> String {
    x.map_or("–".into(), |v| format!("{v:.digits$}"))
}

fn name(v: &MegaVariant) -> String {
    format!("{}, stock_shards {}", v.admission, v.stock_shards)
}

pub fn section(md: &mut String, summary: &Summary, m: &MegaSection) {
    let _ = writeln!(
        md,
        "## The mega-sale: {} users, {} units\n",
        thousands(m.users as f64),
        thousands(f64::from(m.units))
    );
    let _ = writeln!(
        md,
        "{} users, each with a token of their own (signed in {:.1} s on every core; the load \
         generator holds them in {}), each clicking reserve {} times at once, over {} keep-alive \
         connections; rate limits off. Each sale runs on a service of its own started with \
         `FLASHSALE_ENV={}` (JSON logs at info, as deployed). Open: every user clicks as soon as \
         a connection is free. Waiting room: every user joins before the start (set ahead from a \
         join rate measured just before), then from the start asks where they stand as often as \
         `Retry-After` says, reserves when admitted, and pays the order (which lets the room \
         close once nothing can come back).\n",
        thousands(m.users as f64),
        m.tokens_signed_in_s,
        bytes(m.token_bytes as f64),
        m.clicks,
        m.connections,
        m.env
    );
    per_sale(md, m);
    answers(md, m);
    phases(md, m);
    floors(md, summary, m);
    environments(md, m);
    scale(md, m);
    let _ = writeln!(
        md,
        "Plots: `mega_answers.png` (answers per second by code through each sale), \
         `mega_memory.png` (the service's resident memory and Redis's memory over time).\n"
    );
}

fn per_sale(md: &mut String, m: &MegaSection) {
    let _ = write!(md, "| | ");
    for v in &m.variants {
        let _ = write!(md, "{} | ", name(v));
    }
    let _ = writeln!(md);
    let _ = writeln!(md, "|---|{}", "---:|".repeat(m.variants.len()));
    let row = |md: &mut String, label: &str, f: &dyn Fn(&MegaVariant) -> String| {
        let _ = write!(md, "| {label} | ");
        for v in &m.variants {
            let _ = write!(md, "{} | ", f(v));
        }
        let _ = writeln!(md);
    };
    row(
        md,
        "time to sell out (from the start to the last `202`)",
        &|v| secs(v.sold_out_after_s()),
    );
    row(md, "units sold (`202`) / winners", &|v| {
        format!(
            "{} / {}",
            thousands(v.crowd.accepted as f64),
            thousands(v.crowd.winners as f64)
        )
    });
    row(md, "requests answered", &|v| {
        thousands(v.crowd.requests as f64)
    });
    row(md, "`5xx` answers / no answer", &|v| {
        let lost: u64 = v.crowd.errors.values().sum();
        let five = v.answers_5xx();
        if five == 0 && lost == 0 {
            "0 / 0".into()
        } else {
            format!("**{five} / {lost}**")
        }
    });
    row(
        md,
        "time until every order is in MySQL (from the start)",
        &|v| {
            format!(
                "{} ({} orders)",
                secs(v.orders_in_mysql_after_s()),
                thousands(v.orders as f64)
            )
        },
    );
    row(
        md,
        "Redis per buyer: when the crowd ended / once quiet",
        &|v| {
            if v.admission != "open" {
                return "–".into();
            }
            let n = v.crowd.winners.max(1) as f64;
            format!(
                "{} / {}",
                bytes(v.redis_at_end.bytes as f64 / n),
                bytes(v.redis_after_drain.bytes as f64 / n)
            )
        },
    );
    row(
        md,
        "Redis per joiner: after the joins / when the crowd ended",
        &|v| {
            v.redis_after_joins.map_or("–".into(), |r| {
                let n = v.crowd.joined.max(1) as f64;
                format!(
                    "{} / {}",
                    bytes(r.bytes as f64 / n),
                    bytes(v.redis_at_end.bytes as f64 / n)
                )
            })
        },
    );
    row(md, "service RSS: at start / peak", &|v| {
        format!(
            "{} / {}",
            v.rss_at_start_kib
                .map_or("–".into(), |k| bytes(k as f64 * 1024.0)),
            v.peak_rss_kib
                .map_or("–".into(), |k| bytes(k as f64 * 1024.0))
        )
    });
    row(md, "joins per second (joined / users)", &|v| {
        v.joins_per_s().map_or("–".into(), |r| {
            format!(
                "{} ({} / {})",
                thousands(r),
                thousands(v.crowd.joined as f64),
                thousands(v.crowd.users as f64)
            )
        })
    });
    row(
        md,
        "the draw: from the start to the first place shown",
        &|v| secs(v.draw_s()),
    );
    row(
        md,
        "every user knew their outcome after (from the start)",
        &|v| match v.everyone_knew_after_s() {
            Some(s) => format!("{s:.2} s"),
            None => format!(
                "**{} of {} never knew**",
                thousands((v.crowd.users as u64 - v.crowd.known) as f64),
                thousands(v.crowd.users as f64)
            ),
        },
    );
    row(md, "admitted by the room", &|v| {
        if v.admission == "open" {
            "–".into()
        } else {
            thousands(v.crowd.admitted as f64)
        }
    });
    row(md, "service log", &|v| {
        format!(
            "{} ({:.1} B / request)",
            bytes(v.log_bytes as f64),
            v.log_bytes as f64 / v.crowd.requests.max(1) as f64
        )
    });
    row(md, "invariants", &|v| {
        if v.check.ok {
            "hold".into()
        } else {
            format!("**{}**", v.check.notes.join("; "))
        }
    });
    let _ = writeln!(
        md,
        "\nRedis memory is `MEMORY USAGE` of every key of the sale (stock shards and the room), \
         divided by the winners (open) or the joiners (waiting room: the room's keys and the \
         buyers' together); the draw's duration is from `starts_at` to the \
         first answer that showed a drawn place (it includes the draw's grace after the start \
         and the room's tick).\n"
    );
}

fn answers(md: &mut String, m: &MegaSection) {
    let _ = writeln!(md, "Answers by request, status and code:\n");
    for v in &m.variants {
        let mut parts: Vec<String> = v
            .crowd
            .answers
            .iter()
            .map(|(k, n)| format!("{k}: {}", thousands(*n as f64)))
            .collect();
        parts.extend(
            v.crowd
                .errors
                .iter()
                .map(|(k, n)| format!("no answer ({k}): {}", thousands(*n as f64))),
        );
        let _ = writeln!(md, "- {}: {}", name(v), parts.join(", "));
    }
    let _ = writeln!(md);
}

/// Below this many requests a second a phase's cost is its background work.
const PER_REQUEST_MIN_RPS: f64 = 100.0;

fn phases(md: &mut String, m: &MegaSection) {
    let noop = m
        .env(DEPLOYED_ENV)
        .and_then(|e| e.run("no-op"))
        .and_then(|r| r.cpu_us_per_request());
    let _ = writeln!(
        md,
        "CPU and Redis per request, by phase (the service process's CPU, user + system; Redis's \
         `total_commands_processed`, script calls and CPU from `INFO`, sampled every 250 ms; the \
         floor is the authenticated no-op{}; a phase with fewer than {} requests a second shows no \
         figure per request: there the process spends its time on background work, not on \
         requests):\n",
        noop.map_or(String::new(), |n| format!(", {n:.1} µs a request")),
        PER_REQUEST_MIN_RPS
    );
    let _ = writeln!(
        md,
        "| sale | phase | seconds | requests ({}) | req/s | service CPU µs / request | × no-op | Redis commands / request | script calls / request | `202`s |",
        m.kinds.join(" / ")
    );
    let _ = writeln!(md, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for v in &m.variants {
        for p in &v.phases {
            let busy = p.rps >= PER_REQUEST_MIN_RPS;
            let cpu = p.cpu_us_per_request().filter(|_| busy);
            let _ = writeln!(
                md,
                "| {} | {} | {:.2} | {} ({}) | {} | {} | {} | {} | {} | {} |",
                name(v),
                p.name,
                p.seconds(),
                thousands(p.requests as f64),
                p.by_kind
                    .iter()
                    .map(|n| thousands(*n as f64))
                    .collect::<Vec<_>>()
                    .join(" / "),
                thousands(p.rps),
                opt(cpu, 1),
                opt(cpu.zip(noop).map(|(c, n)| c / n), 2),
                opt(p.redis_commands_per_request().filter(|_| busy), 2),
                opt(p.script_calls_per_request().filter(|_| busy), 3),
                thousands(p.accepted as f64),
            );
        }
    }
    let _ = writeln!(md);
}

/// A floor's line: what was achieved, the floor, and their ratio.
fn floor_row(md: &mut String, what: &str, achieved: Option<f64>, floor: Option<f64>, unit: &str) {
    let ratio = match (achieved, floor) {
        (Some(a), Some(f)) if f > 0.0 => format!("{:.2}", a / f),
        _ => "–".into(),
    };
    let _ = writeln!(
        md,
        "| {what} | {} | {} | {ratio} |",
        achieved.map_or("–".into(), |a| format!("{a:.2} {unit}")),
        floor.map_or("–".into(), |f| format!("{f:.2} {unit}")),
    );
}

fn floors(md: &mut String, summary: &Summary, m: &MegaSection) {
    let noop = m.env(DEPLOYED_ENV).and_then(|e| e.run("no-op"));
    let redis = summary.redis_ceiling.iter().find(|c| c.pipeline == 1);
    let broker = summary
        .broker_ceiling
        .iter()
        .find(|b| b.in_flight == summary.options.concurrency);
    let _ = writeln!(
        md,
        "Floors, measured in the same run: the service's CPU per request against the \
         authenticated no-op behind the same layers (`wrk`, `FLASHSALE_ENV={DEPLOYED_ENV}`); \
         Redis against `redis-benchmark` running the same reserve script (EVALSHA, {} clients); \
         the winning path's pace against the broker's publish ceiling ({} publishes in flight).\n",
        redis.map_or(0, |r| r.clients),
        summary.options.concurrency
    );
    let _ = writeln!(
        md,
        "| sale | measure | achieved | floor | achieved / floor |"
    );
    let _ = writeln!(md, "|---|---|---:|---:|---:|");
    for v in &m.variants {
        let n = name(v);
        let mut line = |what: &str, a: Option<f64>, f: Option<f64>, unit: &str| {
            let _ = write!(md, "| {n} ");
            floor_row(md, what, a, f, unit);
        };
        let selling = v.phase("selling");
        if v.admission == "open" {
            line(
                "winning path (selling): service CPU / request",
                selling.and_then(PhaseCost::cpu_us_per_request),
                noop.and_then(|r| r.cpu_us_per_request()),
                "µs",
            );
            line(
                "sold out: service CPU / request",
                v.phase("sold out").and_then(PhaseCost::cpu_us_per_request),
                noop.and_then(|r| r.cpu_us_per_request()),
                "µs",
            );
            line(
                "winning path: Redis commands / `202`",
                selling.and_then(PhaseCost::redis_commands_per_accept),
                redis.and_then(|r| r.commands_per_call),
                "",
            );
            line(
                "winning path: Redis CPU / `202`",
                selling.and_then(PhaseCost::redis_cpu_us_per_accept),
                redis.and_then(|r| r.redis_cpu_us_per_call),
                "µs",
            );
            line(
                "winning path: `202`s per second",
                selling.map(|p| p.accepted as f64 / p.seconds().max(1e-9)),
                broker.map(|b| b.rps),
                "/s",
            );
        } else {
            line(
                "join: script calls / join (target 1)",
                v.phase("joining")
                    .and_then(PhaseCost::script_calls_per_request),
                Some(1.0),
                "",
            );
            line(
                "join: service CPU / join",
                v.phase("joining").and_then(PhaseCost::cpu_us_per_request),
                noop.and_then(|r| r.cpu_us_per_request()),
                "µs",
            );
            line(
                "poll before the start: Redis commands / request (target 0)",
                v.phase("polling before the start")
                    .and_then(PhaseCost::redis_commands_per_request),
                Some(0.0),
                "",
            );
            line(
                "poll before the start: service CPU / poll",
                v.phase("polling before the start")
                    .and_then(PhaseCost::cpu_us_per_request),
                noop.and_then(|r| r.cpu_us_per_request()),
                "µs",
            );
            let after = v.phase("after the sell-out");
            let _ = writeln!(
                md,
                "| {n} | poll once sold out: Redis commands / request (target 0) | {} | 0 | – |",
                opt(after.and_then(PhaseCost::redis_commands_per_request), 2)
            );
            let _ = writeln!(
                md,
                "| {n} | poll while selling: Redis commands / request | {} | – | – |",
                opt(selling.and_then(PhaseCost::redis_commands_per_request), 2)
            );
        }
    }
    let _ = writeln!(
        md,
        "\nRedis's commands count the commands a script runs; the Redis on the development \
         machine is shared, so what else ran meanwhile is in these figures too.\n"
    );
}

fn environments(md: &mut String, m: &MegaSection) {
    let (Some(prod), Some(quiet)) = (m.env(DEPLOYED_ENV), m.env(QUIET_ENV)) else {
        return;
    };
    let _ = writeln!(
        md,
        "The deployed configuration (`FLASHSALE_ENV={DEPLOYED_ENV}`: JSON logs, filter \
         `info,sqlx=warn,rdkafka=warn`) beside the quiet one the tests run \
         (`FLASHSALE_ENV={QUIET_ENV}`: filter `warn`), the flood's phases with `wrk`:\n"
    );
    let _ = writeln!(
        md,
        "| phase | answer | req/s ({DEPLOYED_ENV}) | req/s ({QUIET_ENV}) | CPU µs / request ({DEPLOYED_ENV}) | CPU µs / request ({QUIET_ENV}) | CPU difference |"
    );
    let _ = writeln!(md, "|---|---|---:|---:|---:|---:|---:|");
    for p in &prod.runs {
        let Some(q) = quiet.run(&p.phase) else {
            continue;
        };
        let (a, b) = (p.cpu_us_per_request(), q.cpu_us_per_request());
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {} |",
            p.phase,
            p.probe,
            thousands(p.rps),
            thousands(q.rps),
            opt(a, 1),
            opt(b, 1),
            a.zip(b)
                .filter(|(_, b)| *b > 0.0)
                .map_or("–".into(), |(a, b)| format!(
                    "{:+.0} %",
                    (a / b - 1.0) * 100.0
                )),
        );
    }
    let requests: u64 = prod.runs.iter().map(|r| r.requests).sum();
    let _ = writeln!(
        md,
        "\nThe service logged {} in the {} run ({:.2} B a request) and {} in the {} run. At info \
         every request opens its span (`request` with the request id, method, route and client \
         address, `src/http/middleware.rs`) and the layers record into it; at warn the span is \
         disabled and costs a level check. Where the rows differ, that is where the CPU goes; \
         lines are written only for events at info (an activity created, an order paid), not \
         per request.\n",
        bytes(prod.log_bytes as f64),
        DEPLOYED_ENV,
        prod.log_bytes as f64 / requests.max(1) as f64,
        bytes(quiet.log_bytes as f64),
        QUIET_ENV
    );
}

fn scale(md: &mut String, m: &MegaSection) {
    for p in &m.scale {
        let i = &p.inputs;
        let _ = writeln!(
            md,
            "Where one machine ends: a sale of {} users in {:.0} s ({} requests, {} units at the \
             measured {:.2} requests and {:.3} units a user), planned from the open sale with \
             stock_shards {} ({} users measured); each part counted at {:.0} % of its measured \
             capacity:\n",
            thousands(i.target_users as f64),
            i.target_seconds,
            thousands(p.target_requests as f64),
            thousands(p.target_units as f64),
            i.requests as f64 / i.users.max(1) as f64,
            i.units as f64 / i.users.max(1) as f64,
            i.stock_shards,
            thousands(i.users as f64),
            crate::mega::scale::HEADROOM * 100.0
        );
        let _ = writeln!(
            md,
            "| part | measured | one of it needs, for the whole sale | needed |\n|---|---|---:|---:|"
        );
        for r in &p.rows {
            let _ = writeln!(
                md,
                "| {} | {} | {} s | {} |",
                r.resource,
                r.measured,
                ms(r.one_unit_s),
                r.needed
            );
        }
        let _ = writeln!(
            md,
            "\nBound by: **{}**. The hot SKU's stock needs stock_shards ≥ {} so that each Redis \
             primary holds a shard of it (one shard is one hash tag, on one primary).\n",
            p.bound_by, p.stock_shards_needed
        );
    }
}
