//! The crowd: every user of a mega-sale as a client of its own, over a fixed set
//! of keep-alive connections, without a task (or a token allocation) per user.
//!
//! - **Open admission**: user after user, each clicking `clicks` times; a user's
//!   clicks are adjacent, so they are in flight together (a double click).
//! - **Waiting room**: every user joins before the start, then asks once where
//!   they stand while the start is still ahead (as a client counting down
//!   does); from the start each
//!   one asks where they stand as often as `Retry-After` says, reserves
//!   (`clicks` times at once) when admitted, and pays its order, which lets the
//!   room close once nothing can come back. The users' next steps wait in one
//!   time-ordered queue that the connections' workers take from.
//!
//! A user knows their outcome at their `202`, at a `409 sold_out`, or when the
//! room answers `sold_out` or `expired`. Beside the requests a sampler records,
//! every 250 ms, the answers so far by code, the server process's memory and CPU,
//! and Redis's memory, commands and CPU: the timeline the report's phases and the
//! plots are cut from.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use hdrhistogram::Histogram;
use hyper::header::HeaderValue;
use hyper::{Method, StatusCode};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::Notify;

use super::tokens::TokenBook;
use crate::client::{error_code, Conn};
use crate::loadgen::{new_histogram, Latency};
use crate::machine;

/// The answer classes the timeline counts, in this order.
pub const CLASSES: [&str; 9] = [
    "202",
    "200/201",
    "409 sold_out",
    "409 already_reserved",
    "403",
    "429",
    "5xx",
    "lost",
    "other",
];

/// What a user's request is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Kind {
    Join = 0,
    Poll = 1,
    Reserve = 2,
    Pay = 3,
}

pub const KINDS: [&str; 4] = ["join", "poll", "reserve", "pay"];

impl Kind {
    fn of(v: u8) -> Kind {
        match v {
            0 => Kind::Join,
            1 => Kind::Poll,
            2 => Kind::Reserve,
            _ => Kind::Pay,
        }
    }
}

/// A user's flags.
const KNOWN: u8 = 1;
const WON: u8 = 2;
const ADMITTED: u8 = 4;
const JOINED: u8 = 8;

/// What to run.
pub struct CrowdPlan {
    pub addr: SocketAddr,
    pub sku: String,
    pub tokens: Arc<TokenBook>,
    /// How many users of the book take part (the first `users`).
    pub users: usize,
    pub clicks: u32,
    pub connections: usize,
    pub request_timeout: Duration,
    /// Upper bound on the whole run.
    pub max_duration: Duration,
    /// The service's process, for its memory and CPU.
    pub server_pid: Option<u32>,
    pub redis_url: String,
    /// Waiting room: when the sale starts. `None`: open admission.
    pub room_starts_at: Option<Instant>,
}

/// One sample of the timeline.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Sample {
    /// Seconds from the crowd's start.
    pub t_s: f64,
    /// Answers so far, by [`CLASSES`].
    pub answers: Vec<u64>,
    /// Requests answered so far, by [`KINDS`].
    pub kinds: Vec<u64>,
    pub known: u64,
    pub accepted: u64,
    pub server_rss_kib: Option<u64>,
    pub server_cpu_s: Option<f64>,
    pub redis_used_memory: Option<u64>,
    pub redis_commands: Option<u64>,
    pub redis_script_calls: Option<u64>,
    pub redis_cpu_s: Option<f64>,
}

impl Sample {
    pub fn requests(&self) -> u64 {
        self.kinds.iter().sum()
    }
}

/// What the crowd saw.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct CrowdRun {
    pub users: usize,
    pub clicks: u32,
    pub connections: usize,
    /// Answers by request kind, status and code (`reserve 409 sold_out`,
    /// `poll 200 waiting`, …).
    pub answers: BTreeMap<String, u64>,
    /// Requests without an HTTP answer, by kind and cause.
    pub errors: BTreeMap<String, u64>,
    /// Latency by request kind.
    pub latency: BTreeMap<String, Latency>,
    pub requests: u64,
    /// `202` answers, users with at least one, users with more than one.
    pub accepted: u64,
    pub winners: u64,
    pub users_with_several_wins: u64,
    /// Users who learnt their outcome; users who joined (waiting room).
    pub known: u64,
    pub joined: u64,
    /// Waiting room: users admitted.
    pub admitted: u64,
    /// Seconds from the crowd's start: the joins' end, the sale's start
    /// (waiting room), the first and last `202`, the first answer that showed
    /// the draw's places, the last user to learn their outcome, the end.
    pub joins_ended_s: Option<f64>,
    /// When the one poll each user makes before the start ended.
    #[serde(default)]
    pub early_polls_ended_s: Option<f64>,
    pub starts_s: Option<f64>,
    pub first_accept_s: Option<f64>,
    pub last_accept_s: Option<f64>,
    pub draw_seen_s: Option<f64>,
    pub last_known_s: Option<f64>,
    pub ended_s: f64,
    /// Whether the run hit `max_duration` before every user was done.
    pub timed_out: bool,
    pub samples: Vec<Sample>,
}

