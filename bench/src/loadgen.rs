//! The load generator: a sale of U users × C clicks against one SKU.
//!
//! Every request is `POST /flash/{sku}/reserve` with the user's own bearer token.
//! A fixed set of keep-alive connections (one worker task each) takes request
//! numbers from a shared counter, so the run is bounded in count (U × C) and in time
//! (`max_duration`), whichever ends first.
//!
//! Two paces:
//! - **fixed concurrency** (closed loop): each connection sends its next request as
//!   soon as the previous answer arrives. This finds the saturation throughput; the
//!   latency then is mostly queueing (Little's law: latency ≈ connections / rate).
//! - **target rate** (open loop): request `i` is due at `t0 + i / rate`, whatever the
//!   server does. A request that a busy connection could only start late is timed
//!   from when it was due, not from when it was sent, so a slow server cannot hide
//!   its stalls by slowing the generator down ("coordinated omission"). A request
//!   started on time is timed from its real start, so the timer's own granularity
//!   (about 1 ms in Tokio) is not charged to the server.
//!
//! Clicks of one user are adjacent in the order by default: a user's double click
//! arrives as two requests in flight at once, which is what per-user limits must
//! survive. `ClickOrder::Shuffled` spreads them instead.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use flashsale::auth::Auth;
use flashsale::config::AuthSettings;
use hdrhistogram::Histogram;
use hyper::header::HeaderValue;
use hyper::{Method, StatusCode};
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::client::{error_code, Conn};
use crate::clock::unix_ms;

/// One simulated user and the `Authorization` header its requests carry.
#[derive(Clone)]
pub struct UserToken {
    pub id: String,
    pub authorization: HeaderValue,
}

/// The service's own token signer, from its settings: the tokens it signs are the
/// ones the server under test accepts.
pub fn signer(auth: &AuthSettings) -> anyhow::Result<Auth> {
    Auth::new(auth.admin_token.clone(), &auth.user_token_secret)
}

/// Signs `n` user tokens (`{prefix}{i}`), spread over the machine's cores: a few
/// hundred thousand HS256 signatures take about a second on one core.
pub fn issue_tokens(
    auth: &Auth,
    prefix: &str,
    n: usize,
    ttl_secs: i64,
) -> anyhow::Result<Vec<UserToken>> {
    let threads = std::thread::available_parallelism().map_or(1, |p| p.get());
    let chunk = n.div_ceil(threads.max(1)).max(1);
    let parts: Vec<anyhow::Result<Vec<UserToken>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n)
            .step_by(chunk)
            .map(|start| {
                let end = (start + chunk).min(n);
                scope.spawn(move || -> anyhow::Result<Vec<UserToken>> {
                    (start..end)
                        .map(|i| {
                            let id = format!("{prefix}{i}");
                            let token = auth.issue(&id, ttl_secs)?;
                            let authorization = HeaderValue::from_str(&format!("Bearer {token}"))
                                .context("a token is not a valid header value")?;
                            Ok(UserToken { id, authorization })
                        })
                        .collect()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("token thread panicked")))
            })
            .collect()
    });
    let mut out = Vec::with_capacity(n);
    for part in parts {
        out.extend(part?);
    }
    Ok(out)
}

/// In which order the U × C requests are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ClickOrder {
    /// A user's clicks follow each other: they are in flight together (double clicks).
    Adjacent,
    /// All clicks in a random (seeded) order.
    Shuffled,
}

