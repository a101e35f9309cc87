//! Two of three instances run with their own clocks five minutes off, one
//! ahead and one behind (libfaketime, `Env::skew_clock`): more than a turn,
//! more than a payment window, more than the tokens' leeway. Every time rule
//! follows the shared clock (Redis's `TIME`), so the skew must change nothing
//! a buyer sees; each check reads Redis's clock itself:
//!
//! - a sale that opens a few seconds in and sells for a few seconds, bought
//!   through every instance across both edges: `not_started` only before
//!   `starts_at`, a `202` only between, `ended` only from `ends_at` (each answer
//!   judged between a reading of Redis's clock just before the request and one
//!   just after), on every instance at the same moment;
//! - a waiting room of four units whose admitted users never reserve: every
//!   turn runs its whole length before it expires, each round of turns follows
//!   the last a turn later, as without skew (three rounds given, two expired in
//!   two turns and a half), and the third round reserves through the skewed
//!   instances within its turn;
//! - `server_time` is Redis's clock on every instance; a token that expires in
//!   two minutes and one valid from this second are accepted everywhere;
//!   `flashsale_clock_own_ahead_seconds` reads +300 and −300.
//!
//! The load buys its sale through all three, with a payment window shorter than
//! the skew: no order of any of the three sales was written before its sale
//! opened or after the check, or cancelled before its deadline, by Redis's
//! clock; and the checker's invariants hold for each sale.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use flashsale::stock::RoomKeys;
use futures::future::BoxFuture;
use redis::aio::MultiplexedConnection;
use secrecy::ExposeSecret;
use testkit::api::{Api, Caller};
use testkit::invariants::{Answer, Probe};
use testkit::sale::{open_sale, SaleSpec};

use crate::harness::{
    orders_follow_the_clock, redis_conn, redis_now, window_of, Fault, Run, Setup,
    CLOCK_TOLERANCE_MS,
};

/// How far the second instance's own clock runs ahead, and the third's behind.
const SKEW_SECS: i64 = 300;
/// Each instance's own clock, off the machine's.
const SKEWS: [i64; 3] = [0, SKEW_SECS, -SKEW_SECS];
/// A waiting-room turn: far shorter than the skew.
const TURN_SECS: i64 = 4;
/// Every sale's payment window: shorter than the skew (a sweeper judging by an
/// instance's own clock ahead would cancel every order at once), longer than
/// the scenario.
const PAYMENT_SECS: u32 = 240;
/// How far an instance's reading of the shared clock may be off Redis's own.
const TOLERANCE_MS: i64 = CLOCK_TOLERANCE_MS;
/// A round of turns may follow the last this much later than a turn (the
/// admission step runs every 100 ms on each instance), and a step's work may
/// take this long after it read the clock.
const LATE_MS: i64 = 1000;
/// The sale with a window: opens this long after it is created, sells this
/// long, and is bought from a moment before its start to a moment after its end.
const WINDOW_OPENS_IN_SECS: i64 = 4;
const WINDOW_SECS: i64 = 4;
const WINDOW_MARGIN_MS: i64 = 1500;
/// More units than the window can sell: never sold out.
const WINDOW_STOCK: u32 = 100_000;
/// Each instance is asked this often, by a new buyer each time.
const WINDOW_EVERY: Duration = Duration::from_millis(25);
/// The waiting room: its start, its units and the users who join before it.
const ROOM_OPENS_IN_SECS: i64 = 4;
const ROOM_UNITS: u32 = 4;
const ROOM_USERS: usize = 24;
/// How often the room is looked at in Redis.
const LOOK_EVERY: Duration = Duration::from_millis(50);

pub struct ClockSkewed;

/// One of the scenario's sales, for `after`: its start, and the reservation
/// answers the checker reads once all is quiet (none for the load's sale, which
/// the harness checks).
struct Side {
    name: &'static str,
    activity_id: String,
    starts_at: DateTime<Utc>,
    answers: Vec<Answer>,
}

static SIDES: Mutex<Vec<(String, Vec<Side>)>> = Mutex::new(Vec::new());

