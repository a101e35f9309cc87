//! A campaign's buyers and operators: every choice drawn from the seed (each
//! buyer from a stream of its own, so timing never shifts another's draws).
//!
//! - an open sale's buyer reserves, sometimes twice at once (a double click);
//! - a waiting room's buyer joins, polls its place, reserves once admitted (or
//!   walks away and lets the turn expire), and keeps polling while told
//!   `sold_out`, as docs/API.md version 3 lets it;
//! - a buyer who got a reservation pays for it or not, sometimes after its
//!   deadline (`409 expired`), so orders lapse and units come back;
//! - an operator adds stock now and then.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;
use testkit::api::{Api, Caller};
use testkit::availability::Sample;
use testkit::rng::Rng;

/// A joined user the room answers `404` for this long is taken as forgotten.
const FORGOTTEN: Duration = Duration::from_secs(10);

/// What one buyer does, drawn before the run starts.
#[derive(Debug, Clone)]
pub struct Buyer {
    pub user: String,
    /// From the start of the sale's busy part.
    pub arrives: Duration,
    /// The instance its requests go to.
    pub via: usize,
    pub double_click: bool,
    /// Pays for its order, this long after it exists (may be past its deadline).
    pub pays_after: Option<Duration>,
    /// Once admitted, never reserves (its turn expires).
    pub walks_away: bool,
    /// How often it asks for its place in the waiting room.
    pub poll: Duration,
}

impl Buyer {
    pub fn draw(seed: u64, i: usize, plan: &super::Plan) -> Buyer {
        let mut rng = Rng::fork(seed, 1_000 + i as u64);
        let busy = plan.busy.as_millis() as u64;
        // A crowd at the start, then a trickle (a flash sale's shape).
        let arrives = match rng.chance(0.4) {
            true => rng.millis(0, busy / 10),
            false => rng.millis(0, busy),
        };
        let timeout_ms = u64::from(plan.payment_timeout_secs) * 1000;
        Buyer {
            user: format!("c{i}"),
            arrives,
            via: rng.below(plan.services as u64) as usize,
            double_click: rng.chance(plan.double_click),
            pays_after: rng
                .chance(plan.pay)
                .then(|| rng.millis(0, timeout_ms * 13 / 10)),
            walks_away: plan.waiting_room && rng.chance(plan.walk_away),
            poll: rng.millis(250, 700),
        }
    }
}

/// Everything the buyers saw, for the checks.
#[derive(Default)]
pub struct Tally {
    /// Every reservation answer with its timing.
    pub samples: Vec<Sample>,
    /// Users who joined the waiting room (`201` or `200`).
    pub joined: Vec<String>,
    /// Orders whose payment was answered `200`.
    pub paid: Vec<String>,
    /// Payment and top-up answers by status (or `lost`).
    pub payments: BTreeMap<String, usize>,
    pub top_ups: BTreeMap<String, usize>,
}

/// Shared by the buyers and the campaign.
#[derive(Clone)]
pub struct Crowd {
    /// Every instance's doors; a buyer uses the one it was drawn.
    pub apis: Arc<Vec<Api>>,
    pub sku: String,
    pub tally: Arc<Mutex<Tally>>,
    /// Buyers still acting (not merely polling a `sold_out`).
    pub active: Arc<AtomicUsize>,
    /// Set once the campaign has checked: pollers stop.
    pub stop: Arc<AtomicBool>,
}

fn key(status: Result<u16, reqwest::Error>) -> String {
    status
        .map(|s| s.to_string())
        .unwrap_or_else(|_| "lost".into())
}

impl Crowd {
    fn tally(&self) -> std::sync::MutexGuard<'_, Tally> {
        self.tally.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn api(&self, via: usize) -> &Api {
        &self.apis[via % self.apis.len()]
    }

    /// One buyer's whole life, from its arrival.
    pub async fn buy(self, b: Buyer, room: bool, started: Instant) {
        tokio::time::sleep_until((started + b.arrives).into()).await;
        let token = self.api(b.via).token(&b.user);
        let caller = Caller::Token(&token);
        let reserved = match room {
            false => self.reserve(&b, caller).await,
            true => self.wait_turn(&b, caller).await,
        };
        if let (true, Some(after)) = (reserved, b.pays_after) {
            self.pay(&b, caller, after).await;
        }
        self.active.fetch_sub(1, Ordering::SeqCst);
    }

    /// Reserves (twice at once on a double click); whether it holds one now.
    async fn reserve(&self, b: &Buyer, caller: Caller<'_>) -> bool {
        let click = || Sample::take(self.api(b.via).reserve(&self.sku, caller), b.via);
        let samples = match b.double_click {
            true => {
                let (first, second) = tokio::join!(click(), click());
                vec![first, second]
            }
            false => vec![click().await],
        };
        let held = samples.iter().any(|s| {
            s.answer.status == Some(202) || s.answer.code.as_deref() == Some("already_reserved")
        });
        self.tally().samples.extend(samples);
        held
    }