/// A user's next step, due at `due_us` (microseconds from the start).
type Item = Reverse<(u64, u32, u8)>;

struct Shared {
    t0: Instant,
    classes: [AtomicU64; CLASSES.len()],
    kinds: [AtomicU64; KINDS.len()],
    flags: Vec<AtomicU8>,
    next: AtomicU64,
    known: AtomicU64,
    accepted: AtomicU64,
    several: AtomicU64,
    admitted: AtomicU64,
    first_accept_us: AtomicU64,
    last_accept_us: AtomicU64,
    last_known_us: AtomicU64,
    draw_seen_us: AtomicU64,
    queue: Mutex<BinaryHeap<Item>>,
    in_flight: AtomicU64,
    notify: Notify,
    stop: AtomicBool,
}

impl Shared {
    fn us(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.t0).as_micros()).unwrap_or(u64::MAX)
    }

    fn push(&self, due_us: u64, user: usize, kind: Kind) {
        self.queue
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Reverse((due_us, user as u32, kind as u8)));
        self.notify.notify_one();
    }

    /// The user learnt their outcome (the first time only counts).
    fn knows(&self, user: usize, at: Instant) {
        let before = self.flags[user].fetch_or(KNOWN, Ordering::Relaxed);
        if before & KNOWN == 0 {
            self.known.fetch_add(1, Ordering::Relaxed);
            self.last_known_us.fetch_max(self.us(at), Ordering::Relaxed);
        }
    }

    fn won(&self, user: usize, at: Instant) {
        let us = self.us(at);
        self.accepted.fetch_add(1, Ordering::Relaxed);
        self.first_accept_us.fetch_min(us, Ordering::Relaxed);
        self.last_accept_us.fetch_max(us, Ordering::Relaxed);
        if self.flags[user].fetch_or(WON, Ordering::Relaxed) & WON != 0 {
            self.several.fetch_add(1, Ordering::Relaxed);
        }
        self.knows(user, at);
    }

    fn seconds(&self, us: &AtomicU64) -> Option<f64> {
        let v = us.load(Ordering::Relaxed);
        (v != u64::MAX && v != 0).then(|| v as f64 / 1e6)
    }
}

/// What one worker measured, merged at the end.
struct WorkerOut {
    hist: Vec<Histogram<u64>>,
    answers: BTreeMap<String, u64>,
    errors: BTreeMap<String, u64>,
}

impl WorkerOut {
    fn new() -> anyhow::Result<WorkerOut> {
        Ok(WorkerOut {
            hist: (0..KINDS.len())
                .map(|_| new_histogram())
                .collect::<anyhow::Result<_>>()?,
            answers: BTreeMap::new(),
            errors: BTreeMap::new(),
        })
    }
}

/// One user's request on a worker's connection, counted and timed.
struct Worker {
    conn: Option<Conn>,
    run: Arc<Run>,
    out: WorkerOut,
}

struct Run {
    addr: SocketAddr,
    shared: Arc<Shared>,
    tokens: Arc<TokenBook>,
    users: usize,
    clicks: u32,
    timeout: Duration,
    deadline: Instant,
    /// Waiting room: the polls before the start stop here (2 s before it).
    early_polls_until: Option<Instant>,
    reserve_path: String,
    queue_path: String,
    reservation_path: String,
}

/// An answer: status, `Retry-After` in seconds, body.
type Answer = (StatusCode, Option<u64>, Bytes);