impl Fault for ClockSkewed {
    fn id(&self) -> &'static str {
        "clock_skewed"
    }
    fn name(&self) -> &'static str {
        "two of three instances' clocks 5 min ahead and behind"
    }
    fn prepare(&self, setup: &mut Setup) {
        setup.services = SKEWS.len();
        setup.clock_skew_secs = SKEWS.to_vec();
        setup.payment_timeout_secs = PAYMENT_SECS;
        setup.set("FLASHSALE__WAITING_ROOM__TURN_SECS", TURN_SECS);
    }
    fn inject<'a>(&'a self, run: &'a mut Run) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let run: &Run = run;
            let own = instances_agree(run).await?;
            let (window, room) = tokio::join!(window_sale(run), room_sale(run));
            let ((window, opened), (room, turns)) = match (window, room) {
                (Ok(w), Ok(r)) => (w, r),
                (w, r) => {
                    let problems: Vec<String> = [w.err(), r.err()].into_iter().flatten().collect();
                    return Err(problems.join("\n"));
                }
            };
            println!(
                "clock_skewed: own clocks ahead by {own:?} s; the window opened {opened}; {turns}"
            );
            let (starts_at, _) = window_of(run, &run.sku).await?;
            let load = Side {
                name: "the load's sale",
                activity_id: run.activity_id.clone(),
                starts_at,
                answers: Vec::new(),
            };
            SIDES
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((run.db.clone(), vec![load, window, room]));
            Ok(())
        })
    }
    fn after<'a>(&'a self, run: &'a mut Run) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let sides = {
                let mut all = SIDES.lock().unwrap_or_else(|e| e.into_inner());
                let at = all
                    .iter()
                    .position(|(db, _)| *db == run.db)
                    .ok_or("the scenario's sales were not recorded")?;
                all.swap_remove(at).1
            };
            for side in &sides {
                if !side.answers.is_empty() {
                    let probe = Probe {
                        activity_id: side.activity_id.clone(),
                        ..run.probe()
                    };
                    probe.wait_quiet(Duration::from_secs(60)).await?;
                    probe
                        .check(&side.answers)
                        .await
                        .map_err(|e| format!("{}: {e}", side.name))?;
                }
            }
            let now = redis_now(&mut redis_conn(run).await?).await?;
            for side in &sides {
                orders_follow_the_clock(run, &side.activity_id, side.name, side.starts_at, now)
                    .await?;
            }
            Ok(())
        })
    }
}

fn ms(d: chrono::Duration) -> i64 {
    d.num_milliseconds()
}

/// `server_time` on every instance between two readings of Redis's clock; a
/// token that expires in two minutes and one valid from this second accepted
/// by each; each instance's own clock as its gauge says. Returns the gauges.
async fn instances_agree(run: &Run) -> Result<Vec<f64>, String> {
    let mut clock = redis_conn(run).await?;
    let soon = run
        .auth
        .issue("clock-soon", 120)
        .map_err(|e| format!("{e:#}"))?;
    let fresh = valid_from_now("clock-fresh")?;
    let mut problems = Vec::new();
    let mut own = Vec::new();
    for (i, api) in run.apis().iter().enumerate() {
        for _ in 0..5 {
            let before = redis_now(&mut clock).await?;
            let resp = api.sale(&run.sku).send().await;
            let body: serde_json::Value = match resp {
                Ok(r) => r.json().await.map_err(|e| e.to_string())?,
                Err(e) => return Err(format!("instance {i}: GET /flash: {e}")),
            };
            let after = redis_now(&mut clock).await?;
            let shown = serde_json::from_value::<DateTime<Utc>>(body["server_time"].clone())
                .map_err(|e| format!("instance {i}'s server_time: {e}: {body}"))?;
            if ms(shown - before) < -TOLERANCE_MS || ms(shown - after) > TOLERANCE_MS {
                problems.push(format!(
                    "instance {i}'s server_time is {} ms from Redis's clock (read {} ms apart around it)",
                    if shown < before { ms(shown - before) } else { ms(shown - after) },
                    ms(after - before)
                ));
            }
        }
        for (what, token) in [
            ("expiring in two minutes", &soon),
            ("valid from now", &fresh),
        ] {
            let status = api
                .reservation(&run.sku, Caller::Token(token.as_str()))
                .send()
                .await
                .map_err(|e| format!("instance {i}: GET /flash/…/reservation: {e}"))?
                .status();
            if status == reqwest::StatusCode::UNAUTHORIZED {
                problems.push(format!("instance {i} refused a token {what} (401)"));
            }
        }
        let ahead = run.metric_of(i, "flashsale_clock_own_ahead_seconds").await;
        if (ahead - SKEWS[i] as f64).abs() > 2.0 {
            problems.push(format!(
                "instance {i}'s own clock reads {ahead} s ahead of the shared one, {} s expected",
                SKEWS[i]
            ));
        }
        own.push(ahead);
    }
    match problems.is_empty() {
        true => Ok(own),
        false => Err(problems.join("\n")),
    }
}

