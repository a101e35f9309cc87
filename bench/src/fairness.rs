//! Fairness: the same sale twice on one service, first come first served
//! (`open`) and through the waiting room. 1,000 users want 100 units; 100 of them
//! are bots that start earlier and send ten times as many requests. Each user is
//! a client of its own: in the waiting room it joins, asks where it stands as
//! often as `Retry-After` says, reserves when admitted and pays its order; in
//! the open sale it reserves at the start (bots ten times, and first) and pays.
//!
//! Reported per mode: the bots' share of the winners against the 99 % binomial
//! interval around their 10 % of the users, how long after the start the last
//! user knew their outcome, and Redis's commands per HTTP request.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use reqwest::StatusCode;
use serde_json::Value;
use testkit::sale::SaleSpec;

use crate::context::Bench;
use crate::loadgen::{issue_tokens, signer, UserToken};
use crate::model::{FairnessRun, FairnessSection};
use crate::process::ServerChild;
use crate::redis_info;
use crate::server::StrategyKind;

const UNITS: u32 = 100;
/// Seconds from opening the sale to its start: the waiting room's joins happen
/// in between.
const LEAD_S: i64 = 4;

/// What one user's client saw.
struct Outcome {
    bot: bool,
    won: bool,
    /// Seconds after the start when the client knew its outcome.
    known_after_s: f64,
}

pub async fn section(bench: &mut Bench) -> anyhow::Result<FairnessSection> {
    let users = bench.opts.fairness_users;
    let bots = users / 10;
    let auth = signer(&bench.settings.auth)?;
    let server = bench.start_server(StrategyKind::Service, &[]).await?;
    let mut runs = Vec::new();
    for waiting_room in [false, true] {
        let mode = if waiting_room { "waiting room" } else { "open" };
        eprintln!("== fairness: {mode}, {users} users of whom {bots} bots, {UNITS} units");
        let tokens = issue_tokens(
            &auth,
            &format!("fair-{}-", if waiting_room { "room" } else { "open" }),
            users,
            3600,
        )?;
        let run = sell(bench, &server, waiting_room, tokens, bots).await;
        match run {
            Ok(r) => runs.push(r),
            Err(e) => {
                server.stop().await.ok();
                return Err(e);
            }
        }
    }
    server.stop().await?;
    Ok(FairnessSection {
        users,
        bots,
        units: UNITS,
        runs,
    })
}

async fn sell(
    bench: &mut Bench,
    server: &ServerChild,
    waiting_room: bool,
    tokens: Vec<UserToken>,
    bots: usize,
) -> anyhow::Result<FairnessRun> {
    let spec = SaleSpec {
        sku: Some(bench.next_sku(StrategyKind::Service, "fair")),
        starts_in_secs: LEAD_S,
        waiting_room,
        payment_timeout_secs: 3600,
        ..SaleSpec::new(UNITS)
    };
    bench.open_service_sale(server, &spec).await?;
    let sku = spec.sku.clone().unwrap_or_default();
    let starts = Instant::now() + Duration::from_secs(LEAD_S as u64);
    let base = format!("http://{}", server.addr);
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .build()
        .context("HTTP client")?;
    let sent = Arc::new(AtomicU64::new(0));
    let redis_url = bench.settings.redis.url.clone();
    let before = redis_info::counters(&redis_url).await?;
    let mut tasks = Vec::with_capacity(tokens.len());
    for (i, token) in tokens.into_iter().enumerate() {
        let client = Client {
            http: http.clone(),
            base: base.clone(),
            sku: sku.clone(),
            auth: token
                .authorization
                .to_str()
                .context("a token is not printable")?
                .to_owned(),
            sent: sent.clone(),
        };
        let bot = i < bots;
        tasks.push(tokio::spawn(async move {
            let won = if waiting_room {
                client.through_the_room(bot, starts).await
            } else {
                client.first_come(bot, starts).await
            }?;
            anyhow::Ok(Outcome {
                bot,
                won,
                known_after_s: starts.elapsed().as_secs_f64(),
            })
        }));
    }
    let mut outcomes = Vec::with_capacity(tasks.len());
    for t in tasks {
        outcomes.push(t.await.context("a client task failed")??);
    }
    let after = redis_info::counters(&redis_url).await?;
    let winners = outcomes.iter().filter(|o| o.won).count();
    Ok(FairnessRun {
        mode: if waiting_room { "waiting room" } else { "open" }.into(),
        winners,
        bot_winners: outcomes.iter().filter(|o| o.won && o.bot).count(),
        last_outcome_after_s: outcomes.iter().map(|o| o.known_after_s).fold(0.0, f64::max),
        requests: sent.load(Ordering::Relaxed),
        redis_commands: after.commands.saturating_sub(before.commands),
    })
}