impl Worker {
    /// Sends one request; `None` when no answer came (counted as `lost`).
    async fn send(
        &mut self,
        kind: Kind,
        method: Method,
        path: &str,
        auth: &HeaderValue,
    ) -> Option<Answer> {
        let shared = &self.run.shared;
        if self.conn.is_none() {
            match Conn::connect(self.run.addr).await {
                Ok(c) => self.conn = Some(c),
                Err(_) => {
                    self.lost(kind, "connect");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    return None;
                }
            }
        }
        let conn = self.conn.as_mut()?;
        let started = Instant::now();
        let result = tokio::time::timeout(
            self.run.timeout,
            conn.send_with_retry_after(method, path, Some(auth), None),
        )
        .await;
        match result {
            Ok(Ok((status, retry, body))) => {
                let us = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
                self.out.hist[kind as usize].saturating_record(us.max(1));
                shared.kinds[kind as usize].fetch_add(1, Ordering::Relaxed);
                let code = error_code(&body).unwrap_or("");
                let class = match (status.as_u16(), code) {
                    (202, _) => 0,
                    (200 | 201, _) => 1,
                    (409, "sold_out") => 2,
                    (409, "already_reserved") => 3,
                    (403, _) => 4,
                    (429, _) => 5,
                    (500..=599, _) => 6,
                    _ => 8,
                };
                shared.classes[class].fetch_add(1, Ordering::Relaxed);
                Some((status, retry, body))
            }
            Ok(Err(_)) => {
                self.lost(kind, "io");
                self.conn = None;
                None
            }
            Err(_) => {
                self.lost(kind, "timeout");
                self.conn = None;
                None
            }
        }
    }

    fn lost(&mut self, kind: Kind, why: &str) {
        self.run.shared.classes[7].fetch_add(1, Ordering::Relaxed);
        *self
            .out
            .errors
            .entry(format!("{} {why}", KINDS[kind as usize]))
            .or_insert(0) += 1;
    }

    fn count(&mut self, kind: Kind, status: StatusCode, detail: &str) {
        let label = if detail.is_empty() {
            format!("{} {}", KINDS[kind as usize], status.as_u16())
        } else {
            format!("{} {} {detail}", KINDS[kind as usize], status.as_u16())
        };
        if let Some(n) = self.out.answers.get_mut(&label) {
            *n += 1;
        } else {
            self.out.answers.insert(label, 1);
        }
    }

    /// The counted phases: user after user (`kind` = reserve: `clicks` each).
    async fn counted(mut self, kind: Kind) -> anyhow::Result<WorkerOut> {
        let run = self.run.clone();
        let per_user = if kind == Kind::Reserve {
            u64::from(run.clicks)
        } else {
            1
        };
        let planned = run.users as u64 * per_user;
        let until = match kind {
            Kind::Poll => run.early_polls_until.unwrap_or(run.deadline),
            _ => run.deadline,
        };
        loop {
            let i = run.shared.next.fetch_add(1, Ordering::Relaxed);
            if i >= planned || Instant::now() >= until.min(run.deadline) {
                break;
            }
            let user = (i / per_user) as usize;
            let auth = run.tokens.header(user)?;
            match kind {
                Kind::Join => self.join(user, &auth).await,
                Kind::Poll => self.poll_early(&auth).await,
                _ => {
                    self.reserve(user, &auth, false).await;
                }
            }
        }
        Ok(self.out)
    }

    async fn join(&mut self, user: usize, auth: &HeaderValue) {
        let path = self.run.queue_path.clone();
        if let Some((status, _, body)) = self.send(Kind::Join, Method::POST, &path, auth).await {
            self.count(Kind::Join, status, error_code(&body).unwrap_or(""));
            if status == StatusCode::CREATED || status == StatusCode::OK {
                self.run.shared.flags[user].fetch_or(JOINED, Ordering::Relaxed);
            }
        }
    }

    /// A poll before the start: counted, nothing scheduled (the start is).
    async fn poll_early(&mut self, auth: &HeaderValue) {
        let path = self.run.queue_path.clone();
        if let Some((status, _, body)) = self.send(Kind::Poll, Method::GET, &path, auth).await {
            let detail = if status == StatusCode::OK {
                let place: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                place["state"].as_str().unwrap_or("?").to_owned()
            } else {
                error_code(&body).unwrap_or("").to_owned()
            };
            self.count(Kind::Poll, status, &detail);
        }
    }