/// A user token (HS256, as the services check them) valid from this second
/// (`nbf`) for an hour.
fn valid_from_now(user: &str) -> Result<String, String> {
    let settings = crate::harness::base_settings();
    let now = Utc::now().timestamp();
    let claims = serde_json::json!({"sub": user, "nbf": now, "exp": now + 3600});
    let key = jsonwebtoken::EncodingKey::from_secret(
        settings.auth.user_token_secret.expose_secret().as_bytes(),
    )
    .map_err(|e| e.to_string())?;
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &claims,
        &key,
    )
    .map_err(|e| e.to_string())
}

/// One reservation, between two readings of Redis's clock.
struct Timed {
    via: usize,
    before: DateTime<Utc>,
    after: DateTime<Utc>,
    answer: Answer,
}

/// The sale that opens and closes mid-scenario, bought across both edges
/// through every instance. Returns it, and when each instance first sold.
async fn window_sale(run: &Run) -> Result<(Side, String), String> {
    let spec = SaleSpec {
        starts_in_secs: WINDOW_OPENS_IN_SECS,
        open_secs: WINDOW_SECS,
        payment_timeout_secs: PAYMENT_SECS,
        ..SaleSpec::new(WINDOW_STOCK)
    };
    let sale = open_sale(&run.client, &run.base(), &run.admin, &spec).await?;
    let (starts_at, ends_at) = window_of(run, &sale.sku).await?;
    let clock = redis_conn(run).await?;
    let buyers: Vec<_> = run
        .apis()
        .into_iter()
        .enumerate()
        .map(|(via, api)| {
            tokio::spawn(across_the_window(
                api,
                via,
                sale.sku.clone(),
                clock.clone(),
                starts_at,
                ends_at,
            ))
        })
        .collect();
    let mut seen = Vec::new();
    for b in buyers {
        seen.extend(b.await.map_err(|e| format!("a window's buyer: {e}"))??);
    }
    let opened = judge_window(&seen, starts_at, ends_at)?;
    // Refusals for the window are judged above; the rest go to the checker.
    let answers = seen
        .into_iter()
        .map(|t| t.answer)
        .filter(|a| !matches!(a.code.as_deref(), Some("not_started" | "ended")))
        .collect();
    let side = Side {
        name: "the window's sale",
        activity_id: sale.id,
        starts_at,
        answers,
    };
    Ok((side, opened))
}

/// New buyers through instance `via`, one after another, from a moment before
/// `starts_at` to a moment after `ends_at` by Redis's clock.
async fn across_the_window(
    api: Api,
    via: usize,
    sku: String,
    mut clock: MultiplexedConnection,
    starts_at: DateTime<Utc>,
    ends_at: DateTime<Utc>,
) -> Result<Vec<Timed>, String> {
    let margin = chrono::Duration::milliseconds(WINDOW_MARGIN_MS);
    let now = redis_now(&mut clock).await?;
    if let Ok(wait) = (starts_at - margin - now).to_std() {
        tokio::time::sleep(wait).await;
    }
    let mut seen = Vec::new();
    loop {
        let before = redis_now(&mut clock).await?;
        if before > ends_at + margin {
            return Ok(seen);
        }
        let user = format!("window-{via}-{}", seen.len());
        let request = api.reserve(&sku, Caller::User(&user));
        let answer = Answer::from_response(request.send().await).await;
        let after = redis_now(&mut clock).await?;
        seen.push(Timed {
            via,
            before,
            after,
            answer,
        });
        tokio::time::sleep(WINDOW_EVERY).await;
    }
}