/// What to run.
pub struct Plan {
    pub label: String,
    pub addr: SocketAddr,
    pub sku: String,
    pub users: Vec<UserToken>,
    pub clicks: u32,
    /// Open connections; in closed-loop mode also the concurrency.
    pub connections: usize,
    /// Requests per second (open loop); `None` for fixed concurrency.
    pub rate: Option<f64>,
    pub max_duration: Duration,
    /// Answers to requests started in the first `warmup` are counted but not timed.
    pub warmup: Duration,
    pub order: ClickOrder,
    pub request_timeout: Duration,
    /// Units on sale, for the invariant check (`None`: do not check winners = units).
    pub units: Option<u64>,
    pub progress: bool,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Latency {
    pub count: u64,
    pub min_ms: f64,
    pub mean_ms: f64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
}

impl Latency {
    /// Summary of a histogram recorded in microseconds.
    pub fn of(h: &Histogram<u64>) -> Latency {
        if h.is_empty() {
            return Latency::default();
        }
        let ms = |us: u64| us as f64 / 1000.0;
        Latency {
            count: h.len(),
            min_ms: ms(h.min()),
            mean_ms: h.mean() / 1000.0,
            p50_ms: ms(h.value_at_quantile(0.50)),
            p90_ms: ms(h.value_at_quantile(0.90)),
            p99_ms: ms(h.value_at_quantile(0.99)),
            p999_ms: ms(h.value_at_quantile(0.999)),
            max_ms: ms(h.max()),
        }
    }
}

/// (latency in ms, fraction of requests at or below it), dense in the tail.
pub fn cdf_points(h: &Histogram<u64>) -> Vec<(f64, f64)> {
    if h.is_empty() {
        return Vec::new();
    }
    let mut qs: Vec<f64> = (0..100).map(|i| f64::from(i) / 100.0).collect();
    qs.extend((1..10).map(|i| 0.99 + f64::from(i) / 1000.0));
    qs.extend((1..10).map(|i| 0.999 + f64::from(i) / 10_000.0));
    qs.extend([0.99995, 0.99999, 1.0]);
    qs.into_iter()
        .map(|q| (h.value_at_quantile(q) as f64 / 1000.0, q))
        .collect()
}

/// A new histogram for microsecond latencies from 1 µs to 5 minutes, 3 significant
/// digits (0.1 % resolution).
pub fn new_histogram() -> anyhow::Result<Histogram<u64>> {
    Histogram::new_with_bounds(1, 300_000_000, 3).context("invalid histogram bounds")
}

/// The sale's invariants as the clients saw them.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SaleCheck {
    pub units: Option<u64>,
    /// `202` answers.
    pub accepted: u64,
    /// Users with at least one `202`.
    pub winners: u64,
    /// Users with two or more `202`s: each one broke "one per user".
    pub users_with_several_wins: u64,
    pub most_wins_of_one_user: u32,
    /// Whether any `409 sold_out` was answered.
    pub sold_out: bool,
    /// Seconds from the start of the load to the last `202`.
    pub last_accept_after_s: Option<f64>,
    /// winners = units, when the sale sold out; `None` when it did not (or no units
    /// were given).
    pub winners_equal_units: Option<bool>,
    /// Never more `202`s than units.
    pub no_oversell: Option<bool>,
    pub no_user_twice: bool,
    /// When each `202` arrived, in milliseconds from the start of the load, for
    /// the first [`ACCEPT_LOG_CAP`] of them.
    #[serde(default)]
    pub accept_times_ms: Vec<f64>,
}

/// How many `202` arrival times a run keeps: every one of a flash sale's, a
/// saturation run's first few.
pub const ACCEPT_LOG_CAP: u64 = 10_000;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TimelinePoint {
    pub t_s: f64,
    pub answered: u64,
    pub accepted: u64,
}