    /// One click; in the waiting room a `503`/`429` or a lost answer is tried
    /// again later. Returns whether it was a `202`.
    async fn reserve(&mut self, user: usize, auth: &HeaderValue, room: bool) -> bool {
        let path = self.run.reserve_path.clone();
        let shared = self.run.shared.clone();
        let Some((status, retry, body)) = self.send(Kind::Reserve, Method::POST, &path, auth).await
        else {
            if room {
                shared.push(shared.us(Instant::now()) + 1_000_000, user, Kind::Reserve);
            }
            return false;
        };
        let code = error_code(&body).unwrap_or("");
        self.count(Kind::Reserve, status, code);
        let now = Instant::now();
        match status.as_u16() {
            202 => {
                shared.won(user, now);
                if room {
                    shared.push(shared.us(now) + 200_000, user, Kind::Pay);
                }
                return true;
            }
            409 if code == "sold_out" => shared.knows(user, now),
            429 | 503 if room => {
                let wait = retry.unwrap_or(1).max(1) * 1_000_000;
                shared.push(shared.us(now) + wait, user, Kind::Reserve);
            }
            // The turn ended before the click arrived (it ran out, or the
            // crowd reached the user late): back to the room, as a client
            // does, to hear `expired` or a place.
            403 if room
                && code == "not_admitted"
                && shared.flags[user].fetch_and(!ADMITTED, Ordering::Relaxed) & ADMITTED != 0 =>
            {
                shared.push(shared.us(now) + 1_000_000, user, Kind::Poll);
            }
            _ => {}
        }
        false
    }

    /// The waiting room after the start: the next due step of any user.
    async fn scheduled(mut self) -> anyhow::Result<WorkerOut> {
        let run = self.run.clone();
        let shared = run.shared.clone();
        loop {
            if shared.stop.load(Ordering::Relaxed) || Instant::now() >= run.deadline {
                break;
            }
            let now_us = shared.us(Instant::now());
            let next = {
                let mut q = shared.queue.lock().unwrap_or_else(|p| p.into_inner());
                match q.peek() {
                    Some(Reverse((due, _, _))) if *due <= now_us => {
                        shared.in_flight.fetch_add(1, Ordering::Relaxed);
                        Ok(q.pop())
                    }
                    Some(Reverse((due, _, _))) => Err(Some(*due)),
                    // Read under the lock: a step in flight pushes its user's
                    // next step before it stops counting as in flight.
                    None if shared.in_flight.load(Ordering::Relaxed) == 0 => Err(None),
                    None => Err(Some(now_us + 20_000)),
                }
            };
            match next {
                Ok(Some(Reverse((_, user, kind)))) => {
                    let step = self.step(user as usize, Kind::of(kind)).await;
                    shared.in_flight.fetch_sub(1, Ordering::Relaxed);
                    step?;
                }
                Ok(None) => {}
                Err(due) => {
                    if due.is_none() {
                        // Nothing queued and nothing on its way that could queue more.
                        shared.stop.store(true, Ordering::Relaxed);
                        shared.notify.notify_waiters();
                        break;
                    }
                    let wait = due.map_or(Duration::ZERO, |d| {
                        Duration::from_micros(d.saturating_sub(now_us))
                            .min(Duration::from_millis(20))
                    });
                    tokio::select! {
                        _ = shared.notify.notified() => {}
                        _ = tokio::time::sleep(wait) => {}
                    }
                }
            }
        }
        Ok(self.out)
    }

    async fn step(&mut self, user: usize, kind: Kind) -> anyhow::Result<()> {
        let auth = self.run.tokens.header(user)?;
        match kind {
            Kind::Poll => self.poll(user, &auth).await,
            Kind::Reserve => {
                self.reserve(user, &auth, true).await;
            }
            Kind::Pay => self.pay(user, &auth).await,
            Kind::Join => self.join(user, &auth).await,
        }
        Ok(())
    }