/// Each answer against Redis's clock: the service judged the window at some
/// moment between `before` and `after`, so a `202` answered before `starts_at`,
/// a `not_started` asked after it, an `ended` answered before `ends_at` or a
/// `202` asked after it was judged by another clock. Every instance must have
/// been seen on both sides of both edges. Returns, per instance, how soon after
/// `starts_at` it first sold.
fn judge_window(
    seen: &[Timed],
    starts_at: DateTime<Utc>,
    ends_at: DateTime<Utc>,
) -> Result<String, String> {
    let mut problems = Vec::new();
    // Per instance: (not_started, 202, ended) answers, and the first sale.
    let mut per: BTreeMap<usize, (usize, usize, usize, Option<i64>)> = BTreeMap::new();
    for t in seen {
        let from_start = (ms(t.before - starts_at), ms(t.after - starts_at));
        let from_end = (ms(t.before - ends_at), ms(t.after - ends_at));
        let counts = per.entry(t.via).or_default();
        let wrong = match (t.answer.status, t.answer.code.as_deref()) {
            (Some(202), _) => {
                counts.1 += 1;
                counts.3 = Some(counts.3.map_or(from_start.1, |f| f.min(from_start.1)));
                if from_start.1 < -TOLERANCE_MS {
                    Some(("a 202 before starts_at", from_start))
                } else if from_end.0 > TOLERANCE_MS {
                    Some(("a 202 after ends_at", from_end))
                } else {
                    None
                }
            }
            (Some(403), Some("not_started")) => {
                counts.0 += 1;
                (from_start.0 > TOLERANCE_MS).then_some(("not_started after starts_at", from_start))
            }
            (Some(403), Some("ended")) => {
                counts.2 += 1;
                (from_end.1 < -TOLERANCE_MS).then_some(("ended before ends_at", from_end))
            }
            _ => None,
        };
        if let Some((what, (asked, answered))) = wrong {
            problems.push(format!(
                "instance {}: {what}: asked at {asked:+} ms, answered at {answered:+} ms from it by Redis's clock",
                t.via
            ));
        }
    }
    let mut opened = Vec::new();
    for (via, (early, sold, late, first)) in &per {
        if *early == 0 || *sold == 0 || *late == 0 {
            problems.push(format!(
                "instance {via} was not seen across the window: {early} not_started, {sold} sold, {late} ended"
            ));
        }
        opened.push(match first {
            Some(f) => format!("{f:+} ms"),
            None => "never".to_owned(),
        });
    }
    if per.len() < SKEWS.len() {
        problems.push(format!(
            "only {} instances answered across the window",
            per.len()
        ));
    }
    match problems.is_empty() {
        true => Ok(format!(
            "{} after starts_at on each instance",
            opened.join(" / ")
        )),
        false => Err(format!("the window: {}", problems.join("\n"))),
    }
}

/// One look at the room in Redis, at Redis's time: the turns running (user,
/// until in ms), the users whose turn expired, and the room's totals of turns
/// given and expired.
struct Look {
    now_ms: i64,
    running: Vec<(String, i64)>,
    expired: Vec<String>,
    given: u64,
    expired_total: u64,
}

/// Reads the clock and the room in one atomic step.
const LOOK: &str = "local t = redis.call('TIME') \
    return {t[1], t[2], redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES'), \
    redis.call('HGETALL', KEYS[2]), redis.call('HMGET', KEYS[3], 'admitted', 'expired')}";