/// Everything one run measured; the `loadtest` binary prints it and writes it as JSON.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LoadReport {
    pub label: String,
    pub sku: String,
    /// "concurrency" or "rate".
    pub mode: String,
    pub connections: usize,
    pub target_rate: Option<f64>,
    pub users: usize,
    pub clicks: u32,
    pub order: ClickOrder,
    pub planned: u64,
    /// Requests started (the run may end on time before all are sent).
    pub started: u64,
    /// HTTP answers of any status.
    pub answered: u64,
    /// Answers counted by "status code" (`202`, `409 sold_out`, …).
    pub codes: BTreeMap<String, u64>,
    /// Requests without an HTTP answer, by kind (`connect`, `io`, `timeout`).
    pub errors: BTreeMap<String, u64>,
    /// Wall-clock bounds of the measured window (after the warm-up), for matching
    /// other processes' samples (CPU, side query) to this run.
    pub window_start_unix_ms: f64,
    pub window_end_unix_ms: f64,
    pub window_s: f64,
    /// Answers to requests started inside the window, and their rate.
    pub measured: u64,
    pub throughput_rps: f64,
    pub latency: Latency,
    pub cdf: Vec<(f64, f64)>,
    /// Open loop only: requests that started behind schedule because every
    /// connection was busy (their latency includes the wait).
    pub late_starts: u64,
    pub timeline: Vec<TimelinePoint>,
    pub sale: SaleCheck,
}

/// State the workers share: the next request number and the per-user win counts.
struct Shared {
    next: AtomicU64,
    answered: AtomicU64,
    accepted: AtomicU64,
    /// Microseconds from t0 to the latest 202.
    last_accept_us: AtomicU64,
    /// Microseconds from t0 to each 202, the first `ACCEPT_LOG_CAP` of them.
    accept_log: std::sync::Mutex<Vec<u64>>,
    wins: Vec<AtomicU32>,
    /// Request number → user index (shuffled order); empty for adjacent clicks.
    permutation: Vec<u32>,
}

/// What one worker measured; merged at the end, so workers never share a lock.
struct WorkerOut {
    hist: Histogram<u64>,
    codes: Vec<(u16, String, u64)>,
    errors: BTreeMap<String, u64>,
    started: u64,
    measured: u64,
    late_starts: u64,
    last_done: Option<Instant>,
}

impl WorkerOut {
    fn new() -> anyhow::Result<WorkerOut> {
        Ok(WorkerOut {
            hist: new_histogram()?,
            codes: Vec::new(),
            errors: BTreeMap::new(),
            started: 0,
            measured: 0,
            late_starts: 0,
            last_done: None,
        })
    }

    /// A request without an HTTP answer, by kind.
    fn error(&mut self, kind: &str) {
        *self.errors.entry(kind.to_owned()).or_insert(0) += 1;
    }

    /// The latency of an answer to a request started inside the window.
    fn time(&mut self, latency: Duration) {
        let us = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
        self.hist.saturating_record(us.max(1));
        self.measured += 1;
    }

    fn count(&mut self, status: StatusCode, body: &[u8]) {
        let code = if status == StatusCode::ACCEPTED {
            ""
        } else {
            error_code(body).unwrap_or("-")
        };
        let status = status.as_u16();
        // A handful of distinct answers: a linear scan beats hashing, and a label is
        // allocated only the first time it is seen.
        if let Some(entry) = self
            .codes
            .iter_mut()
            .find(|(s, c, _)| *s == status && c == code)
        {
            entry.2 += 1;
        } else {
            self.codes.push((status, code.to_owned(), 1));
        }
    }
}

/// A seeded shuffle of the request numbers (the waiting room's draw), so two runs
/// send the same order.
fn shuffled(n: usize, seed: u64) -> Vec<u32> {
    let mut v: Vec<u32> = (0..n as u32).collect();
    flashsale::waiting_room::shuffle(&mut v, seed);
    v
}