/// One user's client.
struct Client {
    http: reqwest::Client,
    base: String,
    sku: String,
    /// `Bearer …`.
    auth: String,
    sent: Arc<AtomicU64>,
}

impl Client {
    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
    ) -> anyhow::Result<(StatusCode, Option<u64>, Value)> {
        self.sent.fetch_add(1, Ordering::Relaxed);
        let resp = self
            .http
            .request(method, format!("{}{path}", self.base))
            .header("Authorization", &self.auth)
            .send()
            .await
            .with_context(|| path.to_owned())?;
        let status = resp.status();
        let retry = resp
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        let body = resp.json().await.unwrap_or(Value::Null);
        Ok((status, retry, body))
    }

    /// Reserves `tries` times; whether any was a `202`. A winner pays its order.
    async fn reserve(&self, tries: u32) -> anyhow::Result<bool> {
        let mut won = false;
        for _ in 0..tries {
            let (status, _, _) = self
                .call(
                    reqwest::Method::POST,
                    &format!("/flash/{}/reserve", self.sku),
                )
                .await?;
            won |= status == StatusCode::ACCEPTED;
        }
        if won {
            self.pay().await?;
        }
        Ok(won)
    }

    /// Pays the order once the consumer has written it.
    async fn pay(&self) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let (_, _, body) = self
                .call(
                    reqwest::Method::GET,
                    &format!("/flash/{}/reservation", self.sku),
                )
                .await?;
            if let Some(order) = body["order_id"].as_str() {
                let (status, _, body) = self
                    .call(reqwest::Method::POST, &format!("/orders/{order}/pay"))
                    .await?;
                anyhow::ensure!(status == StatusCode::OK, "paying: {status} {body}");
                return Ok(());
            }
            anyhow::ensure!(Instant::now() < deadline, "no order within 60 s");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// First come, first served: bots fire ten times, right at the start; the
    /// others once, 20 ms later (further from the data centre).
    async fn first_come(&self, bot: bool, starts: Instant) -> anyhow::Result<bool> {
        let at = if bot {
            starts
        } else {
            starts + Duration::from_millis(20)
        };
        tokio::time::sleep_until(at.into()).await;
        // Until the start is seen by the server (clocks differ by milliseconds).
        loop {
            let (status, _, body) = self
                .call(
                    reqwest::Method::POST,
                    &format!("/flash/{}/reserve", self.sku),
                )
                .await?;
            if status == StatusCode::FORBIDDEN && body["code"] == "not_started" {
                tokio::time::sleep(Duration::from_millis(5)).await;
                continue;
            }
            if status == StatusCode::ACCEPTED {
                self.pay().await?;
                return Ok(true);
            }
            break;
        }
        if bot {
            return self.reserve(9).await;
        }
        Ok(false)
    }

    /// The waiting room: bots join first and ten times; everyone asks where they
    /// stand as often as `Retry-After` says, and reserves when admitted.
    async fn through_the_room(&self, bot: bool, starts: Instant) -> anyhow::Result<bool> {
        if !bot {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let path = format!("/flash/{}/queue", self.sku);
        for _ in 0..if bot { 10 } else { 1 } {
            let (status, _, body) = self.call(reqwest::Method::POST, &path).await?;
            anyhow::ensure!(
                status == StatusCode::CREATED || status == StatusCode::OK,
                "joining: {status} {body}"
            );
        }
        let deadline = starts + Duration::from_secs(120);
        loop {
            let (status, retry, body) = self.call(reqwest::Method::GET, &path).await?;
            anyhow::ensure!(status == StatusCode::OK, "place: {status} {body}");
            match body["state"].as_str() {
                Some("admitted") => return self.reserve(if bot { 10 } else { 1 }).await,
                Some("sold_out") | Some("expired") => return Ok(false),
                _ => {}
            }
            anyhow::ensure!(Instant::now() < deadline, "still waiting after 120 s");
            tokio::time::sleep(Duration::from_secs(retry.unwrap_or(1).max(1))).await;
        }
    }
}