    /// Joins the room and waits for a turn; whether it reserved.
    async fn wait_turn(&self, b: &Buyer, caller: Caller<'_>) -> bool {
        if !self.join(b, caller).await {
            return false;
        }
        let mut told_sold_out = false;
        let mut forgotten: Option<Instant> = None;
        while !self.stop.load(Ordering::SeqCst) {
            let place = self.place(b, caller).await;
            if place["state"] != "forgotten" {
                forgotten = None;
            }
            let step = self
                .on_place(b, caller, &place, &mut told_sold_out, &mut forgotten)
                .await;
            if let Some(reserved) = step {
                return reserved;
            }
            let pace = match told_sold_out {
                true => Duration::from_secs(1),
                false => b.poll,
            };
            tokio::time::sleep(pace).await;
        }
        // Stopped while told sold_out: counted out already; `buy` counts out once.
        if told_sold_out {
            self.active.fetch_add(1, Ordering::SeqCst);
        }
        false
    }

    /// Joins, retried through faults: a user who never got in is no one's to
    /// tell. Whether it joined.
    async fn join(&self, b: &Buyer, caller: Caller<'_>) -> bool {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let status = self
                .api(b.via)
                .join_queue(&self.sku, caller)
                .send()
                .await
                .map(|r| r.status().as_u16());
            if let Ok(200 | 201) = status {
                self.tally().joined.push(b.user.clone());
                return true;
            }
            if Instant::now() > deadline || self.stop.load(Ordering::SeqCst) {
                return false;
            }
            tokio::time::sleep(b.poll).await;
        }
    }

    /// The buyer's place as the room answers it (`forgotten` for a `404`,
    /// empty when there was no answer).
    async fn place(&self, b: &Buyer, caller: Caller<'_>) -> Value {
        let request = self.api(b.via).queue_place(&self.sku, caller);
        async {
            let resp = request.send().await.ok()?;
            if resp.status() == reqwest::StatusCode::NOT_FOUND {
                return Some(serde_json::json!({ "state": "forgotten" }));
            }
            resp.json::<Value>().await.ok()
        }
        .await
        .unwrap_or_default()
    }

    /// What the buyer does on hearing its place: `Some(reserved)` once its
    /// wait is over, `None` to keep polling.
    async fn on_place(
        &self,
        b: &Buyer,
        caller: Caller<'_>,
        place: &Value,
        told_sold_out: &mut bool,
        forgotten: &mut Option<Instant>,
    ) -> Option<bool> {
        match place["state"].as_str() {
            // Joined, and unknown to the room for longer than a rebuild takes:
            // nothing will tell this user anything (the checks report it).
            Some("forgotten")
                if forgotten.get_or_insert_with(Instant::now).elapsed() > FORGOTTEN =>
            {
                self.back(told_sold_out);
                Some(false)
            }
            Some("forgotten") => None,
            // Reserved already (an answer lost on the way).
            Some("admitted") if place["admitted_until"].is_null() => {
                self.back(told_sold_out);
                Some(true)
            }
            Some("admitted") if b.walks_away => {
                self.back(told_sold_out);
                Some(false)
            }
            Some("admitted") => {
                self.back(told_sold_out);
                self.reserve(b, caller).await.then_some(true)
            }
            Some("expired") => {
                self.back(told_sold_out);
                Some(false)
            }
            // Not final while the sale is open (docs/API.md, version 3): a buyer
            // still polling keeps its place if units come back.
            Some("sold_out") if !*told_sold_out => {
                *told_sold_out = true;
                self.active.fetch_sub(1, Ordering::SeqCst);
                None
            }
            _ => None,
        }
    }

    /// A buyer told `sold_out` who is moving again counts as acting.
    fn back(&self, told_sold_out: &mut bool) {
        if std::mem::take(told_sold_out) {
            self.active.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Waits for the order, then pays `after` its creation.
    async fn pay(&self, b: &Buyer, caller: Caller<'_>, after: Duration) {
        let api = self.api(b.via);
        let deadline = Instant::now() + Duration::from_secs(30);
        let order = loop {
            let view = async {
                let resp = api.reservation(&self.sku, caller).send().await.ok()?;
                resp.json::<Value>().await.ok()
            }
            .await
            .unwrap_or_default();
            if let Some(id) = view["order_id"].as_str() {
                break id.to_owned();
            }
            if matches!(view["status"].as_str(), Some("failed")) || Instant::now() > deadline {
                return;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        };
        tokio::time::sleep(after).await;
        let status = api
            .pay(&order, caller)
            .send()
            .await
            .map(|r| r.status().as_u16());
        let mut tally = self.tally();
        if let Ok(200) = status {
            tally.paid.push(order);
        }
        *tally.payments.entry(key(status)).or_default() += 1;
    }

    /// An operator adds `units` at `at` from the start.
    pub async fn top_up(self, activity: String, at: Duration, units: u32, started: Instant) {
        tokio::time::sleep_until((started + at).into()).await;
        let status = self
            .api(0)
            .top_up(&activity, &serde_json::json!({ "add": units }))
            .send()
            .await
            .map(|r| r.status().as_u16());
        *self.tally().top_ups.entry(key(status)).or_default() += 1;
    }
}