async fn look(conn: &mut MultiplexedConnection, keys: &RoomKeys) -> Result<Look, String> {
    type Reply = (i64, i64, Vec<String>, Vec<String>, Vec<Option<u64>>);
    let (secs, micros, running, outcomes, totals): Reply = redis::cmd("EVAL")
        .arg(LOOK)
        .arg(3)
        .arg(&keys.admitted)
        .arg(&keys.outcome)
        .arg(&keys.meta)
        .query_async(conn)
        .await
        .map_err(|e| format!("the room in Redis: {e}"))?;
    let running = running
        .chunks(2)
        .filter_map(|p| Some((p[0].clone(), p.get(1)?.parse::<f64>().ok()? as i64)))
        .collect();
    let expired = outcomes
        .chunks(2)
        .filter(|p| p.get(1).is_some_and(|o| o == "expired"))
        .map(|p| p[0].clone())
        .collect();
    Ok(Look {
        now_ms: secs * 1000 + micros / 1000,
        running,
        expired,
        given: totals.first().copied().flatten().unwrap_or(0),
        expired_total: totals.get(1).copied().flatten().unwrap_or(0),
    })
}

/// One turn as the looks saw it, by Redis's clock (ms): its end, the last look
/// without it and the first with it, the last look it was still running and
/// the first that saw it expired.
struct TurnSeen {
    until: i64,
    unseen: i64,
    seen: i64,
    running: i64,
    expired: Option<i64>,
}