    /// Where do I stand? Then the next step, at the pace `Retry-After` asks.
    async fn poll(&mut self, user: usize, auth: &HeaderValue) {
        let shared = self.run.shared.clone();
        let path = self.run.queue_path.clone();
        let Some((status, retry, body)) = self.send(Kind::Poll, Method::GET, &path, auth).await
        else {
            shared.push(shared.us(Instant::now()) + 1_000_000, user, Kind::Poll);
            return;
        };
        let now = Instant::now();
        let again = shared.us(now) + retry.unwrap_or(1).max(1) * 1_000_000;
        if status != StatusCode::OK {
            self.count(Kind::Poll, status, error_code(&body).unwrap_or(""));
            match status.as_u16() {
                429 | 503 => shared.push(again, user, Kind::Poll),
                // Never joined (404) or refused: nothing more to learn.
                _ => shared.knows(user, now),
            }
            return;
        }
        let place: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        let state = place["state"].as_str().unwrap_or("?");
        self.count(Kind::Poll, status, state);
        match state {
            "admitted" => {
                shared
                    .draw_seen_us
                    .fetch_min(shared.us(now), Ordering::Relaxed);
                if shared.flags[user].fetch_or(ADMITTED, Ordering::Relaxed) & ADMITTED == 0 {
                    shared.admitted.fetch_add(1, Ordering::Relaxed);
                    for _ in 0..self.run.clicks {
                        shared.push(shared.us(now), user, Kind::Reserve);
                    }
                }
            }
            "sold_out" | "expired" => shared.knows(user, now),
            _ => {
                if !place["ahead"].is_null() {
                    shared
                        .draw_seen_us
                        .fetch_min(shared.us(now), Ordering::Relaxed);
                }
                shared.push(again, user, Kind::Poll);
            }
        }
    }

    /// A winner pays its order once the consumer has written it.
    async fn pay(&mut self, user: usize, auth: &HeaderValue) {
        let shared = self.run.shared.clone();
        let path = self.run.reservation_path.clone();
        let Some((status, _, body)) = self.send(Kind::Pay, Method::GET, &path, auth).await else {
            shared.push(shared.us(Instant::now()) + 500_000, user, Kind::Pay);
            return;
        };
        let reservation: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
        let Some(order) = reservation["order_id"].as_str().map(str::to_owned) else {
            self.count(Kind::Pay, status, "no order yet");
            shared.push(shared.us(Instant::now()) + 200_000, user, Kind::Pay);
            return;
        };
        self.count(Kind::Pay, status, "order");
        let pay = format!("/orders/{order}/pay");
        match self.send(Kind::Pay, Method::POST, &pay, auth).await {
            Some((status, _, body)) => {
                self.count(Kind::Pay, status, error_code(&body).unwrap_or("paid"));
                if status.is_server_error() {
                    shared.push(shared.us(Instant::now()) + 500_000, user, Kind::Pay);
                }
            }
            None => shared.push(shared.us(Instant::now()) + 500_000, user, Kind::Pay),
        }
    }
}

/// Runs the crowd; `on_joined` runs once every join was answered (the section
/// measures the room's memory there), before the sale's start is awaited.
pub async fn run<F, Fut>(plan: CrowdPlan, on_joined: F) -> anyhow::Result<CrowdRun>
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    anyhow::ensure!(plan.users >= 1, "at least one user is needed");
    anyhow::ensure!(plan.users <= plan.tokens.len(), "more users than tokens");
    anyhow::ensure!(plan.clicks >= 1, "at least one click per user is needed");
    anyhow::ensure!(plan.connections >= 1, "at least one connection is needed");
    let (shared, run) = prepare(&plan);
    let sampler = Sampler::start(shared.clone(), plan.server_pid, plan.redis_url.clone()).await;
    let driven = drive(&plan, &shared, &run, on_joined).await;
    let samples = sampler.finish().await;
    let (outs, timeline) = driven?;
    Ok(merge(&plan, &shared, outs, samples, timeline))
}

/// Seconds from the crowd's start at which a waiting room's phases ended.
#[derive(Debug, Default)]
struct Timeline {
    joins_ended_s: Option<f64>,
    early_polls_ended_s: Option<f64>,
    starts_s: Option<f64>,
}

/// The phases of the run: the clicks (open), or the joins, one poll each
/// before the start, and then every user's steps from the start (waiting
/// room). Returns the workers' figures and when each phase ended.
async fn drive<F, Fut>(
    plan: &CrowdPlan,
    shared: &Arc<Shared>,
    run: &Arc<Run>,
    on_joined: F,
) -> anyhow::Result<(Vec<WorkerOut>, Timeline)>
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let Some(starts_at) = plan.room_starts_at else {
        let outs = phase(run, plan.connections, Phase::Counted(Kind::Reserve)).await?;
        return Ok((outs, Timeline::default()));
    };
    let mut outs = phase(run, plan.connections, Phase::Counted(Kind::Join)).await?;
    let joins_ended_s = shared.t0.elapsed().as_secs_f64();
    on_joined().await;
    let mut early_polls_ended_s = None;
    if run.early_polls_until.is_some_and(|t| Instant::now() < t) {
        outs.extend(phase(run, plan.connections, Phase::Counted(Kind::Poll)).await?);
        early_polls_ended_s = Some(shared.t0.elapsed().as_secs_f64());
    }
    // Everyone asks where they stand from the start on.
    let due = shared.us(starts_at);
    {
        let mut q = shared.queue.lock().unwrap_or_else(|p| p.into_inner());
        for user in 0..plan.users {
            q.push(Reverse((due, user as u32, Kind::Poll as u8)));
        }
    }
    outs.extend(phase(run, plan.connections, Phase::Scheduled).await?);
    let starts_s = starts_at.saturating_duration_since(shared.t0).as_secs_f64();
    Ok((
        outs,
        Timeline {
            joins_ended_s: Some(joins_ended_s),
            early_polls_ended_s,
            starts_s: Some(starts_s),
        },
    ))
}

