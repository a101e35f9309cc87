//! The fault-injection suite: real processes, real kills, on loopback.
//!
//! Every scenario runs a sale of 1,200 requests (600 users clicking twice) against
//! 100 units on `flashsale` processes while one fault is injected, with a pending
//! deadline of a few seconds, and the reconciler run over and over, concurrently,
//! from the admin endpoint and the CLI. When everything is quiet again, the test
//! kit's checker (`testkit::invariants`) asserts the four invariants strictly:
//! no oversell, one per user, every `202` an order (none failed, none missing, no
//! withdrawn reservation an order), stock conserved in Redis and in MySQL, and
//! every answer a documented one.
//!
//! Each fault is one module under `scenarios/` with its whole behaviour (prepare,
//! inject, expect). The suite prints a table and ends with `N passed, M failed`.
//! Run it alone with `cargo test --test faults`; extra arguments select scenarios
//! by id or name.
//!
//! After the scenarios, a seeded random fault campaign (`campaign/`) runs a few
//! fixed seeds and prints its own table; `cargo test --test faults campaign`
//! runs it alone, `FLASHSALE_CAMPAIGN_SEEDS` and `FLASHSALE_CAMPAIGN_SECS` pick
//! the seeds and the length.

mod campaign;
mod harness;
mod scenarios;

use std::sync::Arc;
use std::time::{Duration, Instant};

use harness::{Fault, Row};

/// A scenario's name, its row (or why it broke) and how long it took.
type ScenarioResult = (&'static str, Result<Row, String>, Duration);

fn main() {
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let selected = selected(&filters);
    let run_campaign = filters.is_empty()
        || filters
            .iter()
            .any(|x| "campaign".contains(x.as_str()) || "faults".contains(x.as_str()));
    let seeds = match run_campaign.then(campaign::seeds).transpose() {
        Ok(picked) => picked.unwrap_or_default(),
        Err(e) => {
            eprintln!("faults: {e}");
            std::process::exit(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("faults: cannot start a runtime: {e}");
            std::process::exit(2);
        }
    };
    let (results, outcomes) = runtime.block_on(run_all(selected, seeds));
    let (mut passed, mut failed) = (0, 0);
    if !results.is_empty() {
        (passed, failed) = report(&results);
    }
    if !outcomes.is_empty() {
        let (p, f) = campaign::report(&outcomes);
        println!();
        println!("campaign: {p} seeds passed, {f} failed");
        passed += p;
        failed += f;
    }
    println!();
    println!("faults: {passed} passed, {failed} failed");
    if failed > 0 {
        std::process::exit(1);
    }
}

/// The scenarios the command line names by id or name (all when it names none).
fn selected(filters: &[String]) -> Vec<Arc<dyn Fault>> {
    scenarios::all()
        .into_iter()
        .filter(|f| {
            filters.is_empty()
                || filters.iter().any(|x| {
                    f.id().contains(x.as_str())
                        || f.name().contains(x.as_str())
                        || "faults".contains(x.as_str())
                })
        })
        .collect()
}

/// Every scenario, then the campaign's seeds, two at a time: enough to
/// overlap the waits on a 2-core machine.
async fn run_all(
    selected: Vec<Arc<dyn Fault>>,
    seeds: Vec<(u64, u64)>,
) -> (Vec<ScenarioResult>, Vec<campaign::Outcome>) {
    let gate = Arc::new(tokio::sync::Semaphore::new(2));
    let mut tasks = Vec::new();
    for fault in selected {
        let gate = gate.clone();
        tasks.push(tokio::spawn(async move {
            let _permit = gate.acquire_owned().await;
            let started = Instant::now();
            let f = fault.clone();
            let result = match tokio::spawn(async move { harness::scenario(&*f).await }).await {
                Ok(r) => r,
                Err(panic) => Err(format!("panicked: {panic}")),
            };
            (fault.name(), result, started.elapsed())
        }));
    }
    // The campaign's seeds queue behind the scenarios (the gate is fair).
    let mut seed_tasks = Vec::new();
    for (seed, secs) in seeds {
        let gate = gate.clone();
        seed_tasks.push(tokio::spawn(async move {
            let _permit = gate.acquire_owned().await;
            match tokio::spawn(campaign::run_seed(seed, secs)).await {
                Ok(o) => o,
                Err(panic) => campaign::Outcome {
                    seed,
                    error: Some(format!("panicked: {panic}")),
                    ..campaign::Outcome::default()
                },
            }
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        match t.await {
            Ok(r) => out.push(r),
            Err(e) => out.push(("?", Err(format!("task failed: {e}")), Duration::ZERO)),
        }
    }
    let mut outcomes = Vec::new();
    for t in seed_tasks {
        if let Ok(o) = t.await {
            outcomes.push(o);
        }
    }
    (out, outcomes)
}

fn report(results: &[ScenarioResult]) -> (usize, usize) {
    println!();
    println!("| scenario | requests | 202 | 202 → order | 202 broken | 503 | conn. lost | 5xx or lost | without service (target) | later gap | live orders (paid) | cancelled | failed | withdrawn | reconcile runs | invariants | s |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |");
    let (mut passed, mut failed) = (0, 0);
    for (name, result, elapsed) in results {
        match result {
            Ok(row) => {
                passed += 1;
                let f = &row.figures;
                let o = &row.outage;
                let target = row
                    .target
                    .map(|t| format!(" (≤ {:.1} s)", t.bound.as_secs_f64()))
                    .unwrap_or_default();
                let struck = match (row.since_struck, o.gap) {
                    (Some(s), Some(g)) if s > g + Duration::from_millis(50) => {
                        format!("{:.2} s from the fault, ", s.as_secs_f64())
                    }
                    _ => String::new(),
                };
                println!(
                    "| {name} | {} | {} | {} | {} | {} | {} | {:.1} % | {struck}{}{target} | {:.2} s | {} ({}) | {} | {} | {} | {} | hold | {:.0} |",
                    f.requests,
                    f.accepted,
                    f.accepted_ordered,
                    f.accepted_broken,
                    f.refused_503,
                    f.lost_connections,
                    o.unserved_percent(),
                    o.gap
                        .map(|g| format!("{:.2} s", g.as_secs_f64()))
                        .unwrap_or_else(|| "never".into()),
                    o.later_gap.as_secs_f64(),
                    f.live_orders,
                    f.paid,
                    f.cancelled,
                    f.failed,
                    f.withdrawn,
                    row.reconcile_calls,
                    elapsed.as_secs_f64()
                );
            }
            Err(e) => {
                failed += 1;
                println!(
                    "| {name} | | | | | | | | | | | | | | | BROKEN | {:.0} |",
                    elapsed.as_secs_f64()
                );
                eprintln!("\n--- {name} failed:\n{e}\n");
            }
        }
    }
    (passed, failed)
}
