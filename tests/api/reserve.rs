//! The reserve path end to end: Redis Lua → Kafka → 202.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use flashsale::stock::{RefundMode, RefundOutcome};
use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::helpers::{
    assert_error, eventually, read_topic, script_calls, spawn_app, unique, words, Caller,
    OwnBroker, TestApp, WAIT,
};

/// The seed's test: 100 users click twice, 200 concurrent requests for 10 units.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn seed_test_200_requests_for_10_units() {
    let app = spawn_app().await;
    let sale = app.open_sale(10, 1).await;

    let answers = app.crowd(&sale.sku, 100, 2, 200).await;

    let accepted: Vec<_> = answers
        .iter()
        .filter(|(_, s, _)| *s == StatusCode::ACCEPTED)
        .collect();
    let refused = answers
        .iter()
        .filter(|(_, s, b)| {
            *s == StatusCode::CONFLICT
                && (b["code"] == "sold_out" || b["code"] == "already_reserved")
        })
        .count();
    assert_eq!(accepted.len(), 10, "exactly 10 reservations");
    assert_eq!(
        refused, 190,
        "every other request is sold_out or already_reserved"
    );

    let winners: HashSet<&str> = accepted.iter().map(|(u, _, _)| u.as_str()).collect();
    assert_eq!(winners.len(), 10, "10 distinct winners");
    for (_, _, body) in &accepted {
        assert_eq!(body["status"], "pending");
        assert_eq!(body["quantity"], 1);
        assert_eq!(body["activity_id"], sale.id.as_str());
    }

    assert_eq!(app.redis_stock(&sale).await, Some(0), "Redis stock is 0");
    let snap = app.redis_snapshot(&sale).await;
    assert_eq!(snap.buyers, 10, "10 buyers recorded");
    assert_eq!(snap.pending, 10, "10 reservations pending");

    let messages = read_topic(&app.settings.kafka.topic).await;
    assert_eq!(messages.len(), 10, "10 messages on the topic");
    let reserved: HashMap<&str, &str> = accepted
        .iter()
        .map(|(u, _, b)| (u.as_str(), b["reservation_id"].as_str().expect("id")))
        .collect();
    for m in &messages {
        assert_eq!(m.activity_id, sale.id);
        assert_eq!(m.sku, sale.sku);
        assert_eq!(m.quantity, 1);
        assert_eq!(
            reserved.get(m.user_id.as_str()).copied(),
            Some(m.reservation_id.as_str()),
            "each message is a winner's reservation"
        );
    }
    app.stop().await;
}

/// The same at scale: 2,000 users × 2 concurrent clicks for 100 units.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn scale_4000_requests_for_100_units() {
    let app = spawn_app().await;
    let sale = app.open_sale(100, 1).await;

    let answers = app.crowd(&sale.sku, 2000, 2, 256).await;

    let server_errors: Vec<_> = answers
        .iter()
        .filter(|(_, s, _)| s.is_server_error())
        .collect();
    assert!(
        server_errors.is_empty(),
        "no 5xx: {:?}",
        server_errors.first()
    );
    let winners: HashSet<&str> = answers
        .iter()
        .filter(|(_, s, _)| *s == StatusCode::ACCEPTED)
        .map(|(u, _, _)| u.as_str())
        .collect();
    let accepted = answers
        .iter()
        .filter(|(_, s, _)| *s == StatusCode::ACCEPTED)
        .count();
    assert_eq!(accepted, 100, "exactly 100 reservations");
    assert_eq!(winners.len(), 100, "100 distinct winners");
    assert!(answers
        .iter()
        .all(|(_, s, _)| *s == StatusCode::ACCEPTED || *s == StatusCode::CONFLICT));
    assert_eq!(app.redis_stock(&sale).await, Some(0));
    let messages = read_topic(&app.settings.kafka.topic).await;
    assert_eq!(messages.len(), 100, "one message per reservation");
    let users: HashSet<_> = messages.iter().map(|m| m.user_id.as_str()).collect();
    assert_eq!(users, winners, "the messages are the winners'");
    app.stop().await;
}

#[tokio::test]
async fn a_winner_repeating_gets_the_same_reservation() {
    let app = spawn_app().await;
    let sale = app.open_sale(5, 1).await;

    let first = app.reserve_accepted(&sale.sku, "alice").await;
    let id = first["reservation_id"].as_str().expect("id").to_owned();

    let again = app.reserve(&sale.sku, "alice", None).await;
    let body = assert_error(again, StatusCode::CONFLICT, "already_reserved").await;
    assert_eq!(body["reservation_id"], id.as_str());
    assert_eq!(
        app.redis_stock(&sale).await,
        Some(4),
        "a retry holds no second unit"
    );

    let (status_code, status) = app.reservation_state(&sale.sku, "alice").await;
    assert_eq!(status_code, StatusCode::OK);
    assert_eq!(status["reservation_id"], id.as_str());
    assert_eq!(status["status"], "pending");
    app.stop().await;
}