/// The shared state and the run's constants for `plan`.
fn prepare(plan: &CrowdPlan) -> (Arc<Shared>, Arc<Run>) {
    let t0 = Instant::now();
    let shared = Arc::new(Shared {
        t0,
        classes: Default::default(),
        kinds: Default::default(),
        flags: (0..plan.users).map(|_| AtomicU8::new(0)).collect(),
        next: AtomicU64::new(0),
        known: AtomicU64::new(0),
        accepted: AtomicU64::new(0),
        several: AtomicU64::new(0),
        admitted: AtomicU64::new(0),
        first_accept_us: AtomicU64::new(u64::MAX),
        last_accept_us: AtomicU64::new(0),
        last_known_us: AtomicU64::new(0),
        draw_seen_us: AtomicU64::new(u64::MAX),
        queue: Mutex::new(BinaryHeap::new()),
        in_flight: AtomicU64::new(0),
        notify: Notify::new(),
        stop: AtomicBool::new(false),
    });
    let run = Arc::new(Run {
        addr: plan.addr,
        shared: shared.clone(),
        tokens: plan.tokens.clone(),
        users: plan.users,
        clicks: plan.clicks,
        timeout: plan.request_timeout,
        deadline: t0 + plan.max_duration,
        early_polls_until: plan
            .room_starts_at
            .and_then(|s| s.checked_sub(Duration::from_secs(2))),
        reserve_path: format!("/flash/{}/reserve", plan.sku),
        queue_path: format!("/flash/{}/queue", plan.sku),
        reservation_path: format!("/flash/{}/reservation", plan.sku),
    });
    (shared, run)
}

/// Joins per second: the plan's users join its room, and nothing else.
pub async fn join_rate(plan: CrowdPlan) -> anyhow::Result<f64> {
    anyhow::ensure!(
        plan.users >= 1 && plan.users <= plan.tokens.len(),
        "between one user and as many as there are tokens"
    );
    let (shared, run) = prepare(&plan);
    phase(&run, plan.connections.max(1), Phase::Counted(Kind::Join)).await?;
    let joined = shared
        .flags
        .iter()
        .filter(|f| f.load(Ordering::Relaxed) & JOINED != 0)
        .count();
    anyhow::ensure!(joined > 0, "no user could join the calibration room");
    Ok(joined as f64 / shared.t0.elapsed().as_secs_f64().max(1e-9))
}

enum Phase {
    Counted(Kind),
    Scheduled,
}

async fn phase(run: &Arc<Run>, connections: usize, phase: Phase) -> anyhow::Result<Vec<WorkerOut>> {
    run.shared.next.store(0, Ordering::Relaxed);
    let mut tasks = Vec::with_capacity(connections);
    for _ in 0..connections {
        let worker = Worker {
            conn: Some(Conn::connect(run.addr).await?),
            run: run.clone(),
            out: WorkerOut::new()?,
        };
        tasks.push(match phase {
            Phase::Counted(kind) => tokio::spawn(worker.counted(kind)),
            Phase::Scheduled => tokio::spawn(worker.scheduled()),
        });
    }
    let mut outs = Vec::with_capacity(tasks.len());
    for t in tasks {
        outs.push(t.await.context("a crowd worker failed")??);
    }
    Ok(outs)
}

