//! The waiting room: joining, the recorded draw, admissions that follow the
//! stock, turns that run out, `sold_out` for everyone once nothing can come
//! back, and fairness against bots.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use futures::stream::{self, StreamExt};
use reqwest::StatusCode;
use serde_json::{json, Value};

use flashsale::waiting_room::Joining;
use testkit::stats::binomial_interval;

use crate::helpers::{
    assert_error, eventually, script_calls, spawn_app, unique, words, Sale, SaleSpec, TestApp,
};

/// A sale with a waiting room that starts in `starts_in`; created and preloaded.
async fn room_sale(app: &TestApp, stock: u32, starts_in: Duration) -> (String, String) {
    let spec = SaleSpec {
        starts_in_secs: i64::try_from(starts_in.as_secs()).expect("seconds"),
        waiting_room: true,
        payment_timeout_secs: 3600,
        ..SaleSpec::new(stock)
    };
    let sale = app.open_sale_spec(&spec).await;
    let body = app.activity_figures(&sale.id).await;
    assert_eq!(body["admission"], "waiting_room");
    assert_eq!(body["waiting_room_secs"], 600);
    (sale.id, sale.sku)
}

/// The user's place in the line (which must be answered `200`).
async fn place(app: &TestApp, sku: &str, user: &str) -> Value {
    let resp = app.queue_place(sku, user).await;
    assert_eq!(resp.status(), StatusCode::OK);
    resp.json().await.expect("JSON")
}

/// Waits until every one of `users` is told `state` (within `within`).
async fn all_told(app: &TestApp, sku: &str, users: &[&str], state: &str, within: Duration) {
    eventually(within, &format!("every user told {state}"), || async {
        for u in users {
            if place(app, sku, u).await["state"] != state {
                return None;
            }
        }
        Some(())
    })
    .await;
}

/// Redis loses the room (its keys deleted through the service's own
/// connection: one node or a Cluster alike).
async fn lose_room(app: &TestApp, activity_id: &str, shards: u8) {
    let mut conn = app.state.stock.connection();
    for k in flashsale::stock::RoomKeys::new(activity_id, shards).all() {
        let _: () = redis::cmd("DEL")
            .arg(k)
            .query_async(&mut conn)
            .await
            .expect("DEL");
    }
}

/// Redis loses the room of a sale of one shard, and the room comes back with
/// the same draw.
async fn lose_and_rebuild(app: &TestApp, id: &str) {
    let seed = room(app, id).await["seed"].clone();
    lose_room(app, id, 1).await;
    eventually(Duration::from_secs(10), "the room rebuilt", || async {
        (room(app, id).await["seed"] == seed).then_some(())
    })
    .await;
}

/// The room's figures, as the operators see them.
async fn room(app: &TestApp, id: &str) -> Value {
    app.activity_figures(id).await["live"]["waiting_room"].clone()
}

#[tokio::test]
async fn users_are_drawn_admitted_as_the_stock_allows_and_told_sold_out_at_once() {
    let app = TestApp::builder().workers().spawn().await;
    let (id, sku) = room_sale(&app, 5, Duration::from_secs(3)).await;
    let users: Vec<String> = (0..30).map(|i| format!("u{i}")).collect();

    everyone_joins_once_before_the_start(&app, &sku, &users).await;
    let drawn = the_draw_is_recorded_and_replays(&app, &id, &sku, &users).await;

    // Admission follows the stock: the first five in the drawn order, no one else.
    let first: Vec<String> = drawn[..5].to_vec();
    the_first_five_are_admitted_and_buy(&app, &id, &sku, &drawn).await;

    // Paid: nothing can come back, and every waiting user is told so.
    let orders: Vec<(u64, String)> =
        sqlx::query_as("SELECT id, CAST(user_id AS CHAR) FROM orders WHERE activity_id = ?")
            .bind(&id)
            .fetch_all(&app.state.pool)
            .await
            .expect("orders");
    for (order, user) in &orders {
        let resp = app.pay(&order.to_string(), user).await;
        assert_eq!(resp.status(), StatusCode::OK);
    }
    eventually(
        Duration::from_secs(10),
        "everyone told sold_out",
        || async {
            for u in &drawn[5..] {
                if place(&app, &sku, u).await["state"] != "sold_out" {
                    return None;
                }
            }
            Some(())
        },
    )
    .await;
    let winners: HashSet<&String> = orders.iter().map(|(_, u)| u).collect();
    assert_eq!(winners, first.iter().collect::<HashSet<_>>());
    let figures = room(&app, &id).await;
    assert_eq!(figures["closed"], true);
    assert_eq!(figures["admitted_total"], 5);
    assert_eq!(figures["joined"], 30);
    app.stop().await;
}

/// Joining: 201 once, then the same ticket with 200; no place before the draw,
/// and no reservation either.
async fn everyone_joins_once_before_the_start(app: &TestApp, sku: &str, users: &[String]) {
    let mut tickets = HashMap::new();
    for u in users {
        let resp = app.join_queue(sku, u).await;
        assert_eq!(resp.status(), StatusCode::CREATED);
        let body: Value = resp.json().await.expect("JSON");
        assert_eq!(body["state"], "waiting");
        tickets.insert(u.clone(), body["ticket"].clone());
    }
    let again = app.join_queue(sku, "u0").await;
    assert_eq!(again.status(), StatusCode::OK);
    assert!(again.headers().contains_key("retry-after"));
    let body: Value = again.json().await.expect("JSON");
    assert_eq!(body["ticket"], tickets["u0"]);
    assert!(body.get("position").is_none(), "{body}");
    let distinct: HashSet<String> = tickets.values().map(Value::to_string).collect();
    assert_eq!(distinct.len(), users.len());
    assert_error(
        app.reserve(sku, "u0", None).await,
        StatusCode::FORBIDDEN,
        "not_started",
    )
    .await;
    let never = app.queue_place(sku, "never-joined").await;
    assert_error(never, StatusCode::NOT_FOUND, "not_found").await;
}

/// The draw: every user placed once, the seed and the order in MySQL, and the
/// order replayed from the seed and the arrival order. The drawn order.
async fn the_draw_is_recorded_and_replays(
    app: &TestApp,
    id: &str,
    sku: &str,
    users: &[String],
) -> Vec<String> {
    eventually(Duration::from_secs(15), "the draw", || async move {
        let mut places = HashMap::new();
        for u in users {
            let p = place(app, sku, u).await;
            places.insert(
                u.clone(),
                p["position"].as_u64().or(
                    // Admitted already: they were among the first.
                    (p["state"] == "admitted").then_some(0),
                )?,
            );
        }
        Some(places)
    })
    .await;
    let pool = &app.state.pool;
    let seed: u64 = sqlx::query_scalar("SELECT seed FROM waiting_room_draws WHERE activity_id = ?")
        .bind(id)
        .fetch_one(pool)
        .await
        .expect("the draw is recorded");
    let entries: Vec<(u32, String, u64)> = sqlx::query_as(
        "SELECT position, CAST(user_id AS CHAR), joined_seq FROM waiting_room_entries \
         WHERE activity_id = ? ORDER BY position",
    )
    .bind(id)
    .fetch_all(pool)
    .await
    .expect("entries");
    assert_eq!(entries.len(), users.len());
    let mut arrivals = entries.clone();
    arrivals.sort_by_key(|e| e.2);
    let arrival_order: Vec<String> = arrivals.into_iter().map(|e| e.1).collect();
    let drawn: Vec<String> = entries.iter().map(|e| e.1.clone()).collect();
    assert_eq!(
        flashsale::waiting_room::draw_order(&arrival_order, seed),
        drawn,
        "the recorded order replays from the seed"
    );
    assert_eq!(room(app, id).await["seed"], json!(seed));
    drawn
}