#[tokio::test]
async fn quantity_up_to_the_per_user_limit() {
    let app = spawn_app().await;
    let sale = app.open_sale(5, 3).await;
    let resp = app
        .reserve(&sale.sku, "bob", Some(json!({"quantity": 3})))
        .await;
    assert_eq!(resp.status(), StatusCode::ACCEPTED);
    let body: Value = resp.json().await.expect("json");
    assert_eq!(body["quantity"], 3);
    assert_eq!(app.redis_stock(&sale).await, Some(2));
    // Two left: asking for three is sold out, not a partial reservation.
    let resp = app
        .reserve(&sale.sku, "carol", Some(json!({"quantity": 3})))
        .await;
    assert_error(resp, StatusCode::CONFLICT, "sold_out").await;
    assert_eq!(app.redis_stock(&sale).await, Some(2));
    let messages = read_topic(&app.settings.kafka.topic).await;
    assert_eq!(messages.len(), 1);
    assert_eq!(messages[0].quantity, 3);
    app.stop().await;
}

#[tokio::test]
async fn refund_twice_returns_one_unit() {
    let app = spawn_app().await;
    let sale = app.open_sale(3, 1).await;
    let body = app.reserve_accepted(&sale.sku, "dave").await;
    let id = body["reservation_id"].as_str().expect("id");
    assert_eq!(app.redis_stock(&sale).await, Some(2));

    let refund = || {
        app.state
            .stock
            .refund(&sale.id, id, "dave", 1, RefundMode::Return)
    };
    let first = refund().await.expect("refund");
    assert_eq!(first, RefundOutcome::Returned { units: 1 });
    let second = refund().await.expect("refund");
    assert_eq!(second, RefundOutcome::AlreadyRefunded);
    assert_eq!(app.redis_stock(&sale).await, Some(3), "one unit back, once");
    // Undoing a reservation that is not pending (the answer of a reserve that never
    // ran) returns nothing.
    let unknown = app
        .state
        .stock
        .refund(&sale.id, "no-such-reservation", "dave", 1, RefundMode::Undo)
        .await
        .expect("refund");
    assert_eq!(unknown, RefundOutcome::NothingToUndo);
    assert_eq!(app.redis_stock(&sale).await, Some(3));
    // The purchase right was kept: the same user cannot reserve again.
    let again = app.reserve(&sale.sku, "dave", None).await;
    assert_error(again, StatusCode::CONFLICT, "already_reserved").await;
    app.stop().await;
}

#[tokio::test]
async fn sold_out_is_not_confused_with_not_loaded() {
    let app = spawn_app().await;
    let now = chrono::Utc::now();
    let sku = unique("sku-");
    let resp = app
        .create_activity(json!({
            "sku": sku, "stock": 5,
            "starts_at": now - chrono::Duration::seconds(5),
            "ends_at": now + chrono::Duration::hours(1),
        }))
        .await;
    assert_eq!(resp.status(), StatusCode::CREATED);
    let body: Value = resp.json().await.expect("json");
    let id = body["id"].as_str().expect("id").to_owned();
    // Open, but never preloaded: Redis has no key, which must not read as zero.
    let resp = app.reserve(&sku, "erin", None).await;
    assert_error(resp, StatusCode::SERVICE_UNAVAILABLE, "unavailable").await;
    assert_eq!(
        app.state
            .stock
            .stock_left(&id, 1)
            .await
            .expect("redis answers"),
        None,
        "nothing was written"
    );
    app.stop().await;
}

