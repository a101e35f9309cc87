//! The day's buyers: one pool of users shared by every sale (so a user holds
//! reservations in several sales at once), talking to the public HTTP API of
//! both instances in turn, as the buyer's page does: click, poll the
//! reservation until it is an order, pay it or let it lapse; in a waiting room,
//! join before the start, poll the place at the pace the service asks, reserve
//! once admitted.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use testkit::api::{Api, Caller};
use testkit::availability::Sample;
use testkit::rng::Rng;
use tokio::task::JoinSet;

/// Requests sent, by kind (for queries and commands per request).
#[derive(Debug, Default)]
pub struct Sent {
    pub reserve: AtomicU64,
    pub reservation_poll: AtomicU64,
    pub pay: AtomicU64,
    pub join: AtomicU64,
    pub place_poll: AtomicU64,
}

impl Sent {
    pub fn total(&self) -> u64 {
        [
            &self.reserve,
            &self.reservation_poll,
            &self.pay,
            &self.join,
            &self.place_poll,
        ]
        .iter()
        .map(|c| c.load(Ordering::Relaxed))
        .sum()
    }
}

/// The buyers' side of the day.
#[derive(Clone)]
pub struct Shop {
    pub apis: Arc<Vec<Api>>,
    pub users: Arc<Vec<String>>,
    pub sent: Arc<Sent>,
    /// Of the winners, the share who pay; the others let the order lapse.
    pub pay_share: f64,
}

/// What one sale's buyers got.
#[derive(Debug, Default)]
pub struct Took {
    /// Every reservation answer (`POST /flash/{sku}/reserve`).
    pub reserves: Vec<Sample>,
    /// Every waiting-room answer (join and place polls), for the time without
    /// service of a sale whose buyers mostly wait.
    pub room: Vec<Sample>,
    /// The users who joined the waiting room.
    pub joined: Vec<String>,
    pub follow: FollowUps,
}

/// What the winners did after their `202`.
#[derive(Debug, Default, Clone, Serialize)]
pub struct FollowUps {
    pub polls: u64,
    /// Poll answers by status.
    pub poll_status: BTreeMap<u16, u64>,
    pub paid: u64,
    pub pay_refused: u64,
    /// Winners whose reservation never showed an order within the polls.
    pub never_ordered: u64,
}

impl FollowUps {
    fn add(&mut self, other: &FollowUps) {
        self.polls += other.polls;
        for (k, v) in &other.poll_status {
            *self.poll_status.entry(*k).or_default() += v;
        }
        self.paid += other.paid;
        self.pay_refused += other.pay_refused;
        self.never_ordered += other.never_ordered;
    }
}

/// Polls of one winner's reservation: once a second, at most this many.
const POLLS: u32 = 10;

impl Shop {
    fn api(&self, k: usize) -> (usize, &Api) {
        let via = k % self.apis.len();
        (via, &self.apis[via])
    }

    /// An open sale: `clicks_per_s` clicks a second, each a random user of the
    /// pool, from `from` until `until`; each winner follows up.
    pub async fn open_sale(
        &self,
        sku: String,
        clicks_per_s: f64,
        from: Instant,
        until: Instant,
        seed: u64,
    ) -> Took {
        tokio::time::sleep_until(from.into()).await;
        let mut rng = Rng::new(seed);
        let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / clicks_per_s.max(0.1)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let reserves = Arc::new(Mutex::new(Vec::new()));
        let follow = Arc::new(Mutex::new(FollowUps::default()));
        let mut tasks = JoinSet::new();
        let mut k = 0usize;
        while Instant::now() < until {
            tick.tick().await;
            let user = self.users[rng.below(self.users.len() as u64) as usize].clone();
            let pays = (rng.below(1000) as f64) < self.pay_share * 1000.0;
            let shop = self.clone();
            let sku = sku.clone();
            let (reserves, follow) = (reserves.clone(), follow.clone());
            tasks.spawn(async move {
                shop.click(&sku, &user, k, pays, &reserves, &follow).await;
            });
            k += 1;
        }
        while tasks.join_next().await.is_some() {}
        Took {
            reserves: take(&reserves),
            follow: take(&follow),
            ..Took::default()
        }
    }