/// Runs the plan and returns what it measured.
pub async fn run(plan: Plan) -> anyhow::Result<LoadReport> {
    check_plan(&plan)?;
    let clicks = u64::from(plan.clicks);
    let planned = plan.users.len() as u64 * clicks;

    // Connections first, so the measured run does not include TCP set-up.
    let conns = connect_all(plan.addr, plan.connections).await?;

    let shared = Arc::new(Shared::new(plan.users.len(), plan.order, planned));
    let users: Arc<Vec<UserToken>> = Arc::new(plan.users);
    let bar = progress_bar(plan.progress, planned, &plan.label)?;

    let t0 = Instant::now();
    let wall0 = SystemTime::now();
    let measure_from = t0 + plan.warmup;
    let run = Arc::new(RunContext {
        addr: plan.addr,
        shared: shared.clone(),
        users: users.clone(),
        path: format!("/flash/{}/reserve", plan.sku),
        clicks,
        planned,
        rate: plan.rate,
        timeout: plan.request_timeout,
        t0,
        measure_from,
        deadline: t0 + plan.max_duration,
    });
    let (outs, timeline) = drive(conns, run, bar).await?;

    let merged = Merged::of(outs, measure_from)?;
    let window = merged.last_done.saturating_duration_since(measure_from);
    let window_s = window.as_secs_f64();
    let wall_start = wall0 + plan.warmup;
    let sale = shared.sale_check(plan.units, &merged.codes);

    Ok(LoadReport {
        label: plan.label,
        sku: plan.sku,
        mode: if plan.rate.is_some() {
            "rate"
        } else {
            "concurrency"
        }
        .into(),
        connections: plan.connections,
        target_rate: plan.rate,
        users: users.len(),
        clicks: plan.clicks,
        order: plan.order,
        planned,
        started: merged.started,
        answered: shared.answered.load(Ordering::Relaxed),
        codes: merged.codes,
        errors: merged.errors,
        window_start_unix_ms: unix_ms(wall_start),
        window_end_unix_ms: unix_ms(wall_start + window),
        window_s,
        measured: merged.measured,
        throughput_rps: if window_s > 0.0 {
            merged.measured as f64 / window_s
        } else {
            0.0
        },
        latency: Latency::of(&merged.hist),
        cdf: cdf_points(&merged.hist),
        late_starts: merged.late_starts,
        timeline,
        sale,
    })
}

/// A plan that cannot run says why before any connection is opened.
fn check_plan(plan: &Plan) -> anyhow::Result<()> {
    anyhow::ensure!(!plan.users.is_empty(), "at least one user is needed");
    anyhow::ensure!(plan.clicks >= 1, "at least one click per user is needed");
    anyhow::ensure!(plan.connections >= 1, "at least one connection is needed");
    anyhow::ensure!(
        plan.warmup < plan.max_duration,
        "the warm-up must be shorter than the run"
    );
    if let Some(rate) = plan.rate {
        anyhow::ensure!(rate > 0.0, "the rate must be positive");
    }
    Ok(())
}

/// One worker a connection, and the ticker beside them, until every worker is done.
async fn drive(
    conns: Vec<Conn>,
    run: Arc<RunContext>,
    bar: ProgressBar,
) -> anyhow::Result<(Vec<WorkerOut>, Vec<TimelinePoint>)> {
    let workers: Vec<_> = conns
        .into_iter()
        .map(|conn| tokio::spawn(worker(conn, run.clone())))
        .collect();
    let ticker = Ticker::start(run.shared.clone(), bar.clone(), run.t0);
    let mut outs = Vec::with_capacity(workers.len());
    for w in workers {
        outs.push(w.await.context("a worker task failed")??);
    }
    let timeline = ticker.finish().await?;
    bar.finish_and_clear();
    Ok((outs, timeline))
}

async fn connect_all(addr: SocketAddr, n: usize) -> anyhow::Result<Vec<Conn>> {
    let mut conns = Vec::with_capacity(n);
    for _ in 0..n {
        conns.push(Conn::connect(addr).await?);
    }
    Ok(conns)
}

/// A progress bar on a terminal that asked for one; a hidden one otherwise.
fn progress_bar(wanted: bool, planned: u64, label: &str) -> anyhow::Result<ProgressBar> {
    if !wanted || !std::io::stderr().is_terminal() {
        return Ok(ProgressBar::hidden());
    }
    let bar = ProgressBar::new(planned);
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} {msg} [{elapsed_precise}] {wide_bar} {pos}/{len} {per_sec}",
        )
        .context("bad progress template")?,
    );
    bar.set_message(label.to_owned());
    Ok(bar)
}