/// The sale with a waiting room: its users join before the start through
/// every instance, and none of those admitted reserves, until the third round
/// of turns, which reserves through the skewed instances. Watched in Redis
/// from before the draw until two turns and a half after the first admission.
async fn room_sale(run: &Run) -> Result<(Side, String), String> {
    let spec = SaleSpec {
        waiting_room: true,
        starts_in_secs: ROOM_OPENS_IN_SECS,
        payment_timeout_secs: PAYMENT_SECS,
        ..SaleSpec::new(ROOM_UNITS)
    };
    let sale = open_sale(&run.client, &run.base(), &run.admin, &spec).await?;
    let (starts_at, _) = window_of(run, &sale.sku).await?;
    let apis = run.apis();
    let sku = sale.sku.as_str();
    let joins = (0..ROOM_USERS).map(|k| {
        let api = &apis[k % apis.len()];
        let user = format!("room-{k}");
        async move { api.join_queue(sku, Caller::User(&user)).send().await }
    });
    for (k, joined) in futures::future::join_all(joins)
        .await
        .into_iter()
        .enumerate()
    {
        match joined {
            Ok(r) if r.status().is_success() => {}
            Ok(r) => return Err(format!("room-{k}'s join answered {}", r.status())),
            Err(e) => return Err(format!("room-{k}'s join: {e}")),
        }
    }
    let keys = RoomKeys::new(&sale.id, sale.shards);
    let mut clock = redis_conn(run).await?;
    let first = look(&mut clock, &keys).await?;
    if !first.running.is_empty() {
        return Err("turns were given before the room was watched: the joins took too long".into());
    }
    let turn = TURN_SECS * 1000;
    let mut turns: BTreeMap<String, TurnSeen> = BTreeMap::new();
    let mut blinked = BTreeSet::new();
    let mut problems = Vec::new();
    let mut prev = first.now_ms;
    let mut reserving = None;
    let deadline = Instant::now() + Duration::from_secs(60);
    let last = loop {
        let l = look(&mut clock, &keys).await?;
        for (user, until) in &l.running {
            let t = turns.entry(user.clone()).or_insert(TurnSeen {
                until: *until,
                unseen: prev,
                seen: l.now_ms,
                running: l.now_ms,
                expired: None,
            });
            t.running = l.now_ms;
        }
        for user in &l.expired {
            match turns.get_mut(user) {
                Some(t) => {
                    t.expired.get_or_insert(l.now_ms);
                }
                None if blinked.insert(user.clone()) => problems.push(format!(
                    "{user}'s turn was given and expired within {} ms, between two looks",
                    l.now_ms - prev
                )),
                None => {}
            }
        }
        // The third round reserves at once, through the skewed instances first.
        if reserving.is_none() && l.given >= 3 * u64::from(ROOM_UNITS) {
            let newest = l.running.iter().map(|(_, u)| *u).max().unwrap_or(0);
            let third: Vec<String> = l
                .running
                .iter()
                .filter(|(_, u)| *u == newest)
                .map(|(user, _)| user.clone())
                .collect();
            let (apis, sku) = (apis.clone(), sale.sku.clone());
            reserving = Some(tokio::spawn(async move {
                let mut out = Vec::new();
                for (k, user) in third.into_iter().enumerate() {
                    let via = [1, 2, 0][k % 3];
                    let request = apis[via].reserve(&sku, Caller::User(&user));
                    out.push((via, user, Answer::from_response(request.send().await).await));
                }
                out
            }));
        }
        let first_given = turns.values().map(|t| t.until).min().map(|u| u - turn);
        if first_given.is_some_and(|g| l.now_ms >= g + turn * 5 / 2) {
            break l;
        }
        if Instant::now() > deadline {
            return Err(format!(
                "the room gave {} turns in a minute (starts_at {starts_at})",
                l.given
            ));
        }
        prev = l.now_ms;
        tokio::time::sleep(LOOK_EVERY).await;
    };
    let mut answers = Vec::new();
    match reserving {
        Some(task) => {
            for (via, user, answer) in task.await.map_err(|e| format!("the reservations: {e}"))? {
                // 503 holds nothing (the checker counts it); a refusal is a turn
                // judged by another clock.
                if !matches!(answer.status, Some(202 | 503)) {
                    problems.push(format!(
                        "{user}, holding a turn, reserved through instance {via}: {:?} {:?}",
                        answer.status, answer.code
                    ));
                }
                answers.push(answer);
            }
        }
        None => problems.push(format!(
            "only {} turns were given, no third round",
            last.given
        )),
    }
    for (user, t) in &turns {
        // A step reads the clock as it begins, and the first one draws the
        // room before it admits: a turn may start a little before it appears.
        let given = t.until - turn;
        if !(t.unseen - LATE_MS..=t.seen + TOLERANCE_MS).contains(&given) {
            problems.push(format!(
                "{user}'s turn ends at {}: a turn from {given}, but it appeared between {} and {} (ms, Redis's clock)",
                t.until, t.unseen, t.seen
            ));
        }
        if let Some(expired) = t.expired {
            if expired < t.until - TOLERANCE_MS {
                problems.push(format!(
                    "{user}'s turn expired {} ms before its end",
                    t.until - expired
                ));
            }
            if t.running > t.until + LATE_MS {
                problems.push(format!(
                    "{user}'s turn still ran {} ms after its end",
                    t.running - t.until
                ));
            }
        }
    }
    // A reservation of the third round answered 503 holds nothing: its unit
    // comes back and the room gives one more turn for it at once, outside the
    // rounds' pace.
    let refused = answers.iter().filter(|a| a.status == Some(503)).count();
    // The pace: one round of turns per turn's length, as without skew.
    let mut rounds: Vec<i64> = turns.values().map(|t| t.until).collect();
    rounds.sort_unstable();
    rounds.dedup();
    let paced = rounds.len().min(3);
    let gaps: Vec<i64> = rounds[..paced].windows(2).map(|w| w[1] - w[0]).collect();
    if gaps
        .iter()
        .any(|g| !(turn - TOLERANCE_MS..=turn + LATE_MS).contains(g))
    {
        problems.push(format!(
            "rounds of turns followed one another after {gaps:?} ms (a turn is {turn} ms)"
        ));
    }
    let units = u64::from(ROOM_UNITS);
    let given_again = refused as u64;
    if !(3..=3 + refused).contains(&rounds.len())
        || last.given != 3 * units + given_again
        || last.expired_total != 2 * units
    {
        problems.push(format!(
            "in two turns and a half: {} rounds, {} turns given, {} expired (3, {} and {} without skew; {refused} reservations answered 503)",
            rounds.len(),
            last.given,
            last.expired_total,
            3 * units + given_again,
            2 * units
        ));
    }
    if !problems.is_empty() {
        return Err(format!("the waiting room: {}", problems.join("\n")));
    }
    let side = Side {
        name: "the room's sale",
        activity_id: sale.id,
        starts_at,
        answers,
    };
    let pace = format!(
        "turns: {} given, {} expired in two turns and a half, rounds {gaps:?} ms apart",
        last.given, last.expired_total
    );
    Ok((side, pace))
}