    /// One click, and what its winner does next.
    async fn click(
        &self,
        sku: &str,
        user: &str,
        k: usize,
        pays: bool,
        reserves: &Mutex<Vec<Sample>>,
        follow: &Mutex<FollowUps>,
    ) {
        let (via, api) = self.api(k);
        self.sent.reserve.fetch_add(1, Ordering::Relaxed);
        let sample = Sample::take(api.reserve(sku, Caller::User(user)), via).await;
        let won = sample.answer.status == Some(202);
        reserves
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(sample);
        if won {
            let done = self.follow_up(sku, user, k + 1, pays).await;
            follow.lock().unwrap_or_else(|e| e.into_inner()).add(&done);
        }
    }

    /// The buyer's page after a `202`: polls the reservation once a second
    /// until it is an order, then pays it (or lets it lapse).
    async fn follow_up(&self, sku: &str, user: &str, k: usize, pays: bool) -> FollowUps {
        let mut done = FollowUps::default();
        for i in 0..POLLS {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let (_, api) = self.api(k + i as usize);
            self.sent.reservation_poll.fetch_add(1, Ordering::Relaxed);
            done.polls += 1;
            let Ok(resp) = api.reservation(sku, Caller::User(user)).send().await else {
                continue;
            };
            *done.poll_status.entry(resp.status().as_u16()).or_default() += 1;
            let body: serde_json::Value = resp.json().await.unwrap_or_default();
            let Some(order_id) = body["order_id"].as_str() else {
                continue;
            };
            if pays && body["status"] == "ordered" {
                self.sent.pay.fetch_add(1, Ordering::Relaxed);
                match api.pay(order_id, Caller::User(user)).send().await {
                    Ok(r) if r.status().is_success() => done.paid += 1,
                    _ => done.pay_refused += 1,
                }
            }
            return done;
        }
        done.never_ordered += 1;
        done
    }

    /// A waiting room: `joiners` users of the pool (distinct) join between
    /// now and `starts`, poll their place at the pace the service asks (at
    /// most every `cap`), reserve once admitted; until `ends`.
    pub async fn waiting_room(
        &self,
        sku: String,
        joiners: usize,
        starts: Instant,
        ends: Instant,
        seed: u64,
    ) -> Took {
        let mut rng = Rng::new(seed);
        let mut picked: Vec<String> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        while picked.len() < joiners.min(self.users.len()) {
            let u = &self.users[rng.below(self.users.len() as u64) as usize];
            if seen.insert(u.clone()) {
                picked.push(u.clone());
            }
        }
        let lead = starts.saturating_duration_since(Instant::now());
        let reserves = Arc::new(Mutex::new(Vec::new()));
        let room = Arc::new(Mutex::new(Vec::new()));
        let follow = Arc::new(Mutex::new(FollowUps::default()));
        let mut tasks = JoinSet::new();
        for (k, user) in picked.iter().enumerate() {
            // Joins spread over the lead, none in its last two seconds.
            let at = Instant::now()
                + lead
                    .saturating_sub(Duration::from_secs(2))
                    .mul_f64(rng.below(1000) as f64 / 1000.0);
            let pays = (rng.below(1000) as f64) < self.pay_share * 1000.0;
            let shop = self.clone();
            let (sku, user) = (sku.clone(), user.clone());
            let (reserves, room, follow) = (reserves.clone(), room.clone(), follow.clone());
            tasks.spawn(async move {
                tokio::time::sleep_until(at.into()).await;
                let joined = shop
                    .wait_turn(&sku, &user, k, pays, ends, &reserves, &room, &follow)
                    .await;
                joined.then_some(user)
            });
        }
        let mut joined = Vec::new();
        while let Some(done) = tasks.join_next().await {
            if let Ok(Some(user)) = done {
                joined.push(user);
            }
        }
        Took {
            reserves: take(&reserves),
            room: take(&room),
            joined,
            follow: take(&follow),
        }
    }