/// Progress and the timeline: one sample every 100 ms, off the request path.
struct Ticker {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Vec<TimelinePoint>>,
    shared: Arc<Shared>,
    t0: Instant,
}

impl Ticker {
    fn start(shared: Arc<Shared>, bar: ProgressBar, t0: Instant) -> Ticker {
        let stop = CancellationToken::new();
        let task = {
            let shared = shared.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut points = Vec::new();
                let mut tick = tokio::time::interval(Duration::from_millis(100));
                loop {
                    tokio::select! {
                        _ = stop.cancelled() => return points,
                        _ = tick.tick() => {}
                    }
                    let point = shared.point(t0);
                    bar.set_position(point.answered);
                    points.push(point);
                }
            })
        };
        Ticker {
            stop,
            task,
            shared,
            t0,
        }
    }

    /// Stops the samples and closes the timeline with the final counts.
    async fn finish(self) -> anyhow::Result<Vec<TimelinePoint>> {
        self.stop.cancel();
        let mut timeline = self.task.await.context("the progress task failed")?;
        timeline.push(self.shared.point(self.t0));
        Ok(timeline)
    }
}

/// What the workers measured, added up.
struct Merged {
    hist: Histogram<u64>,
    codes: BTreeMap<String, u64>,
    errors: BTreeMap<String, u64>,
    started: u64,
    measured: u64,
    late_starts: u64,
    /// The latest answer, or the end of the warm-up when none came after it.
    last_done: Instant,
}

impl Merged {
    fn of(outs: Vec<WorkerOut>, measure_from: Instant) -> anyhow::Result<Merged> {
        let mut m = Merged {
            hist: new_histogram()?,
            codes: BTreeMap::new(),
            errors: BTreeMap::new(),
            started: 0,
            measured: 0,
            late_starts: 0,
            last_done: measure_from,
        };
        for out in outs {
            m.hist
                .add(&out.hist)
                .context("histograms differ in bounds")?;
            for (status, code, n) in out.codes {
                let label = if code.is_empty() {
                    status.to_string()
                } else {
                    format!("{status} {code}")
                };
                *m.codes.entry(label).or_insert(0) += n;
            }
            for (kind, n) in out.errors {
                *m.errors.entry(kind).or_insert(0) += n;
            }
            m.started += out.started;
            m.measured += out.measured;
            m.late_starts += out.late_starts;
            if let Some(done) = out.last_done {
                m.last_done = m.last_done.max(done);
            }
        }
        Ok(m)
    }
}

impl Shared {
    fn new(users: usize, order: ClickOrder, planned: u64) -> Shared {
        Shared {
            next: AtomicU64::new(0),
            answered: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
            last_accept_us: AtomicU64::new(0),
            accept_log: std::sync::Mutex::new(Vec::new()),
            wins: (0..users).map(|_| AtomicU32::new(0)).collect(),
            permutation: match order {
                ClickOrder::Adjacent => Vec::new(),
                ClickOrder::Shuffled => shuffled(planned as usize, 0x5EED),
            },
        }
    }

    fn point(&self, t0: Instant) -> TimelinePoint {
        TimelinePoint {
            t_s: t0.elapsed().as_secs_f64(),
            answered: self.answered.load(Ordering::Relaxed),
            accepted: self.accepted.load(Ordering::Relaxed),
        }
    }

