//! The sold-out gate under a flood: how long one instance keeps answering
//! `sold_out` from memory after units came back through another.
//!
//! Two instances of the service share a database, a topic and Redis. A sale of
//! `--gate-units` units sells out in the first moments of a flood on the first
//! instance (every user clicks once, so any user could win a returned unit); once
//! the first instance has shut its gate, the operator tops the sale up by as many
//! units through the second. The first instance learns of it only through Redis
//! (its gate re-checks every `SOLD_OUT_RECHECK`): the time from the top-up's answer
//! to the `202`s the flood then gets is the reopening bound, as measured.

use std::time::Duration;

use anyhow::{bail, Context};
use hyper::{Method, StatusCode};
use serde_json::json;
use testkit::sale::SaleSpec;

use crate::client::{call_json, expect_json};
use crate::clock::now_unix_ms;
use crate::context::Bench;
use crate::loadgen::LoadReport;
use crate::model::GateSection;
use crate::process::{LoadArgs, ServerChild};
use crate::server::StrategyKind;

/// Seconds of the flood; the units come back about halfway.
const FLOOD_S: f64 = 4.0;
/// Users of the flood: more than it can send, so every request is a user's first.
const FLOOD_USERS: usize = 300_000;

pub async fn section(bench: &mut Bench) -> anyhow::Result<GateSection> {
    let first = bench.start_server(StrategyKind::Service, &[]).await?;
    let second = bench.join_server(&first).await;
    let outcome = match &second {
        Ok(second) => measure(bench, &first, second).await,
        Err(e) => Err(anyhow::anyhow!("the second instance did not start: {e:#}")),
    };
    if let Ok(second) = second {
        second.stop().await?;
    }
    first.stop().await?;
    outcome
}

async fn measure(
    bench: &mut Bench,
    first: &ServerChild,
    second: &ServerChild,
) -> anyhow::Result<GateSection> {
    let units = bench.opts.gate_units;
    let sku = bench.next_sku(StrategyKind::Service, "gate");
    let spec = SaleSpec {
        sku: Some(sku.clone()),
        payment_timeout_secs: 3600,
        ..SaleSpec::new(units)
    };
    let activity = bench.open_service_sale(first, &spec).await?;
    eprintln!(
        "== gate: {units} units sold out by a flood on one instance, {units} returned through another"
    );
    let args = LoadArgs {
        label: "gate".into(),
        sku: sku.clone(),
        users: FLOOD_USERS,
        clicks: 1,
        rate: None,
        duration: FLOOD_S,
        warmup: 0.0,
        units: Some(u64::from(units) * 2),
    };
    let running =
        bench
            .loadtest
            .spawn(first.addr, &args, bench.runs_dir.join("gate-flood.json"))?;
    if !sold_out(first, &sku).await {
        running.finish().await.ok();
        bail!("the gate's sale never sold out");
    }
    // A few rechecks after the sale sold out, the first instance's gate is
    // surely shut.
    tokio::time::sleep(Duration::from_millis(
        flashsale::stock::SOLD_OUT_RECHECK.as_millis() as u64 * 4,
    ))
    .await;
    expect_json(
        second.addr,
        Method::POST,
        &format!("/admin/activities/{activity}/stock"),
        Some(&bench.admin_token()),
        Some(&json!({ "add": units })),
        StatusCode::OK,
    )
    .await
    .context("the top-up through the second instance failed")?;
    let returned_unix_ms = now_unix_ms();
    let flood = running.finish().await?;
    Ok(after_return(units, flood, returned_unix_ms))
}

/// Whether the first instance says the sale is sold out within 30 s.
async fn sold_out(first: &ServerChild, sku: &str) -> bool {
    let status_path = format!("/flash/{sku}");
    let sold_out = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let (_, body) = call_json(first.addr, Method::GET, &status_path, None, None).await?;
            if body["state"] == "sold_out" {
                return anyhow::Ok(());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    matches!(sold_out, Ok(Ok(())))
}

/// The flood's `202`s after the units came back, timed from the top-up's answer.
fn after_return(units: u32, flood: LoadReport, returned_unix_ms: f64) -> GateSection {
    // With no warm-up, the window opens when the load starts.
    let returned_at_ms = returned_unix_ms - flood.window_start_unix_ms;
    let accepts_after_return_ms: Vec<f64> = flood
        .sale
        .accept_times_ms
        .iter()
        .filter(|t| **t > returned_at_ms)
        .map(|t| t - returned_at_ms)
        .collect();
    let last_accept_ms = flood.sale.accept_times_ms.last().copied().unwrap_or(0.0);
    let answered_after_last_accept = flood
        .timeline
        .iter()
        .rev()
        .find(|p| p.t_s * 1000.0 <= last_accept_ms)
        .map_or(0, |p| flood.answered.saturating_sub(p.answered));
    GateSection {
        units,
        recheck_ms: flashsale::stock::SOLD_OUT_RECHECK.as_millis() as u64,
        flood,
        returned_at_ms,
        accepts_after_return_ms,
        answered_after_last_accept,
    }
}