/// The broker dies: the reservation is refused with 503 and its unit returned.
#[tokio::test]
async fn broker_down_answers_503_and_holds_no_stock() {
    let mut broker = OwnBroker::start();
    let brokers = broker.brokers();
    let app = TestApp::builder()
        .kafka_brokers(brokers)
        .publish_timeout_ms(1500)
        .spawn()
        .await;
    let sale = app.open_sale(10, 1).await;
    let ok = app.reserve(&sale.sku, "frank", None).await;
    assert_eq!(ok.status(), StatusCode::ACCEPTED);
    assert_eq!(app.redis_stock(&sale).await, Some(9));

    broker.kill();

    let resp = app.reserve(&sale.sku, "grace", None).await;
    let body = assert_error(resp, StatusCode::SERVICE_UNAVAILABLE, "unavailable").await;
    assert!(body["message"]
        .as_str()
        .is_some_and(|m| !m.contains("127.0.0.1")));
    assert_eq!(app.redis_stock(&sale).await, Some(9), "the unit came back");
    let snap = app.redis_snapshot(&sale).await;
    assert_eq!(snap.pending, 1, "only frank's reservation is pending");
    assert_eq!(snap.buyers, 1, "grace may try again");
    // The prober sees the broker gone within a round or two (its metadata
    // request gives up after a second).
    let body = eventually(
        Duration::from_secs(5),
        "readiness to report the broker down",
        || async {
            let resp = app.readyz().await;
            let status = resp.status();
            let body: Value = resp.json().await.ok()?;
            (status == StatusCode::SERVICE_UNAVAILABLE && body["checks"]["kafka"] != "ok")
                .then_some(body)
        },
    )
    .await;
    assert_eq!(body["code"], "unavailable", "{body}");
    app.stop().await;
}

/// One script call and the commands it ran, from `MONITOR` lines (a script's
/// commands follow its call, uninterrupted, on its node).
#[derive(Debug, Default)]
struct ScriptRun {
    /// `reserve`, `acknowledge` or `confirm`, told apart by the keys its
    /// commands touch (the call's own line may quote a script's code).
    name: &'static str,
    /// The call itself and every command it ran.
    commands: Vec<String>,
    /// For `confirm`: the reservations whose pending marks it cleared.
    confirmed: usize,
}

/// The script runs among `lines` (see [`script_calls`]), and the lines that
/// belong to none.
fn script_runs(lines: &[String]) -> (Vec<ScriptRun>, Vec<String>) {
    let (runs, other) = script_calls(lines);
    let runs = runs
        .into_iter()
        .map(|(call, inner)| {
            let touches = |key: &str| inner.iter().any(|l| l.contains(&format!("{key}\"")));
            let name = if touches(":state") {
                "reserve"
            } else if touches(":pending") {
                "confirm"
            } else {
                "acknowledge"
            };
            let mut commands = vec![words(call)[0].to_uppercase()];
            let mut confirmed = 0;
            for l in inner {
                let w = words(l);
                if w[0].eq_ignore_ascii_case("ZREM") {
                    confirmed += w.len() - 2;
                }
                commands.push(w[0].to_uppercase());
            }
            ScriptRun {
                name,
                commands,
                confirmed,
            }
        })
        .collect();
    (runs, other)
}