    /// The invariants, from the clients' side.
    fn sale_check(&self, units: Option<u64>, codes: &BTreeMap<String, u64>) -> SaleCheck {
        let accepted = self.accepted.load(Ordering::Relaxed);
        let mut winners = 0;
        let mut several = 0;
        let mut most = 0;
        for w in &self.wins {
            let w = w.load(Ordering::Relaxed);
            if w >= 1 {
                winners += 1;
            }
            if w >= 2 {
                several += 1;
            }
            most = most.max(w);
        }
        let sold_out = codes.contains_key("409 sold_out");
        let last_accept_us = self.last_accept_us.load(Ordering::Relaxed);
        SaleCheck {
            units,
            accepted,
            winners,
            users_with_several_wins: several,
            most_wins_of_one_user: most,
            sold_out,
            last_accept_after_s: (accepted > 0).then(|| last_accept_us as f64 / 1e6),
            winners_equal_units: units
                .filter(|_| sold_out)
                .map(|u| winners == u && accepted == u),
            no_oversell: units.map(|u| accepted <= u),
            no_user_twice: several == 0,
            accept_times_ms: {
                let mut log = self
                    .accept_log
                    .lock()
                    .map(|l| l.clone())
                    .unwrap_or_default();
                log.sort_unstable();
                log.into_iter().map(|us| us as f64 / 1000.0).collect()
            },
        }
    }
}

/// What every connection's loop shares for one run.
struct RunContext {
    addr: SocketAddr,
    shared: Arc<Shared>,
    users: Arc<Vec<UserToken>>,
    path: String,
    clicks: u64,
    planned: u64,
    /// Requests per second (open loop); `None` for fixed concurrency.
    rate: Option<f64>,
    timeout: Duration,
    t0: Instant,
    measure_from: Instant,
    deadline: Instant,
}

impl RunContext {
    /// When request `i` should start: now in closed loop, on schedule in open loop
    /// (`None` once the schedule passes the deadline). The flag says it started late.
    async fn start_of(&self, i: u64, now: Instant) -> Option<(Instant, bool)> {
        let Some(r) = self.rate else {
            return Some((now, false));
        };
        let due = self.t0 + Duration::from_secs_f64(i as f64 / r);
        if due >= self.deadline {
            return None;
        }
        if due > now {
            tokio::time::sleep_until(due.into()).await;
            return Some((Instant::now(), false));
        }
        // Every connection was busy when this one fell due: it waited in the
        // queue, and that wait is part of its latency.
        Some((due, now - due > Duration::from_millis(1)))
    }

    /// A `202` for `user`, answered at `done`: its win, and when it came.
    fn accepted(&self, user: usize, done: Instant) {
        let shared = &self.shared;
        shared.wins[user].fetch_add(1, Ordering::Relaxed);
        let n = shared.accepted.fetch_add(1, Ordering::Relaxed);
        let us = u64::try_from((done - self.t0).as_micros()).unwrap_or(u64::MAX);
        shared.last_accept_us.fetch_max(us, Ordering::Relaxed);
        if n < ACCEPT_LOG_CAP {
            if let Ok(mut log) = shared.accept_log.lock() {
                log.push(us);
            }
        }
    }

    /// The user who sends request `i`.
    fn user_of(&self, i: u64) -> usize {
        (match self.shared.permutation.get(i as usize) {
            Some(p) => u64::from(*p) / self.clicks,
            None => i / self.clicks,
        }) as usize
    }
}