fn merge(
    plan: &CrowdPlan,
    shared: &Shared,
    outs: Vec<WorkerOut>,
    samples: Vec<Sample>,
    timeline: Timeline,
) -> CrowdRun {
    let mut hist: Vec<Histogram<u64>> = Vec::new();
    let mut answers = BTreeMap::new();
    let mut errors = BTreeMap::new();
    for out in outs {
        if hist.is_empty() {
            hist = out.hist;
        } else {
            for (h, o) in hist.iter_mut().zip(&out.hist) {
                // Same bounds everywhere: adding cannot fail.
                let _ = h.add(o);
            }
        }
        for (k, v) in out.answers {
            *answers.entry(k).or_insert(0) += v;
        }
        for (k, v) in out.errors {
            *errors.entry(k).or_insert(0) += v;
        }
    }
    let latency = hist
        .iter()
        .enumerate()
        .filter(|(_, h)| !h.is_empty())
        .map(|(i, h)| (KINDS[i].to_owned(), Latency::of(h)))
        .collect();
    let flags: Vec<u8> = shared
        .flags
        .iter()
        .map(|f| f.load(Ordering::Relaxed))
        .collect();
    let timed_out = !shared.stop.load(Ordering::Relaxed) && plan.room_starts_at.is_some();
    CrowdRun {
        users: plan.users,
        clicks: plan.clicks,
        connections: plan.connections,
        answers,
        errors,
        latency,
        requests: shared.kinds.iter().map(|k| k.load(Ordering::Relaxed)).sum(),
        accepted: shared.accepted.load(Ordering::Relaxed),
        winners: flags.iter().filter(|f| *f & WON != 0).count() as u64,
        users_with_several_wins: shared.several.load(Ordering::Relaxed),
        known: shared.known.load(Ordering::Relaxed),
        joined: flags.iter().filter(|f| *f & JOINED != 0).count() as u64,
        admitted: shared.admitted.load(Ordering::Relaxed),
        joins_ended_s: timeline.joins_ended_s,
        early_polls_ended_s: timeline.early_polls_ended_s,
        starts_s: timeline.starts_s,
        first_accept_s: shared.seconds(&shared.first_accept_us),
        last_accept_s: shared.seconds(&shared.last_accept_us),
        draw_seen_s: shared.seconds(&shared.draw_seen_us),
        last_known_s: shared.seconds(&shared.last_known_us),
        ended_s: shared.t0.elapsed().as_secs_f64(),
        timed_out,
        samples,
    }
}

/// Samples the timeline every 250 ms until finished.
struct Sampler {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Vec<Sample>>,
}

impl Sampler {
    /// Starts sampling; returns once the first sample (before any request) is taken.
    async fn start(shared: Arc<Shared>, pid: Option<u32>, redis_url: String) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let (first, first_taken) = tokio::sync::oneshot::channel();
        let task = {
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut redis = match redis::Client::open(redis_url.as_str()) {
                    Ok(c) => c.get_multiplexed_async_connection().await.ok(),
                    Err(_) => None,
                };
                let mut samples = vec![sample(&shared, pid, redis.as_mut()).await];
                let _ = first.send(());
                let mut tick = tokio::time::interval(Duration::from_millis(250));
                tick.tick().await;
                loop {
                    tick.tick().await;
                    samples.push(sample(&shared, pid, redis.as_mut()).await);
                    if stop.load(Ordering::Relaxed) {
                        return samples;
                    }
                }
            })
        };
        let _ = first_taken.await;
        Sampler { stop, task }
    }

    async fn finish(self) -> Vec<Sample> {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap_or_default()
    }
}

async fn sample(
    shared: &Shared,
    pid: Option<u32>,
    redis: Option<&mut redis::aio::MultiplexedConnection>,
) -> Sample {
    let mut s = Sample {
        t_s: shared.t0.elapsed().as_secs_f64(),
        answers: shared
            .classes
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect(),
        kinds: shared
            .kinds
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect(),
        known: shared.known.load(Ordering::Relaxed),
        accepted: shared.accepted.load(Ordering::Relaxed),
        server_rss_kib: pid.and_then(|p| machine::process_memory_kib(p).map(|m| m.0)),
        server_cpu_s: pid.and_then(machine::process_cpu_s),
        ..Sample::default()
    };
    if let Some(conn) = redis {
        let info: redis::RedisResult<String> =
            redis::cmd("INFO").arg("all").query_async(conn).await;
        if let Ok(info) = info {
            let r = crate::redis_info::parse(&info);
            s.redis_used_memory = Some(r.used_memory);
            s.redis_commands = Some(r.commands);
            s.redis_script_calls = Some(r.script_calls);
            s.redis_cpu_s = Some(r.cpu_s);
        }
    }
    s
}
