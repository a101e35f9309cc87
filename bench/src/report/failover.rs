//! The failover section: a sale through the loss of a Cluster primary.

use std::fmt::Write as _;

use super::format::{ms, thousands, verdict};
use crate::model::FailoverSection;

fn gap(ms_: Option<f64>) -> String {
    ms_.map_or_else(
        || "never served again".to_owned(),
        |g| {
            if g >= 1000.0 {
                format!("{:.2} s", g / 1000.0)
            } else {
                format!("{} ms", ms(g))
            }
        },
    )
}

/// The failover section of the report.
pub fn section(md: &mut String, f: &FailoverSection) {
    let _ = writeln!(md, "## A Redis Cluster primary killed under a sale\n");
    let _ = writeln!(
        md,
        "The service on a Cluster of its own (3 primaries, 2 replicas each, `cluster-node-timeout` 2 s) with `redis.min_replicas_acked = 1` (every `202` on a replica first). A sale of {} units, every user clicking twice, one click after the other, driven open loop at **{} req/s**: {:.0} % of the {} req/s the same service answered on the same Cluster just before (the load generator, closed loop at {} connections, users clicking twice on a sale that never sold out). The primary that owns the sale's slot ({}) was SIGKILLed {:.1} s in; the Cluster promoted {} in its place; the dead node was started again on its old address, empty, as its supervisor would, and rejoined as a replica; the sale went on until {:.1} s after the kill. Every answer is timed from its own send; the time without service runs from the mark to the first answer other than a `5xx` or a lost connection to a request sent at or after it (`testkit::availability`, as in the fault suite).\n",
        thousands(f64::from(f.units)),
        thousands(f.rate),
        f.rate_share * 100.0,
        thousands(f.measured_rps),
        f.measure_connections,
        f.killed_port,
        f.before_s,
        f.promoted_port,
        f.ended_after_s
    );
    table(md, f);
    let _ = writeln!(
        md,
        "\n![answers per {} ms by status through the failover](failover.png)",
        f.bucket_ms
    );
}

/// The figures of the fault, one row each.
fn table(md: &mut String, f: &FailoverSection) {
    let _ = writeln!(md, "| | |\n| --- | ---: |");
    let _ = writeln!(
        md,
        "| the Cluster's promotion, after the kill (seen in `CLUSTER NODES`) | {:.2} s |",
        f.promoted_after_s
    );
    let _ = writeln!(
        md,
        "| **time without service from the kill** | **{}** |",
        gap(f.gap_from_kill_ms)
    );
    let _ = writeln!(
        md,
        "| **time without service from the promotion** (the fault suite's bound: 2 s) | **{}** |",
        gap(f.gap_from_promotion_ms)
    );
    let _ = writeln!(
        md,
        "| the dead node back on its old address, after the kill | {:.2} s (the Cluster healthy again at {:.2} s) |",
        f.returned_after_s, f.healthy_after_s
    );
    let _ = writeln!(
        md,
        "| later gap: the longest a new buyer waited again once service was back | {} |",
        f.later_gap_ms.map_or_else(
            || "service went away again and never came back".to_owned(),
            |g| if g == 0.0 {
                "none".to_owned()
            } else {
                gap(Some(g))
            }
        )
    );
    let _ = writeln!(
        md,
        "| requests sent after the node's return answered `5xx` or lost | {} of {} |",
        thousands(f.unserved_after_return as f64),
        thousands(f.sent_after_return as f64)
    );
    let _ = writeln!(
        md,
        "| requests sent | {} ({} req/s) |",
        thousands(f.sent as f64),
        thousands(f.sent_rps)
    );
    let answers: Vec<String> = f
        .answers
        .iter()
        .map(|(k, v)| format!("{k}: {}", thousands(*v as f64)))
        .collect();
    let _ = writeln!(md, "| answers | {} |", answers.join(", "));
    let _ = writeln!(
        md,
        "| invariants (the test kit's checker, once quiet{}) | {}: {} |",
        f.drain_s
            .map(|d| format!(", {d:.1} s after the last answer"))
            .unwrap_or_default(),
        verdict(f.invariants.ok),
        f.invariants.notes.join("; ")
    );
}