/// One connection's loop: take the next request number, send it, time it, count it.
async fn worker(conn: Conn, run: Arc<RunContext>) -> anyhow::Result<WorkerOut> {
    let shared = &run.shared;
    let mut out = WorkerOut::new()?;
    let mut conn = Some(conn);
    loop {
        let i = shared.next.fetch_add(1, Ordering::Relaxed);
        if i >= run.planned {
            break;
        }
        let now = Instant::now();
        if now >= run.deadline {
            break;
        }
        let Some((start, late)) = run.start_of(i, now).await else {
            break;
        };
        if late {
            out.late_starts += 1;
        }
        let user = run.user_of(i);
        out.started += 1;

        if conn.is_none() {
            match Conn::connect(run.addr).await {
                Ok(c) => conn = Some(c),
                Err(_) => {
                    out.error("connect");
                    // A server that refuses connections would otherwise be spun on.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            }
        }
        let Some(c) = conn.as_mut() else { continue };
        let result = tokio::time::timeout(
            run.timeout,
            c.send(
                Method::POST,
                &run.path,
                Some(&run.users[user].authorization),
                None,
            ),
        )
        .await;
        let done = Instant::now();
        match result {
            Ok(Ok((status, body))) => {
                out.count(status, &body);
                if status == StatusCode::ACCEPTED {
                    run.accepted(user, done);
                }
                if start >= run.measure_from {
                    out.time(done - start);
                }
                shared.answered.fetch_add(1, Ordering::Relaxed);
                out.last_done = Some(done);
            }
            Ok(Err(_)) => {
                out.error("io");
                conn = None;
            }
            Err(_) => {
                // The answer may still arrive on this socket: start a new one.
                out.error("timeout");
                conn = None;
            }
        }
    }
    Ok(out)
}

impl LoadReport {
    /// A few lines for a person at a terminal.
    pub fn human(&self) -> String {
        let mut s = String::new();
        let pace = match self.target_rate {
            Some(r) => format!("{r:.0} req/s target over {} connections", self.connections),
            None => format!("{} connections (closed loop)", self.connections),
        };
        s.push_str(&format!(
            "{}: {} users × {} clicks on sku {} at {pace}\n",
            self.label, self.users, self.clicks, self.sku
        ));
        s.push_str(&format!(
            "  answered {} of {} planned ({} started); measured {} in {:.2} s → {:.0} req/s\n",
            self.answered,
            self.planned,
            self.started,
            self.measured,
            self.window_s,
            self.throughput_rps
        ));
        let l = &self.latency;
        s.push_str(&format!(
            "  latency ms: p50 {:.3}  p90 {:.3}  p99 {:.3}  p99.9 {:.3}  max {:.3}\n",
            l.p50_ms, l.p90_ms, l.p99_ms, l.p999_ms, l.max_ms
        ));
        s.push_str(&format!("  answers: {}\n", counts(&self.codes)));
        if !self.errors.is_empty() {
            s.push_str(&format!("  errors: {}\n", counts(&self.errors)));
        }
        if self.late_starts > 0 {
            s.push_str(&format!(
                "  {} requests started late (all connections busy)\n",
                self.late_starts
            ));
        }
        let c = &self.sale;
        let mark = |ok: bool| if ok { "ok" } else { "BROKEN" };
        let units = match (c.units, c.winners_equal_units) {
            (Some(u), Some(ok)) => format!("winners {} = units {u}: {}", c.winners, mark(ok)),
            (Some(u), None) => format!(
                "winners {} of {u} units (not sold out: winners = units not checked)",
                c.winners
            ),
            (None, _) => format!("winners {}", c.winners),
        };
        s.push_str(&format!(
            "  invariants: {units}; accepted {}; users with two or more wins: {} ({})\n",
            c.accepted,
            c.users_with_several_wins,
            mark(c.no_user_twice)
        ));
        s
    }
}

/// `kind: count, …`, in the map's order.
fn counts(by_kind: &BTreeMap<String, u64>) -> String {
    by_kind
        .iter()
        .map(|(k, v)| format!("{k}: {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shuffle_is_a_permutation() {
        let mut v = shuffled(1000, 7);
        assert_ne!(v, (0..1000).collect::<Vec<u32>>());
        v.sort_unstable();
        assert_eq!(v, (0..1000).collect::<Vec<u32>>());
    }

    #[test]
    fn latency_summary() {
        let mut h = new_histogram().expect("histogram");
        for us in 1..=1000 {
            h.record(us).expect("in range");
        }
        let l = Latency::of(&h);
        assert!((l.p50_ms - 0.5).abs() < 0.01);
        assert!((l.p99_ms - 0.99).abs() < 0.01);
        let cdf = cdf_points(&h);
        assert_eq!(cdf.last().map(|p| p.1), Some(1.0));
    }
}
