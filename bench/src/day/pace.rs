//! Other business on the same MariaDB during a sale, with the consumer writing
//! and with it paused, in the same sale: the ratio of the side query's p99 in
//! the two divides out what the two shared cores cost everyone (the load, the
//! service, Redis, the broker) and leaves what the consumer's writes cost the
//! database's other users.
//!
//! Each consumer setting gets a sale of its own, every click a new user (so
//! every click is a `202` and an order to write), at a steady rate. After a
//! warm-up, windows alternate: the consumers write for a few seconds, then are
//! stopped (SIGSTOP) for as long, then go on, a backlog waiting for them. A
//! stop stays under the group session's expiry (6 s), so the group does not
//! move partitions; the side query's samples are pooled per kind of window,
//! each window's first half second left out.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use testkit::api::Caller;
use testkit::sale::{open_sale, SaleSpec};
use tokio::task::JoinSet;

use super::Deployment;
use crate::clock::now_unix_ms;
use crate::side::{SideQuery, SideStats};

/// One consumer setting, as environment variables on `flashsale consume`.
pub struct Variant {
    pub name: &'static str,
    pub env: Vec<(&'static str, String)>,
}

/// The settings compared: the default, the adaptive pace, and a budget.
pub fn variants(budget: u32) -> Vec<Variant> {
    vec![
        Variant {
            name: "default (no budget, adaptive off)",
            env: vec![],
        },
        Variant {
            name: "consumer.adaptive_pace = true",
            env: vec![("FLASHSALE__CONSUMER__ADAPTIVE_PACE", "true".into())],
        },
        Variant {
            name: "consumer.max_orders_per_sec budget",
            env: vec![(
                "FLASHSALE__CONSUMER__MAX_ORDERS_PER_SEC",
                budget.to_string(),
            )],
        },
    ]
}

#[derive(Debug, Clone, Serialize)]
pub struct PaceRun {
    pub variant: String,
    pub clicks_per_s: f64,
    pub accepted: u64,
    pub other_answers: u64,
    pub writing: SideStats,
    pub paused: SideStats,
    /// p99 writing / p99 paused.
    pub p99_ratio: f64,
    /// Orders written per second while the consumers ran (the windows they
    /// wrote in, the backlog included).
    pub orders_per_s_writing: f64,
    pub max_lag: i64,
    /// Orders written while the consumers were stopped (their stop settled):
    /// 0, or the comparison is void.
    pub written_while_paused: i64,
    /// Seconds from the last click until the consumers had written every order.
    pub drained_s: Option<f64>,
}

const WARM_UP: Duration = Duration::from_secs(5);
/// Each window; a stop stays well under the session's 6 s.
const WINDOW: Duration = Duration::from_secs(4);
/// Left out of each window: the moment the consumers stop or go on.
const SETTLE_MS: f64 = 500.0;

pub async fn run(
    dep: &mut Deployment,
    side: &SideQuery,
    variant: &Variant,
    clicks_per_s: f64,
    cycles: u32,
) -> anyhow::Result<PaceRun> {
    eprintln!("== pace: {}", variant.name);
    dep.restart_consumers(&variant.env);
    let length = WARM_UP + WINDOW * (2 * cycles) + Duration::from_secs(5);
    let spec = SaleSpec {
        starts_in_secs: -1,
        // Its orders neither lapse nor are paid within the run: the day's
        // figures are the day's sales'.
        payment_timeout_secs: 7200,
        open_secs: length.as_secs() as i64 + 2,
        ..SaleSpec::new(1_000_000)
    };
    let sale = open_sale(&dep.client, &dep.apis[0].base(), &dep.admin, &spec)
        .await
        .map_err(anyhow::Error::msg)?;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let accepted = Arc::new(AtomicU64::new(0));
    let other = Arc::new(AtomicU64::new(0));
    let driver = {
        let apis = dep.apis_of_users();
        let (stop, accepted, other) = (stop.clone(), accepted.clone(), other.clone());
        let sku = sale.sku.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / clicks_per_s));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut tasks = JoinSet::new();
            let mut k = 0usize;
            while !stop.load(Ordering::SeqCst) {
                tick.tick().await;
                let api = apis[k % apis.len()].clone();
                let (sku, accepted, other) = (sku.clone(), accepted.clone(), other.clone());
                tasks.spawn(async move {
                    let user = format!("pace-{}", uuid::Uuid::new_v4().simple());
                    match api.reserve(&sku, Caller::User(&user)).send().await {
                        Ok(r) if r.status().as_u16() == 202 => {
                            accepted.fetch_add(1, Ordering::Relaxed)
                        }
                        _ => other.fetch_add(1, Ordering::Relaxed),
                    };
                });
                k += 1;
            }
            while tasks.join_next().await.is_some() {}
        })
    };
    tokio::time::sleep(WARM_UP).await;
    let mut writing = Vec::new();
    let mut paused = Vec::new();
    let mut max_lag = 0;
    let (mut written, mut wrote_for) = (0i64, 0.0f64);
    let mut written_paused = 0i64;
    for _ in 0..cycles {
        let before = dep.order_count().await?;
        let from = now_unix_ms();
        tokio::time::sleep(WINDOW).await;
        let to = now_unix_ms();
        written += dep.order_count().await? - before;
        wrote_for += (to - from) / 1000.0;
        writing.push((from + SETTLE_MS, to));
        dep.pause_consumers();
        let from = now_unix_ms();
        // What the consumers wrote after their stop had settled: nothing, or
        // the stop did not take.
        tokio::time::sleep(Duration::from_millis(SETTLE_MS as u64)).await;
        let stopped_at = dep.order_count().await?;
        tokio::time::sleep(WINDOW - Duration::from_millis(SETTLE_MS as u64)).await;
        let to = now_unix_ms();
        written_paused += dep.order_count().await? - stopped_at;
        paused.push((from + SETTLE_MS, to));
        if let Ok(lag) = flashsale::kafka::consumer_lag(&dep.kafka).await {
            max_lag = max_lag.max(lag);
        }
        dep.resume_consumers();
    }
    stop.store(true, Ordering::SeqCst);
    driver.await?;
    let last_click = Instant::now();
    let accepted = accepted.load(Ordering::Relaxed);
    let drained = testkit::within(Duration::from_secs(180), "every order written", || async {
        let n = dep.orders_of(&sale.id).await.ok()?;
        (n as u64 >= accepted).then_some(())
    })
    .await
    .ok()
    .map(|()| last_click.elapsed().as_secs_f64());
    let writing = side.windows(&writing)?;
    let paused = side.windows(&paused)?;
    let p99_ratio = if paused.latency.p99_ms > 0.0 && written_paused == 0 {
        writing.latency.p99_ms / paused.latency.p99_ms
    } else {
        f64::NAN
    };
    Ok(PaceRun {
        variant: variant.name.to_owned(),
        clicks_per_s,
        accepted,
        other_answers: other.load(Ordering::Relaxed),
        writing,
        paused,
        p99_ratio,
        orders_per_s_writing: if wrote_for > 0.0 {
            written as f64 / wrote_for
        } else {
            0.0
        },
        max_lag,
        written_while_paused: written_paused,
        drained_s: drained,
    })
}