/// The first five drawn are admitted and reserve; the sixth waits first in
/// line, refused, and keeps waiting while orders await payment (they may
/// still come back).
async fn the_first_five_are_admitted_and_buy(app: &TestApp, id: &str, sku: &str, drawn: &[String]) {
    let first = &drawn[..5];
    eventually(Duration::from_secs(10), "five admitted", || async {
        (room(app, id).await["admitted"] == 5).then_some(())
    })
    .await;
    for u in first {
        assert_eq!(place(app, sku, u).await["state"], "admitted", "{u}");
    }
    let sixth = &drawn[5];
    let p = place(app, sku, sixth).await;
    assert_eq!(p["state"], "waiting");
    assert_eq!(p["position"], 1, "{p}");
    assert_error(
        app.reserve(sku, sixth, None).await,
        StatusCode::FORBIDDEN,
        "not_admitted",
    )
    .await;
    for u in first {
        assert_eq!(
            app.reserve(sku, u, None).await.status(),
            StatusCode::ACCEPTED
        );
    }
    eventually(Duration::from_secs(15), "five orders", || async {
        let counts = app.order_counts(id).await;
        (counts.get("pending_payment") == Some(&5)).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(place(app, sku, sixth).await["state"], "waiting");
}

#[tokio::test]
async fn a_turn_not_taken_goes_to_the_next_user() {
    let app = TestApp::builder().turn_secs(1).spawn().await;
    let (id, sku) = room_sale(&app, 1, Duration::from_secs(2)).await;
    for u in ["a", "b", "c"] {
        assert_eq!(app.join_queue(&sku, u).await.status(), StatusCode::CREATED);
    }
    let first = eventually(Duration::from_secs(10), "a first turn", || async {
        for u in ["a", "b", "c"] {
            if place(&app, &sku, u).await["state"] == "admitted" {
                return Some(u);
            }
        }
        None
    })
    .await;
    // The first admitted does nothing: their turn runs out and goes to the next.
    let second = eventually(Duration::from_secs(10), "the next turn", || async {
        for u in ["a", "b", "c"] {
            if u != first && place(&app, &sku, u).await["state"] == "admitted" {
                return Some(u);
            }
        }
        None
    })
    .await;
    assert_eq!(place(&app, &sku, first).await["state"], "expired");
    assert_error(
        app.reserve(&sku, first, None).await,
        StatusCode::FORBIDDEN,
        "not_admitted",
    )
    .await;
    assert_eq!(
        app.reserve(&sku, second, None).await.status(),
        StatusCode::ACCEPTED
    );
    let figures = room(&app, &id).await;
    assert!(figures["expired_total"].as_u64() >= Some(1), "{figures}");
    app.stop().await;
}

/// What waiting costs Redis, counted by `MONITOR` (the commands scripts run
/// included): a join is one script call, which answers the place too (a
/// repeated join as well: it repairs a join Redis lost), and its mark once
/// MySQL recorded it; before the start, a
/// poll of a user the instance saw join costs Redis nothing, and answers what
/// Redis answered. An unknown user is still asked of Redis (and is `404`).
#[tokio::test]
async fn a_join_is_one_script_call_and_polls_before_the_start_cost_redis_nothing() {
    let app = spawn_app().await;
    let spec = SaleSpec {
        starts_in_secs: 300,
        waiting_room: true,
        ..SaleSpec::new(5)
    };
    let sale = app.open_sale_spec(&spec).await;
    let users: Vec<String> = (0..5).map(|i| format!("w{i}")).collect();
    // The journal is not copied meanwhile: the copy marks what it copies too.
    hold_the_journal(&app, &sale.id).await;
    let watch = app.watch_redis(&sale).await;
    let started = std::time::Instant::now();
    let mut joined = HashMap::new();
    for u in &users {
        let resp = app.join_queue(&sale.sku, u).await;
        assert_eq!(resp.status(), StatusCode::CREATED);
        let body: Value = resp.json().await.expect("JSON");
        assert_eq!(body["state"], "waiting", "{body}");
        joined.insert(u.clone(), body);
    }
    for _ in 0..3 {
        for u in &users {
            let resp = app.queue_place(&sale.sku, u).await;
            assert_eq!(resp.status(), StatusCode::OK);
            assert!(resp.headers().contains_key("retry-after"));
            let body: Value = resp.json().await.expect("JSON");
            assert_eq!(body, joined[u], "{u}: the same answer as Redis gave");
        }
        let again = app.join_queue(&sale.sku, "w0").await;
        assert_eq!(again.status(), StatusCode::OK);
        let body: Value = again.json().await.expect("JSON");
        assert_eq!(body, joined["w0"]);
    }
    let never = app.queue_place(&sale.sku, "never-joined").await;
    assert_error(never, StatusCode::NOT_FOUND, "not_found").await;

    let lines = app.watched(&sale, watch).await;
    let elapsed = started.elapsed();
    let (calls, other) = script_calls(&lines);
    assert!(other.is_empty(), "commands outside the scripts: {other:?}");
    let inner = |run: &[&String]| -> Vec<String> {
        run.iter()
            .filter_map(|l| words(l).first().map(|w| w.to_uppercase()))
            .collect()
    };
    // Besides the requests' calls, the room's background work: the journal
    // copier (which finds the journal's entries, or nothing) and the check
    // that the room is still the one remembered (its generation, counter and
    // Redis's clock, at most once a second).
    let journal = |i: &[String]| matches!(i.first().map(String::as_str), Some("LLEN" | "GET"));
    // (`TIME` and `INFO` name no key, so the watch leaves them out.)
    let check = |i: &[String]| i.starts_with(&["HGET".to_owned(), "GET".to_owned()]);
    // And the mark of joins MySQL recorded (so that joining again costs MySQL
    // nothing), after their answers: a batch of joins marked at once.
    let mark = |i: &[String]| i.starts_with(&["HGET".to_owned(), "SADD".to_owned()]);
    let (mut requests, mut checks, mut marks) = (Vec::new(), 0, 0);
    for (call, run) in &calls {
        let i = inner(run);
        if check(&i) {
            checks += 1;
        } else if mark(&i) {
            marks += 1;
        } else if !journal(&i) {
            requests.push((call, i));
        }
    }
    assert!(
        marks >= 1 && marks <= users.len(),
        "the new joins marked, at most a mark each and none for the repeated ones: {marks}"
    );
    assert!(
        checks <= elapsed.as_secs() as usize + 2,
        "{checks} checks in {elapsed:?}: at most one a second"
    );
    let joins = requests
        .iter()
        .filter(|(_, i)| i.contains(&"INCR".to_owned()));
    assert_eq!(joins.count(), users.len(), "one call a join: {requests:?}");
    assert_eq!(
        requests.len(),
        users.len() + 3 + 1,
        "one call a join (the repeated ones too) and one for the unknown user, none for the polls: {requests:?}"
    );
    app.stop().await;
}

/// What an instance remembers of early joins is dropped once Redis lost the
/// room's last writes (even when joins since brought its counter back) or the
/// whole room (its generation is gone): polls answer what Redis answers
/// within the check's two seconds, never a place that no longer exists.
#[tokio::test]
async fn remembered_joins_follow_a_room_redis_lost() {
    let app = spawn_app().await;
    let spec = SaleSpec {
        starts_in_secs: 300,
        waiting_room: true,
        ..SaleSpec::new(5)
    };
    let sale = app.open_sale_spec(&spec).await;
    let mut joined = HashMap::new();
    for user in ["kept", "lost"] {
        let resp = app.join_queue(&sale.sku, user).await;
        assert_eq!(resp.status(), StatusCode::CREATED);
        let body: Value = resp.json().await.expect("JSON");
        let resp = app.queue_place(&sale.sku, user).await;
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(resp.json::<Value>().await.expect("JSON"), body);
        joined.insert(user, body);
    }
    let keys = flashsale::stock::RoomKeys::new(&sale.id, sale.shards);
    let mut conn = app.state.stock.connection();
    // The last join lost (the user and the counter's step), and someone
    // joins after it: the counter is back where it was.
    let _: () = redis::pipe()
        .zrem(&keys.joined, "lost")
        .decr(&keys.seq, 1)
        .query_async(&mut conn)
        .await
        .expect("the last join lost");
    let resp = app.join_queue(&sale.sku, "next").await;
    assert_eq!(resp.status(), StatusCode::CREATED);
    eventually(
        Duration::from_secs(5),
        "the lost join forgotten",
        || async {
            let resp = app.queue_place(&sale.sku, "lost").await;
            (resp.status() == StatusCode::NOT_FOUND).then_some(())
        },
    )
    .await;
    let resp = app.queue_place(&sale.sku, "kept").await;
    assert_eq!(resp.json::<Value>().await.expect("JSON"), joined["kept"]);
    // Joining again gives a place Redis has, and that is what is remembered.
    let resp = app.join_queue(&sale.sku, "lost").await;
    assert_eq!(resp.status(), StatusCode::CREATED);
    let again: Value = resp.json().await.expect("JSON");
    assert_eq!(again["state"], "waiting", "{again}");
    let resp = app.queue_place(&sale.sku, "lost").await;
    assert_eq!(resp.json::<Value>().await.expect("JSON"), again);

    // The whole room lost.
    for k in keys.all() {
        let _: () = redis::cmd("DEL")
            .arg(k)
            .query_async(&mut conn)
            .await
            .expect("DEL");
    }
    // Others join the new room: its counter passes the old one's.
    for user in ["other1", "other2", "other3"] {
        let resp = app.join_queue(&sale.sku, user).await;
        assert_eq!(resp.status(), StatusCode::CREATED);
    }
    eventually(
        Duration::from_secs(5),
        "the lost room forgotten",
        || async {
            let kept = app.queue_place(&sale.sku, "kept").await.status();
            let lost = app.queue_place(&sale.sku, "lost").await.status();
            (kept == StatusCode::NOT_FOUND && lost == StatusCode::NOT_FOUND).then_some(())
        },
    )
    .await;
    let resp = app.join_queue(&sale.sku, "kept").await;
    assert_eq!(resp.status(), StatusCode::CREATED);
    let again: Value = resp.json().await.expect("JSON");
    let resp = app.queue_place(&sale.sku, "kept").await;
    assert_eq!(resp.json::<Value>().await.expect("JSON"), again);
    app.stop().await;
}

#[tokio::test]
async fn joining_is_checked() {
    let app = spawn_app().await;
    // An open sale has no waiting room; reserving there is unchanged.
    let open = app.open_sale(1, 1).await;
    assert_error(
        app.join_queue(&open.sku, "u1").await,
        StatusCode::NOT_FOUND,
        "not_found",
    )
    .await;
    assert_eq!(
        app.reserve(&open.sku, "u1", None).await.status(),
        StatusCode::ACCEPTED
    );
    // Too early: the room opens waiting_room_secs before the start.
    let sku = unique("room-late-");
    let starts = chrono::Utc::now() + chrono::Duration::hours(2);
    let resp = app
        .create_activity(json!({
            "sku": sku, "stock": 3, "starts_at": starts,
            "ends_at": starts + chrono::Duration::hours(1),
            "admission": "waiting_room", "waiting_room_secs": 60,
        }))
        .await;
    assert_eq!(resp.status(), StatusCode::CREATED);
    assert_error(
        app.join_queue(&sku, "u1").await,
        StatusCode::FORBIDDEN,
        "not_started",
    )
    .await;
    // Bad values: the documented error, nothing created.
    for bad in [
        json!({"admission": "lottery"}),
        json!({"admission": "waiting_room", "waiting_room_secs": -1}),
        json!({"admission": "waiting_room", "waiting_room_secs": 604_801}),
        json!({"admission": "waiting_room", "waiting_room_secs": 1.5}),
    ] {
        let mut body = json!({
            "sku": unique("room-bad-"), "stock": 3,
            "starts_at": starts, "ends_at": starts + chrono::Duration::hours(1),
        });
        for (k, v) in bad.as_object().expect("object") {
            body[k] = v.clone();
        }
        assert_error(
            app.create_activity(body).await,
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        )
        .await;
    }
    app.stop().await;
}

/// Bots among the winners of one sale: 1,000 users of whom 100 bots that start
/// earlier and send ten times as many requests, 100 units.
async fn bots_among_winners(app: &TestApp, waiting_room: bool) -> (usize, usize) {
    const USERS: usize = 1_000;
    const BOTS: usize = 100;
    let users: Vec<String> = (0..USERS)
        .map(|i| {
            if i < BOTS {
                format!("bot{i}")
            } else {
                format!("human{i}")
            }
        })
        .collect();
    let winners = match waiting_room {
        true => winners_through_the_room(app, &users).await,
        false => winners_of_an_open_sale(app, &users).await,
    };
    let distinct: HashSet<&String> = winners.iter().collect();
    assert_eq!(distinct.len(), winners.len(), "a user won twice");
    (winners.iter().filter(|u| is_bot(u)).count(), winners.len())
}

fn is_bot(user: &str) -> bool {
    user.starts_with("bot")
}

/// Bots join first, and ten times; everyone asks where they stand once 100
/// are admitted, and the admitted reserve (bots ten times).
async fn winners_through_the_room(app: &TestApp, users: &[String]) -> Vec<String> {
    let (id, sku) = room_sale(app, 100, Duration::from_secs(4)).await;
    for round in 0..10 {
        let who = users.iter().filter(|u| round == 0 || is_bot(u));
        stream::iter(who)
            .for_each_concurrent(64, |u| {
                let sku = &sku;
                async move {
                    let s = app.join_queue(sku, u).await.status();
                    assert!(s == StatusCode::CREATED || s == StatusCode::OK, "{s}");
                }
            })
            .await;
    }
    eventually(Duration::from_secs(20), "100 admitted", || async {
        (room(app, &id).await["admitted_total"] == 100).then_some(())
    })
    .await;
    let won: Vec<Option<String>> = stream::iter(users)
        .map(|u| {
            let sku = &sku;
            async move {
                if place(app, sku, u).await["state"] != "admitted" {
                    return None;
                }
                let tries = if is_bot(u) { 10 } else { 1 };
                let mut won = false;
                for _ in 0..tries {
                    won |= app.reserve(sku, u, None).await.status() == StatusCode::ACCEPTED;
                }
                won.then(|| u.clone())
            }
        })
        .buffer_unordered(64)
        .collect()
        .await;
    won.into_iter().flatten().collect()
}

/// Bots fire first and ten times each; everyone else once, after.
async fn winners_of_an_open_sale(app: &TestApp, users: &[String]) -> Vec<String> {
    let sale = app.open_sale(100, 1).await;
    let mut requests: Vec<&String> = Vec::new();
    for _ in 0..10 {
        requests.extend(users.iter().filter(|u| is_bot(u)));
    }
    requests.extend(users.iter().filter(|u| !is_bot(u)));
    let won: Vec<Option<String>> = stream::iter(requests)
        .map(|u| {
            let sku = &sale.sku;
            async move {
                (app.reserve(sku, u, None).await.status() == StatusCode::ACCEPTED)
                    .then(|| u.clone())
            }
        })
        .buffered(64)
        .collect()
        .await;
    won.into_iter().flatten().collect()
}

#[tokio::test]
async fn the_waiting_room_takes_the_bots_advantage_away() {
    let app = spawn_app().await;
    let (open_bots, open_winners) = bots_among_winners(&app, false).await;
    let (room_bots, room_winners) = bots_among_winners(&app, true).await;
    eprintln!(
        "bots' share of the winners: open {open_bots}/{open_winners}, waiting room {room_bots}/{room_winners}"
    );
    assert_eq!((open_winners, room_winners), (100, 100));
    // Open: the bots, first and ten times, take far more than their 10 %.
    assert!(open_bots >= 50, "open: {open_bots} of 100 winners are bots");
    // The waiting room: as if drawn at random. A 99.9 % interval, so that the test
    // itself fails by chance once in a thousand runs at most.
    let (lo, hi) = binomial_interval(100, 0.1, 0.001);
    assert!(
        (lo..=hi).contains(&room_bots),
        "waiting room: {room_bots} of 100 winners are bots, outside [{lo}, {hi}]"
    );
    app.stop().await;
}

#[tokio::test]
async fn a_queue_lost_with_redis_comes_back_in_the_drawn_order() {
    let app = spawn_app().await;
    // Split over three stock shards: the room lives beside shard 0's stock.
    let spec = SaleSpec {
        starts_in_secs: 2,
        waiting_room: true,
        stock_shards: 3,
        ..SaleSpec::new(3)
    };
    let sale = app.open_sale_spec(&spec).await;
    let users: Vec<String> = (0..12).map(|i| format!("k{i}")).collect();
    for u in &users {
        assert_eq!(
            app.join_queue(&sale.sku, u).await.status(),
            StatusCode::CREATED
        );
    }
    let before = eventually(
        Duration::from_secs(15),
        "the draw and three turns",
        || async {
            let figures = room(&app, &sale.id).await;
            (figures["admitted"] == 3).then_some(figures)
        },
    )
    .await;
    let seed = before["seed"].as_u64().expect("a seed");
    let metrics = app.metrics_text().await;
    assert!(
        metrics.contains(&format!(
            "flashsale_waiting_room_draw_seed{{activity_id=\"{}\"}} {seed}",
            sale.id
        )),
        "the seed is a metric"
    );
    let ahead_before: HashMap<String, Value> = {
        let mut m = HashMap::new();
        for u in &users {
            m.insert(u.clone(), place(&app, &sale.sku, u).await["ahead"].clone());
        }
        m
    };
    // Redis loses the room (the turns too).
    lose_room(&app, &sale.id, 3).await;
    // The same seed and order come back from MySQL; those who held a turn are
    // first in line again, and get it back.
    let after = eventually(Duration::from_secs(10), "the room rebuilt", || async {
        let figures = room(&app, &sale.id).await;
        (figures["seed"] == json!(seed) && figures["admitted"] == 3).then_some(figures)
    })
    .await;
    assert_eq!(after["seed"], before["seed"]);
    for u in &users {
        let p = place(&app, &sale.sku, u).await;
        assert_eq!(p["ahead"], ahead_before[u], "{u}: {p}");
    }
    app.stop().await;
}

/// The activity as the service holds it, for calling the room directly.
fn activity(app: &TestApp, sku: &str) -> std::sync::Arc<flashsale::activity::Activity> {
    app.state
        .cache
        .for_sku(sku, chrono::Utc::now())
        .expect("the sale is cached")
}

/// A room sale of `stock` units starting in 2 s, every user joined; its id,
/// its SKU and the first user admitted.
async fn room_with_a_turn(app: &TestApp, stock: u32, users: &[&str]) -> (String, String, String) {
    let (id, sku) = room_sale(app, stock, Duration::from_secs(2)).await;
    for u in users {
        assert_eq!(app.join_queue(&sku, u).await.status(), StatusCode::CREATED);
    }
    let user = admitted_one(app, &sku, users).await;
    (id, sku, user)
}

/// A reservation of `user`'s held in Redis and not yet answered (as a request
/// in flight holds it); its id.
async fn hold_in_redis(app: &TestApp, activity_id: &str, user: &str) -> String {
    let rid = flashsale::stock::new_reservation_id(user, 1);
    let now_ms = chrono::Utc::now().timestamp_millis();
    app.state
        .stock
        .reserve(activity_id, user, 1, &rid, now_ms)
        .await
        .expect("reserve");
    rid
}

async fn admitted_one(app: &TestApp, sku: &str, users: &[&str]) -> String {
    eventually(Duration::from_secs(15), "a turn", || async {
        for u in users {
            if place(app, sku, u).await["state"] == "admitted" {
                return Some((*u).to_owned());
            }
        }
        None
    })
    .await
}

/// `sold_out` is not final: a top-up after the sell-out reopens the room, and the
/// users still in line are admitted and buy.
#[tokio::test]
async fn a_room_told_sold_out_reopens_when_units_come_back() {
    let app = TestApp::builder().workers().spawn().await;
    let users = ["r0", "r1", "r2"];
    let (id, sku, first) = room_with_a_turn(&app, 1, &users).await;
    assert_eq!(
        app.reserve(&sku, &first, None).await.status(),
        StatusCode::ACCEPTED
    );
    let (order, _): (u64, String) = eventually(Duration::from_secs(15), "the order", || async {
        sqlx::query_as("SELECT id, CAST(user_id AS CHAR) FROM orders WHERE activity_id = ?")
            .bind(&id)
            .fetch_optional(&app.state.pool)
            .await
            .expect("orders")
    })
    .await;
    let paid = app.pay(&order.to_string(), &first).await;
    assert_eq!(paid.status(), StatusCode::OK);
    let others: Vec<&str> = users.iter().copied().filter(|u| *u != first).collect();
    all_told(&app, &sku, &others, "sold_out", Duration::from_secs(10)).await;
    // Told to come back slowly, not told it is over.
    let told = app.queue_place(&sku, others[0]).await;
    assert_eq!(
        told.headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok()),
        Some("30")
    );
    // Two units more: both others get a turn, and buy.
    let topped = app.top_up(&id, json!({"add": 2})).await;
    assert_eq!(topped.status(), StatusCode::OK);
    all_told(&app, &sku, &others, "admitted", Duration::from_secs(10)).await;
    for u in &others {
        assert_eq!(
            app.reserve(&sku, u, None).await.status(),
            StatusCode::ACCEPTED,
            "{u}"
        );
    }
    assert_eq!(room(&app, &id).await["closed"], false);
    app.stop().await;
}

/// After the draw, a poll whose answer only the line's moving can change is
/// answered from memory while the line has not moved: users waiting behind a
/// turn that holds the only unit, then the same users told `sold_out` once it
/// is paid. Every answer is the one Redis gave; the polls ask Redis (the
/// status script, the one that ranks a user in line) less often than they
/// are sent; a top-up moves the line and the users are admitted at once.
#[tokio::test]
async fn polls_of_a_line_that_has_not_moved_cost_redis_nothing() {
    let app = TestApp::builder().workers().spawn().await;
    let users = ["m0", "m1", "m2", "m3"];
    let (id, sku, first) = room_with_a_turn(&app, 1, &users).await;
    let sale = Sale {
        id: id.clone(),
        sku: sku.clone(),
        shards: 1,
    };
    let others: Vec<&str> = users.iter().copied().filter(|u| *u != first).collect();
    let polls = 30;
    // The status script: the place (first the user's arrival number), then
    // the room's mark; no other script of the room starts and ends that way.
    let asked_redis = |lines: &[String]| -> usize {
        let (calls, _) = script_calls(lines);
        let inner = |l: &&String| words(l).first().map(|w| w.to_uppercase());
        calls
            .iter()
            .filter(|(_, run)| {
                run.first().and_then(inner).as_deref() == Some("ZSCORE")
                    && run.last().and_then(inner).as_deref() == Some("HMGET")
            })
            .count()
    };
    // Waiting behind the turn: the line cannot move while it runs.
    let mut told = HashMap::new();
    for u in &others {
        let body = place(&app, &sku, u).await;
        assert_eq!(body["state"], "waiting", "{body}");
        assert!(body["position"].as_u64().is_some(), "{body}");
        told.insert(*u, body);
    }
    // At most a third of the polls may miss memory (a step late by more
    // than two ticks on a busy machine); the admitted user's poll, which
    // memory never answers, is the count's control.
    let most = 1 + polls / 3;
    let watch = app.watch_redis(&sale).await;
    for i in 0..polls {
        let u = others[i % others.len()];
        assert_eq!(place(&app, &sku, u).await, told[u], "{u}: Redis's answer");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(place(&app, &sku, &first).await["state"], "admitted");
    let asked = asked_redis(&app.watched(&sale, watch).await);
    assert!(
        (1..=most).contains(&asked),
        "{asked} status calls for {polls} waiting polls and the control"
    );

    // Bought and paid: nothing can come back, the others are told sold_out.
    assert_eq!(
        app.reserve(&sku, &first, None).await.status(),
        StatusCode::ACCEPTED
    );
    let order: u64 = eventually(Duration::from_secs(15), "the order", || async {
        sqlx::query_scalar("SELECT id FROM orders WHERE activity_id = ?")
            .bind(&id)
            .fetch_optional(&app.state.pool)
            .await
            .expect("orders")
    })
    .await;
    assert_eq!(
        app.pay(&order.to_string(), &first).await.status(),
        StatusCode::OK
    );
    all_told(&app, &sku, &others, "sold_out", Duration::from_secs(10)).await;
    let watch = app.watch_redis(&sale).await;
    for i in 0..polls {
        let u = others[i % others.len()];
        assert_eq!(place(&app, &sku, u).await["state"], "sold_out", "{u}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(place(&app, &sku, &first).await["state"], "admitted");
    let asked = asked_redis(&app.watched(&sale, watch).await);
    assert!(
        (1..=most).contains(&asked),
        "{asked} status calls for {polls} sold_out polls and the control"
    );

    // Units come back: the line moves, and no poll is told the old answer
    // for longer than the step that sees it.
    let topped = app.top_up(&id, json!({"add": 3})).await;
    assert_eq!(topped.status(), StatusCode::OK);
    all_told(&app, &sku, &others, "admitted", Duration::from_secs(2)).await;
    app.stop().await;
}

/// A join that runs after the draw read the joiners is placed, behind the drawn
/// (early or late is decided by Redis's clock and the draw's seal, not by the
/// clock of the instance that takes the join).
#[tokio::test]
async fn a_join_after_the_draw_read_the_joiners_is_placed() {
    let app = spawn_app().await;
    let (id, sku) = room_sale(&app, 3, Duration::from_secs(2)).await;
    for u in ["e0", "e1"] {
        assert_eq!(app.join_queue(&sku, u).await.status(), StatusCode::CREATED);
    }
    eventually(Duration::from_secs(15), "the draw", || async {
        room(&app, &id).await["seed"].as_u64()
    })
    .await;
    let a = activity(&app, &sku);
    let joining = app
        .state
        .waiting_room
        .join(&a, "behind", chrono::Utc::now())
        .await
        .expect("join");
    assert!(
        matches!(joining, Joining::Joined { now: true, .. }),
        "{joining:?}"
    );
    eventually(
        Duration::from_secs(10),
        "the late early joiner admitted",
        || async { (place(&app, &sku, "behind").await["state"] == "admitted").then_some(()) },
    )
    .await;
    app.stop().await;
}

/// While another request's reservation of the same user is still in flight, an
/// `already_reserved` does not end the turn: if that reservation is withdrawn
/// the user still holds the turn (and no more), and reserves within it.
#[tokio::test]
async fn already_reserved_does_not_end_a_turn() {
    let app = spawn_app().await;
    let users = ["d0", "d1", "d2"];
    let (id, sku, user) = room_with_a_turn(&app, 2, &users).await;
    // A reservation of theirs held in Redis, not yet answered.
    let rid = hold_in_redis(&app, &id, &user).await;
    assert_error(
        app.reserve(&sku, &user, None).await,
        StatusCode::CONFLICT,
        "already_reserved",
    )
    .await;
    let p = place(&app, &sku, &user).await;
    assert_eq!(p["state"], "admitted", "{p}");
    assert!(p["admitted_until"].is_string(), "the turn still runs: {p}");
    // That reservation is withdrawn: the turn is still theirs.
    app.state
        .stock
        .refund(&id, &rid, &user, 1, flashsale::stock::RefundMode::Undo)
        .await
        .expect("undo");
    assert_eq!(
        app.reserve(&sku, &user, None).await.status(),
        StatusCode::ACCEPTED
    );
    let p = place(&app, &sku, &user).await;
    assert_eq!(p["state"], "admitted");
    assert!(p.get("admitted_until").is_none(), "settled: {p}");
    app.stop().await;
}

/// An admitted user told `sold_out` keeps their turn, and buys a unit that
/// comes back within it, whatever this instance's sold-out gate last saw.
#[tokio::test]
async fn an_admitted_user_told_sold_out_keeps_the_turn() {
    let app = spawn_app().await;
    let users = ["s0", "s1", "s2"];
    let (id, sku, user) = room_with_a_turn(&app, 1, &users).await;
    // Someone else's reservation takes the only unit, still pending.
    let rid = hold_in_redis(&app, &id, "outsider").await;
    assert_error(
        app.reserve(&sku, &user, None).await,
        StatusCode::CONFLICT,
        "sold_out",
    )
    .await;
    let p = place(&app, &sku, &user).await;
    assert_eq!(p["state"], "admitted", "{p}");
    assert!(p["admitted_until"].is_string(), "the turn still runs: {p}");
    // This instance found the sale sold out and shuts its gate.
    app.wait_gate_shut(&id).await;
    // The unit comes back: the user holding the turn buys it at once.
    app.state
        .stock
        .refund(&id, &rid, "outsider", 1, flashsale::stock::RefundMode::Undo)
        .await
        .expect("undo");
    assert_eq!(
        app.reserve(&sku, &user, None).await.status(),
        StatusCode::ACCEPTED
    );
    app.stop().await;
}

/// A room Redis lost comes back without giving turns to those who bought or
/// whose turn ran out, and with its late joiners in line.
#[tokio::test]
async fn a_room_rebuilt_keeps_its_buyers_expired_turns_and_late_joiners() {
    let app = TestApp::builder().turn_secs(3).spawn().await;
    let (id, sku) = room_sale(&app, 2, Duration::from_secs(2)).await;
    let users: Vec<String> = (0..8).map(|i| format!("b{i}")).collect();
    for u in &users {
        assert_eq!(app.join_queue(&sku, u).await.status(), StatusCode::CREATED);
    }
    let names: Vec<&str> = users.iter().map(String::as_str).collect();
    let buyer = admitted_one(&app, &sku, &names).await;
    assert_eq!(
        app.reserve(&sku, &buyer, None).await.status(),
        StatusCode::ACCEPTED
    );
    // Someone's turn runs out unused.
    let expired = eventually(Duration::from_secs(15), "a turn run out", || async {
        for u in &users {
            if place(&app, &sku, u).await["state"] == "expired" {
                return Some(u.clone());
            }
        }
        None
    })
    .await;
    assert_eq!(
        app.join_queue(&sku, "latecomer").await.status(),
        StatusCode::CREATED
    );
    // All three facts reach MySQL.
    eventually(Duration::from_secs(10), "the journal copied", || async {
        let facts: Vec<(String, String)> = sqlx::query_as(
            "SELECT CAST(user_id AS CHAR), CAST(kind AS CHAR) FROM waiting_room_journal \
             WHERE activity_id = ? AND kind IN ('late', 'reserved', 'expired')",
        )
        .bind(&id)
        .fetch_all(&app.state.pool)
        .await
        .expect("journal");
        let has = |user: &str, kind: &str| facts.iter().any(|(u, k)| u == user && k == kind);
        (has(&buyer, "reserved") && has(&expired, "expired") && has("latecomer", "late"))
            .then_some(())
    })
    .await;
    lose_and_rebuild(&app, &id).await;
    let p = place(&app, &sku, &buyer).await;
    assert_eq!(p["state"], "admitted", "the buyer: {p}");
    assert!(p.get("admitted_until").is_none(), "no new turn: {p}");
    assert_eq!(place(&app, &sku, &expired).await["state"], "expired");
    let late = place(&app, &sku, "latecomer").await;
    assert!(
        late["state"] == "admitted" || late["position"].is_u64(),
        "the late joiner is in line: {late}"
    );
    app.stop().await;
}

/// No instance copies the room's journal to MySQL from now on (the copier's
/// lock in Redis is held for a minute, or until the room is lost).
async fn hold_the_journal(app: &TestApp, id: &str) {
    let keys = flashsale::stock::RoomKeys::new(id, 1);
    let mut conn = app.state.stock.connection();
    let _: () = redis::cmd("SET")
        .arg(&keys.journal_lock)
        .arg("held-by-the-test")
        .arg("PX")
        .arg(60_000)
        .query_async(&mut conn)
        .await
        .expect("SET");
}

/// The end MySQL keeps of a user's turn.
async fn turn_end(app: &TestApp, id: &str, user: &str) -> Option<u64> {
    sqlx::query_scalar(
        "SELECT ends_at_ms FROM waiting_room_turns WHERE activity_id = ? AND user_id = ?",
    )
    .bind(id)
    .bind(user)
    .fetch_optional(&app.state.pool)
    .await
    .expect("the turns")
}

/// The journal rows of `kind` MySQL holds for the sale's `user`.
async fn journalled(app: &TestApp, id: &str, user: &str, kind: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT COUNT(*) FROM waiting_room_journal WHERE activity_id = ? AND user_id = ? AND kind = ?",
    )
    .bind(id)
    .bind(user)
    .bind(kind)
    .fetch_one(&app.state.pool)
    .await
    .expect("the journal")
}

/// A turn that ran out in the last moment before Redis lost the room, its
/// `expired` entry never copied to MySQL, is still run out once the room is
/// rebuilt: the turn was journalled with its end when it was given.
#[tokio::test]
async fn a_turn_run_out_just_before_a_loss_stays_run_out() {
    let app = TestApp::builder().turn_secs(5).spawn().await;
    let users = ["t0", "t1", "t2"];
    let (id, sku, first) = room_with_a_turn(&app, 1, &users).await;
    eventually(
        Duration::from_secs(10),
        "the turn given recorded",
        || async { turn_end(&app, &id, &first).await },
    )
    .await;
    // From here on no instance copies the journal, as in the moment before a
    // loss.
    hold_the_journal(&app, &id).await;
    all_told(&app, &sku, &[&first], "expired", Duration::from_secs(10)).await;
    assert_eq!(
        journalled(&app, &id, &first, "expired").await,
        0,
        "the expiry must not have reached MySQL before the loss"
    );
    lose_and_rebuild(&app, &id).await;
    // The unit goes to the next in line; the first has had their turn, and
    // is told so at every look (a second turn would show for five seconds).
    let next = eventually(Duration::from_secs(10), "the next turn", || async {
        let p = place(&app, &sku, &first).await;
        assert_eq!(p["state"], "expired", "no second turn for {first}: {p}");
        for u in users.iter().filter(|u| **u != first) {
            if place(&app, &sku, u).await["state"] == "admitted" {
                return Some(*u);
            }
        }
        None
    })
    .await;
    assert_eq!(
        app.reserve(&sku, &first, None).await.status(),
        StatusCode::FORBIDDEN
    );
    assert_eq!(
        app.reserve(&sku, next, None).await.status(),
        StatusCode::ACCEPTED
    );
    app.stop().await;
}

/// A turn held when Redis lost the room is given again, whole, once the room
/// is rebuilt, and MySQL keeps that turn's later end: a second loss within
/// it does not take the turn away.
#[tokio::test]
async fn a_turn_given_again_after_a_rebuild_keeps_its_later_end() {
    let app = TestApp::builder().turn_secs(5).spawn().await;
    let users = ["g0", "g1", "g2"];
    let (id, sku, first) = room_with_a_turn(&app, 1, &users).await;
    let ends = eventually(Duration::from_secs(10), "the turn recorded", || async {
        turn_end(&app, &id, &first).await
    })
    .await;
    lose_and_rebuild(&app, &id).await;
    eventually(
        Duration::from_secs(10),
        "the later end recorded",
        || async {
            turn_end(&app, &id, &first)
                .await
                .filter(|e| *e > ends)
                .map(|_| ())
        },
    )
    .await;
    let p = place(&app, &sku, &first).await;
    assert_eq!(p["state"], "admitted", "the turn given again: {p}");
    app.stop().await;
}

/// A buyer of an ended sale whose room is gone from Redis is told they
/// bought, from their order, even when their settled turn never reached the
/// journal before Redis lost the room.
#[tokio::test]
async fn an_ended_rooms_buyer_is_one_by_their_order() {
    let app = TestApp::builder().workers().spawn().await;
    let spec = SaleSpec {
        starts_in_secs: 2,
        open_secs: 4,
        waiting_room: true,
        ..SaleSpec::new(1)
    };
    let created = std::time::Instant::now();
    let sale = app.open_sale_spec(&spec).await;
    let users = ["o0", "o1"];
    for u in users {
        assert_eq!(
            app.join_queue(&sale.sku, u).await.status(),
            StatusCode::CREATED
        );
    }
    hold_the_journal(&app, &sale.id).await;
    let first = admitted_one(&app, &sale.sku, &users).await;
    assert_eq!(
        app.reserve(&sale.sku, &first, None).await.status(),
        StatusCode::ACCEPTED
    );
    eventually(
        Duration::from_secs(20),
        "the order written, the sale over",
        || async {
            let orders: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM orders WHERE activity_id = ? AND holder = ?",
            )
            .bind(&sale.id)
            .bind(&first)
            .fetch_one(&app.state.pool)
            .await
            .ok()?;
            let over = created.elapsed() > Duration::from_secs(7);
            (orders == 1 && over).then_some(())
        },
    )
    .await;
    assert_eq!(journalled(&app, &sale.id, &first, "reserved").await, 0);
    lose_room(&app, &sale.id, sale.shards).await;
    let p = place(&app, &sale.sku, &first).await;
    assert_eq!(p["state"], "admitted", "the buyer, from their order: {p}");
    app.stop().await;
}

/// Before `flashsale migrate` makes the table of turns given (an instance of
/// this release on the last one's schema), turns are not kept, and everything
/// else in the journal is copied and read back all the same.
#[tokio::test]
async fn a_database_not_migrated_yet_still_takes_the_rest_of_the_journal() {
    let app = TestApp::builder().turn_secs(2).spawn().await;
    sqlx::query("DROP TABLE waiting_room_turns")
        .execute(&app.state.pool)
        .await
        .expect("the last release's schema");
    let users = ["m0", "m1", "m2"];
    let (id, sku, first) = room_with_a_turn(&app, 1, &users).await;
    all_told(&app, &sku, &[&first], "expired", Duration::from_secs(10)).await;
    assert_eq!(
        app.join_queue(&sku, "latecomer").await.status(),
        StatusCode::CREATED
    );
    eventually(Duration::from_secs(10), "the expiry copied", || async {
        (journalled(&app, &id, &first, "expired").await == 1
            && journalled(&app, &id, "latecomer", "late").await == 1)
            .then_some(())
    })
    .await;
    lose_and_rebuild(&app, &id).await;
    assert_eq!(place(&app, &sku, &first).await["state"], "expired");
    app.stop().await;
}

/// Locks the journal's table on a connection of its own, as a stalled MySQL
/// would hold it, until [`unlock`].
async fn lock_the_journal(app: &TestApp) -> sqlx::pool::PoolConnection<sqlx::MySql> {
    let mut lock = app.state.pool.acquire().await.expect("a connection");
    sqlx::query("LOCK TABLES waiting_room_journal WRITE")
        .execute(&mut *lock)
        .await
        .expect("LOCK TABLES");
    lock
}

async fn unlock(mut lock: sqlx::pool::PoolConnection<sqlx::MySql>) {
    sqlx::query("UNLOCK TABLES")
        .execute(&mut *lock)
        .await
        .expect("UNLOCK TABLES");
}

/// A join is answered only once MySQL has it: while MySQL cannot record it
/// (the journal's table locked, as a slow or stalled MySQL would, and the
/// insert then failing), `503`, the user in line in Redis all the same;
/// joining again once MySQL answers records it before the answer, with the
/// same ticket; after that, joining again answers at once while MySQL is
/// stuck again (a reload, a second tab).
#[tokio::test]
async fn a_join_is_answered_once_mysql_has_it() {
    let app = spawn_app().await;
    let (id, sku) = room_sale(&app, 5, Duration::from_secs(60)).await;
    hold_the_journal(&app, &id).await;
    let lock = lock_the_journal(&app).await;
    let resp = app.join_queue(&sku, "slow").await;
    assert_error(resp, StatusCode::SERVICE_UNAVAILABLE, "unavailable").await;
    // The insert that waits for the table fails.
    let stuck: Vec<i64> = sqlx::query_scalar(
        "SELECT ID FROM information_schema.PROCESSLIST \
         WHERE DB = DATABASE() AND INFO LIKE 'INSERT IGNORE INTO waiting_room_journal%'",
    )
    .fetch_all(&app.state.pool)
    .await
    .expect("the process list");
    assert!(!stuck.is_empty(), "the join's insert waits for the table");
    for id in stuck {
        sqlx::query(&format!("KILL QUERY {id}"))
            .execute(&app.state.pool)
            .await
            .expect("KILL QUERY");
    }
    unlock(lock).await;
    assert_eq!(journalled(&app, &id, "slow", "early").await, 0);
    let resp = app.join_queue(&sku, "slow").await;
    assert_eq!(resp.status(), StatusCode::OK, "joined before");
    let ticket = resp.json::<Value>().await.expect("json")["ticket"].clone();
    assert_eq!(journalled(&app, &id, "slow", "early").await, 1);
    assert_eq!(place(&app, &sku, "slow").await["ticket"], ticket);
    // Recorded, and marked so in Redis once answered: joining again needs
    // MySQL no more.
    let recorded = flashsale::stock::RoomKeys::new(&id, 1).recorded;
    eventually(
        Duration::from_secs(5),
        "the join marked recorded",
        || async {
            let mut conn = app.state.stock.connection();
            let marked: bool = redis::cmd("SISMEMBER")
                .arg(&recorded)
                .arg("slow")
                .query_async(&mut conn)
                .await
                .ok()?;
            marked.then_some(())
        },
    )
    .await;
    let lock = lock_the_journal(&app).await;
    let resp = app.join_queue(&sku, "slow").await;
    assert_eq!(resp.status(), StatusCode::OK, "joined before, MySQL stuck");
    assert_eq!(resp.json::<Value>().await.expect("json")["ticket"], ticket);
    unlock(lock).await;
    app.stop().await;
}

/// A client that hangs up while its reservation waits for the broker does not
/// leave its turn held: the reservation's own task settles it once accepted.
#[tokio::test]
async fn a_turn_is_settled_when_the_client_hangs_up() {
    use tokio::io::AsyncWriteExt;
    let broker = crate::helpers::OwnBroker::start();
    let app = TestApp::builder()
        .kafka_brokers(broker.brokers())
        .spawn()
        .await;
    let users = ["h0", "h1"];
    let (id, sku, user) = room_with_a_turn(&app, 1, &users).await;
    // The broker stalls: the reservation is held in Redis and its publish waits.
    broker.broker.pause();
    let host = app.address.trim_start_matches("http://").to_owned();
    let mut socket = tokio::net::TcpStream::connect(&host)
        .await
        .expect("connect");
    let request = format!(
        "POST /flash/{sku}/reserve HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {}\r\ncontent-length: 0\r\n\r\n",
        app.token(&user)
    );
    socket
        .write_all(request.as_bytes())
        .await
        .expect("request written");
    let keys = flashsale::stock::Keys::new(&id);
    let conn = app.state.stock.connection();
    eventually(Duration::from_secs(10), "the reservation held", || {
        let (keys, mut conn, user) = (&keys, conn.clone(), &user);
        async move {
            let rid: Option<String> = redis::cmd("HGET")
                .arg(&keys.buyers)
                .arg(user)
                .query_async(&mut conn)
                .await
                .expect("HGET");
            rid
        }
    })
    .await;
    // The client gives up while the publish waits; then the broker comes back.
    socket.shutdown().await.expect("hang up");
    drop(socket);
    broker.broker.resume();
    eventually(Duration::from_secs(10), "the turn settled", || async {
        let p = place(&app, &sku, &user).await;
        (p["state"] == "admitted" && p.get("admitted_until").is_none()).then_some(())
    })
    .await;
    app.stop().await;
}

/// A user whose turn ran out while their reservation was in flight (or whose
/// answer was lost) is a buyer all the same: asking again they hear
/// `already_reserved`, and the room counts them as reserved.
#[tokio::test]
async fn a_reservation_made_in_a_turn_that_ran_out_stands() {
    let app = TestApp::builder().turn_secs(1).spawn().await;
    let users = ["t0", "t1"];
    let (id, sku, user) = room_with_a_turn(&app, 1, &users).await;
    // Held in Redis within the turn; its answer never reached the user.
    let rid = hold_in_redis(&app, &id, &user).await;
    eventually(Duration::from_secs(10), "the turn run out", || async {
        (place(&app, &sku, &user).await["state"] == "expired").then_some(())
    })
    .await;
    let body = assert_error(
        app.reserve(&sku, &user, None).await,
        StatusCode::CONFLICT,
        "already_reserved",
    )
    .await;
    assert_eq!(body["reservation_id"], rid.as_str());
    let p = place(&app, &sku, &user).await;
    assert_eq!(p["state"], "admitted", "a buyer: {p}");
    assert!(p.get("admitted_until").is_none(), "{p}");
    app.stop().await;
}

/// A room Redis never lost anything of is sealed and drawn from Redis alone:
/// the journal MySQL keeps of its joins is not read back at the draw (a large
/// room's draw would wait on MySQL handing every join back, on every instance
/// at once). A room that had another life in Redis, or whose Redis copy lacks
/// early joiners MySQL journalled (a failover to a replica that missed them),
/// is rebuilt from the journal. Each room's journal gets one row Redis does
/// not have; that user is drawn only where the journal is read back.
#[tokio::test]
async fn only_a_room_redis_lost_something_of_reads_its_journal_back_at_the_draw() {
    let app = spawn_app().await;
    // (the row's life in Redis: this one or another, its kind, drawn)
    for (other_life, kind, drawn) in [
        (false, "late", 20),
        (true, "early", 21),
        (false, "early", 21),
    ] {
        let (id, sku) = room_sale(&app, 3, Duration::from_secs(3)).await;
        for i in 0..20 {
            let resp = app.join_queue(&sku, &format!("j{i}")).await;
            assert_eq!(resp.status(), StatusCode::CREATED);
        }
        let gen = eventually(Duration::from_secs(10), "the joins journalled", || async {
            let rows: Vec<(Option<String>,)> =
                sqlx::query_as("SELECT gen FROM waiting_room_journal WHERE activity_id = ? AND kind IN ('early', 'late')")
                    .bind(&id)
                    .fetch_all(&app.state.pool)
                    .await
                    .ok()?;
            (rows.len() == 20).then(|| rows[0].0.clone())?
        })
        .await;
        let gen = if other_life { format!("0{gen}") } else { gen };
        sqlx::query(
            "INSERT INTO waiting_room_journal (activity_id, user_id, kind, joined_seq, recorded_at, gen) \
             VALUES (?, 'from-the-journal', ?, 1000, NOW(3), ?)",
        )
        .bind(&id)
        .bind(kind)
        .bind(&gen)
        .execute(&app.state.pool)
        .await
        .expect("a journal row");
        let figures = eventually(Duration::from_secs(30), "the draw", || async {
            let figures = room(&app, &id).await;
            (!figures["seed"].is_null()).then_some(figures)
        })
        .await;
        assert_eq!(
            figures["joined"], drawn,
            "another life: {other_life}, {kind}: {figures}"
        );
    }
    app.stop().await;
}

/// Once an ended sale's room is gone from Redis (its state removed after the
/// retention, or lost), each user is told what Redis told them once the room
/// closed, from MySQL's journal: the buyer `admitted`, the others `sold_out`,
/// with the same tickets; a user who never joined is still `404`.
#[tokio::test]
async fn an_ended_room_gone_from_redis_is_answered_from_the_journal() {
    let app = TestApp::builder().workers().spawn().await;
    let spec = SaleSpec {
        starts_in_secs: 2,
        open_secs: 4,
        waiting_room: true,
        ..SaleSpec::new(1)
    };
    let sale = app.open_sale_spec(&spec).await;
    let users = ["j0", "j1", "j2"];
    for u in users {
        assert_eq!(
            app.join_queue(&sale.sku, u).await.status(),
            StatusCode::CREATED
        );
    }
    let first = admitted_one(&app, &sale.sku, &users).await;
    assert_eq!(
        app.reserve(&sale.sku, &first, None).await.status(),
        StatusCode::ACCEPTED
    );
    // Ended, every waiting user told so, and the buyer's turn journalled.
    let told: HashMap<&str, Value> =
        eventually(Duration::from_secs(20), "the room closed and journalled", || async {
            let journalled: i64 = sqlx::query_scalar(
                "SELECT COUNT(*) FROM waiting_room_journal WHERE activity_id = ? AND kind = 'reserved'",
            )
            .bind(&sale.id)
            .fetch_one(&app.state.pool)
            .await
            .expect("journal");
            if journalled == 0 {
                return None;
            }
            let mut told = HashMap::new();
            for u in users {
                let body = place(&app, &sale.sku, u).await;
                let expected = if u == first { "admitted" } else { "sold_out" };
                if body["state"] != expected {
                    return None;
                }
                told.insert(u, body);
            }
            Some(told)
        })
        .await;
    lose_room(&app, &sale.id, sale.shards).await;
    for u in users {
        let resp = app.queue_place(&sale.sku, u).await;
        assert_eq!(resp.status(), StatusCode::OK, "{u}");
        assert!(!resp.headers().contains_key("retry-after"), "{u}: final");
        let body: Value = resp.json().await.expect("JSON");
        assert_eq!(body, told[u], "{u}: what Redis said, from MySQL");
    }
    let never = app.queue_place(&sale.sku, "never-joined").await;
    assert_error(never, StatusCode::NOT_FOUND, "not_found").await;
    app.stop().await;
}
