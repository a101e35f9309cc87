//! The Cluster section: one hot SKU with stock_shards 1 and 3, and the projection.

use std::fmt::Write as _;

use super::format::{ms, thousands};
use crate::model::{ClusterPlan, ShardRun};

/// The Cluster section of the report.
pub fn section(md: &mut String, plan: &ClusterPlan, runs: &[ShardRun]) {
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