/// What one winning reservation costs Redis, end to end, counted by `MONITOR`
/// (the commands scripts run included): the reserve script, the acknowledgement
/// (its fate) before the `202`, and the consumer's confirmation once MySQL holds
/// the order, shared by its batch. No other command names the sale: the gate,
/// the window and the pending bookkeeping add none. docs/DESIGN.md ("What a
/// winning reservation costs Redis") gives the list and why each is needed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn what_a_winning_reservation_costs_redis() {
    const RESERVE: usize = 9;
    const ACKNOWLEDGE: usize = 3;
    const CONFIRM_A_BATCH: usize = 5;
    let app = TestApp::builder().workers().spawn().await;
    let units = 100;
    let sale = app.open_sale(units, 1).await;
    let watch = app.watch_redis(&sale).await;
    let started = std::time::Instant::now();
    const CONCURRENCY: usize = 16;
    for (user, status, body) in app.crowd(&sale.sku, units as usize, 1, CONCURRENCY).await {
        assert_eq!(status, StatusCode::ACCEPTED, "{user}: {body}");
    }
    eventually(WAIT, "every order confirmed in Redis", || async {
        let (runs, _) = script_runs(&watch.seen());
        let confirmed: usize = runs.iter().map(|r| r.confirmed).sum();
        (confirmed >= units as usize).then_some(())
    })
    .await;
    let lines = app.watched(&sale, watch).await;
    let seconds = started.elapsed().as_secs() as usize + 1;
    let (runs, other) = script_runs(&lines);
    // `redis.min_replicas_acked = auto`, the default: the barrier looks at the
    // shard's replicas online (`HGET` of the buyer, and a script whose `INFO`
    // names no key) about once a second (those arriving together before the
    // first look answers each look). Without a replica online (a lone Redis)
    // it waits for none; with one (the Cluster's primaries have theirs), each
    // reservation waits twice (`HGET`, `INCRBY` of the barrier, `WAIT`, which
    // names no key), before its publish and before its answer.
    let replicas_online = app.replicas_online(&sale).await;
    let looks = lines
        .iter()
        .filter(|l| l.contains("\"EVAL\"") && l.contains(":barrier\""))
        .count();
    let (probes, other): (Vec<String>, Vec<String>) = other
        .into_iter()
        .partition(|l| l.contains("\"HGET\"") && l.contains(":buyers\""));
    let (bumps, other): (Vec<String>, Vec<String>) = other
        .into_iter()
        .partition(|l| l.contains("\"INCRBY\"") && l.contains(":barrier\""));
    let waits = if replicas_online {
        2 * units as usize
    } else {
        0
    };
    assert!(
        (1..=seconds * usize::from(sale.shards) + CONCURRENCY).contains(&looks)
            && probes.len() == looks + waits
            && bumps.len() == waits,
        "{looks} looks at the replicas, {} probes, {} barrier bumps in {seconds} s \
         (replicas online: {replicas_online})",
        probes.len(),
        bumps.len()
    );
    let mut by_command: std::collections::BTreeMap<(&str, &str), usize> = Default::default();
    for r in &runs {
        for c in &r.commands {
            *by_command.entry((r.name, c.as_str())).or_default() += 1;
        }
    }
    let count = |name: &str| -> (usize, usize) {
        let of: Vec<_> = runs.iter().filter(|r| r.name == name).collect();
        (of.len(), of.iter().map(|r| r.commands.len()).sum())
    };
    let (reserves, reserve_commands) = count("reserve");
    let (acks, ack_commands) = count("acknowledge");
    let (batches, confirm_commands) = count("confirm");
    let total = reserve_commands + ack_commands + confirm_commands + other.len();
    println!(
        "{units} winning reservations: {total} Redis commands, {:.2} a 202 \
         (reserve {reserve_commands}, acknowledge {ack_commands}, confirm {confirm_commands} \
         in {batches} batches, other {}); by script and command: {by_command:?}",
        total as f64 / f64::from(units),
        other.len()
    );
    assert!(other.is_empty(), "commands outside the scripts: {other:?}");
    assert_eq!(reserves, units as usize);
    assert_eq!(reserve_commands, RESERVE * reserves, "{by_command:?}");
    assert_eq!(acks, units as usize);
    assert_eq!(ack_commands, ACKNOWLEDGE * acks, "{by_command:?}");
    assert_eq!(
        confirm_commands,
        CONFIRM_A_BATCH * batches,
        "{by_command:?}"
    );
}

/// The producer's queue is full (one message, held 2 s by the linger): a
/// reservation that finds it so is refused at once (`503`, its unit back), and
/// never enqueued later. Enqueued when room came, its message could be
/// acknowledged up to twice the publish timeout after the reservation, later
/// than a rebuild after a Redis loss waits (the publish timeout and 0.5 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_producer_queue_refuses_at_once() {
    let app = TestApp::builder()
        .workers()
        .producer_queue_messages(1)
        .linger_ms(2_000)
        .publish_timeout_ms(2_500)
        .spawn()
        .await;
    let sale = app.open_sale(5, 1).await;
    let timed = |user: &'static str| {
        let request = app.api.reserve(&sale.sku, Caller::User(user));
        async move {
            let started = std::time::Instant::now();
            let answer = testkit::invariants::Answer::from_response(request.send().await).await;
            (answer, started.elapsed())
        }
    };
    let (a, b) = tokio::join!(timed("one"), timed("two"));
    let answers = [a, b];
    let refused: Vec<_> = answers
        .iter()
        .filter(|(a, _)| a.status == Some(503))
        .collect();
    let accepted: Vec<_> = answers
        .iter()
        .filter(|(a, _)| a.status == Some(202))
        .collect();
    assert_eq!((refused.len(), accepted.len()), (1, 1), "{answers:?}");
    assert!(
        refused[0].1 < Duration::from_millis(1_000),
        "refused at once, not when the queue had room: {answers:?}"
    );
    assert_eq!(
        app.redis_stock(&sale).await,
        Some(4),
        "the refused unit came back"
    );
    let answers: Vec<_> = answers.into_iter().map(|(a, _)| a).collect();
    let probe = app.probe(&sale);
    probe.wait_quiet(WAIT).await.expect("quiet");
    let figures = probe.check(&answers).await.expect("invariants hold");
    assert_eq!(figures.accepted, 1, "{figures:?}");
    app.stop().await;
}