    /// One joiner, until their outcome or the sale's end; whether they ever
    /// joined.
    #[allow(clippy::too_many_arguments)]
    async fn wait_turn(
        &self,
        sku: &str,
        user: &str,
        k: usize,
        pays: bool,
        ends: Instant,
        reserves: &Mutex<Vec<Sample>>,
        room: &Mutex<Vec<Sample>>,
        follow: &Mutex<FollowUps>,
    ) -> bool {
        let (via, api) = self.api(k);
        self.sent.join.fetch_add(1, Ordering::Relaxed);
        let joined = Sample::take(api.join_queue(sku, Caller::User(user)), via).await;
        let mut ok = is_joined(&joined);
        let mut ever = ok;
        room.lock().unwrap_or_else(|e| e.into_inner()).push(joined);
        let mut i = k;
        while Instant::now() < ends {
            i += 1;
            let (via, api) = self.api(i);
            if !ok {
                // Not joined (no answer, or an instance that has not seen the
                // new sale yet): join again (it is idempotent).
                self.sent.join.fetch_add(1, Ordering::Relaxed);
                let again = Sample::take(api.join_queue(sku, Caller::User(user)), via).await;
                ok = is_joined(&again);
                ever |= ok;
                room.lock().unwrap_or_else(|e| e.into_inner()).push(again);
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
            self.sent.place_poll.fetch_add(1, Ordering::Relaxed);
            let sent = Instant::now();
            let resp = api.queue_place(sku, Caller::User(user)).send().await;
            let (status, retry, state) = match resp {
                Ok(r) => {
                    let status = r.status().as_u16();
                    let retry = r
                        .headers()
                        .get("retry-after")
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.parse::<u64>().ok());
                    let body: serde_json::Value = r.json().await.unwrap_or_default();
                    (
                        Some(status),
                        retry,
                        body["state"].as_str().map(str::to_owned),
                    )
                }
                Err(_) => (None, None, None),
            };
            room.lock().unwrap_or_else(|e| e.into_inner()).push(Sample {
                sent,
                received: Instant::now(),
                answer: testkit::invariants::Answer {
                    status,
                    ..Default::default()
                },
                via,
            });
            match state.as_deref() {
                Some("admitted") => {
                    self.sent.reserve.fetch_add(1, Ordering::Relaxed);
                    let sample = Sample::take(api.reserve(sku, Caller::User(user)), via).await;
                    let answer = sample.answer.clone();
                    reserves
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(sample);
                    match (answer.status, answer.code.as_deref()) {
                        (Some(202), _) => {
                            let done = self.follow_up(sku, user, i + 1, pays).await;
                            follow.lock().unwrap_or_else(|e| e.into_inner()).add(&done);
                            return true;
                        }
                        // Holds one already (an answer lost on the way).
                        (Some(409), Some("already_reserved")) => return true,
                        // Sold out within the turn, or no answer: the turn
                        // stays, and units may come back within it.
                        _ => tokio::time::sleep(Duration::from_secs(1)).await,
                    }
                }
                Some("expired") => return true,
                // Redis no longer knows the user (a room it lost): join again.
                None if status == Some(404) => {
                    ok = false;
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                // Waiting, or sold out while units may still come back.
                _ => {
                    let wait = retry.unwrap_or(1).clamp(1, 5);
                    tokio::time::sleep(Duration::from_secs(wait)).await;
                }
            }
        }
        ever
    }
}

/// `201` joined now, `200` joined before.
fn is_joined(answer: &Sample) -> bool {
    matches!(answer.answer.status, Some(200 | 201))
}

fn take<T: Default>(m: &Arc<Mutex<T>>) -> T {
    std::mem::take(&mut *m.lock().unwrap_or_else(|e| e.into_inner()))
}
