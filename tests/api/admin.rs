//! Operators: create, overlap, preload, pause/resume, live figures, sale status.

use chrono::Utc;
use reqwest::StatusCode;
use serde_json::{json, Value};

use std::time::{Duration, Instant};

use testkit::invariants::Answer;

use crate::helpers::{
    assert_error, eventually, spawn_app, unique, Caller, Relay, Sale, TestApp, TestAppBuilder, WAIT,
};

#[tokio::test]
async fn create_returns_the_stored_activity_and_refuses_overlaps() {
    let app = spawn_app().await;
    let sku = unique("sku-");
    let start = Utc::now() + chrono::Duration::hours(1);
    let end = start + chrono::Duration::hours(1);
    let resp = app
        .create_activity(json!({
            "id": "launch-1", "sku": sku, "stock": 100, "per_user_limit": 2,
            "starts_at": start, "ends_at": end, "payment_timeout_secs": 600,
        }))
        .await;
    assert_eq!(resp.status(), StatusCode::CREATED);
    let body: Value = resp.json().await.expect("json");
    assert_eq!(body["id"], "launch-1");
    assert_eq!(body["sku"], sku.as_str());
    assert_eq!(body["stock"], 100);
    assert_eq!(body["available"], 100);
    assert_eq!(body["per_user_limit"], 2);
    assert_eq!(body["payment_timeout_secs"], 600);
    assert_eq!(body["paused"], false);

    // Same id again.
    let resp = app
        .create_activity(json!({
            "id": "launch-1", "sku": unique("sku-"), "stock": 1,
            "starts_at": start, "ends_at": end,
        }))
        .await;
    assert_error(resp, StatusCode::CONFLICT, "conflict").await;

    // Same SKU, overlapping window.
    let resp = app
        .create_activity(json!({
            "sku": sku, "stock": 1,
            "starts_at": start + chrono::Duration::minutes(30),
            "ends_at": end + chrono::Duration::hours(1),
        }))
        .await;
    assert_error(resp, StatusCode::CONFLICT, "conflict").await;

    // Same SKU, the next window: fine. The id is generated.
    let resp = app
        .create_activity(json!({
            "sku": sku, "stock": 1, "starts_at": end, "ends_at": end + chrono::Duration::hours(1),
        }))
        .await;
    assert_eq!(resp.status(), StatusCode::CREATED);
    let body: Value = resp.json().await.expect("json");
    assert!(body["id"]
        .as_str()
        .is_some_and(|id| !id.is_empty() && id != "launch-1"));
    app.stop().await;
}

/// A price in the currency's minor units and its ISO 4217 code are kept and
/// shown to operators and buyers; a sale without one shows none.
#[tokio::test]
async fn a_price_is_stored_and_shown() {
    let app = spawn_app().await;
    let (start, end) = (Utc::now(), Utc::now() + chrono::Duration::hours(1));
    let sku = unique("sku-");
    let resp = app
        .create_activity(json!({
            "sku": sku, "stock": 3, "starts_at": start, "ends_at": end,
            "price": 1999, "currency": "usd",
        }))
        .await;
    assert_eq!(resp.status(), StatusCode::CREATED);
    let created: Value = resp.json().await.expect("json");
    assert_eq!(
        (created["price"].clone(), created["currency"].clone()),
        (json!(1999), json!("usd"))
    );
    let id = created["id"].as_str().expect("id");
    let stored: Value = app.activity(id).await.json().await.expect("json");
    assert_eq!(
        (stored["price"].clone(), stored["currency"].clone()),
        (json!(1999), json!("usd"))
    );
    let sale = app.sale_state(&sku).await;
    assert_eq!(
        (sale["price"].clone(), sale["currency"].clone()),
        (json!(1999), json!("usd"))
    );
    // A free unit is a price too; a sale without a price shows none.
    let free = unique("sku-");
    let resp = app
        .create_activity(json!({
            "sku": free, "stock": 1, "starts_at": start, "ends_at": end, "price": 0, "currency": "jpy",
        }))
        .await;
    assert_eq!(resp.status(), StatusCode::CREATED);
    assert_eq!(app.sale_state(&free).await["price"], 0);
    let plain = app.open_sale(1, 1).await;
    let sale = app.sale_state(&plain.sku).await;
    assert!(
        sale.get("price").is_none() && sale.get("currency").is_none(),
        "{sale}"
    );
    app.stop().await;
}

/// Rolled out before `flashsale migrate`: an instance that finds no price
/// columns reads every sale without a price, creates one without a price, and
/// answers one with a price `503` (nothing created); once the columns are
/// there, it finds them and takes prices.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn before_the_price_migration_sales_are_read_and_made_without_prices() {
    let owner = spawn_app().await;
    for sql in ["ALTER TABLE activities DROP COLUMN price, DROP COLUMN currency"] {
        sqlx::query(sql)
            .execute(&owner.state.pool)
            .await
            .expect(sql);
    }
    let app = TestApp::builder().database_of(&owner).spawn().await;
    let (start, end) = (Utc::now(), Utc::now() + chrono::Duration::hours(1));
    let plain = app.open_sale(2, 1).await;
    assert_eq!(app.sale_state(&plain.sku).await["state"], "open");
    let listed: Vec<Value> = app.activities().await.json().await.expect("json");
    assert!(listed
        .iter()
        .any(|a| a["id"] == plain.id.as_str() && a["price"].is_null()));
    let sku = unique("sku-");
    let priced = json!({
        "sku": sku, "stock": 1, "starts_at": start, "ends_at": end, "price": 100, "currency": "eur",
    });
    let resp = app.create_activity(priced.clone()).await;
    assert_error(resp, StatusCode::SERVICE_UNAVAILABLE, "unavailable").await;
    let listed: Vec<Value> = app.activities().await.json().await.expect("json");
    assert!(
        listed.iter().all(|a| a["sku"] != sku.as_str()),
        "nothing created"
    );
    sqlx::query(
        "ALTER TABLE activities ADD COLUMN price BIGINT NULL, \
         ADD COLUMN currency CHAR(3) CHARACTER SET ascii NULL",
    )
    .execute(&owner.state.pool)
    .await
    .expect("the columns back");
    let created = eventually(
        Duration::from_secs(45),
        "a priced sale once migrated",
        || {
            let body = priced.clone();
            let app = &app;
            async move {
                let resp = app.create_activity(body).await;
                (resp.status() == StatusCode::CREATED).then_some(())
            }
        },
    )
    .await;
    let () = created;
    assert_eq!(app.sale_state(&sku).await["price"], 100);
    app.stop().await;
    owner.stop().await;
}

/// Every malformed price or currency is `422 invalid_request`, and no
/// activity is created.
#[tokio::test]
async fn a_bad_price_is_refused_and_creates_nothing() {
    let app = spawn_app().await;
    let (start, end) = (Utc::now(), Utc::now() + chrono::Duration::hours(1));
    let sku = unique("sku-");
    for (price, currency) in [
        (json!(-1), json!("usd")),
        (json!(19.99), json!("usd")),
        (json!(1999.0), json!("usd")),
        (
            serde_json::from_str::<Value>("1e-400").expect("a JSON number"),
            json!("usd"),
        ),
        (json!("1999"), json!("usd")),
        (json!(1_000_000_000_001_i64), json!("usd")),
        (json!(1999), json!("USD")),
        (json!(1999), json!("us")),
        (json!(1999), json!("usdx")),
        (json!(1999), json!(7)),
        (json!(1999), Value::Null),
        (Value::Null, json!("usd")),
    ] {
        let mut body = json!({ "sku": sku, "stock": 3, "starts_at": start, "ends_at": end });
        if !price.is_null() {
            body["price"] = price.clone();
        }
        if !currency.is_null() {
            body["currency"] = currency.clone();
        }
        let resp = app.create_activity(body).await;
        let what = format!("price {price}, currency {currency}");
        assert_eq!(resp.status(), StatusCode::UNPROCESSABLE_ENTITY, "{what}");
        assert_error(resp, StatusCode::UNPROCESSABLE_ENTITY, "invalid_request").await;
    }
    let listed: Vec<Value> = app.activities().await.json().await.expect("json");
    assert!(
        listed.iter().all(|a| a["sku"] != sku.as_str()),
        "{listed:?}"
    );
    app.stop().await;
}

#[tokio::test]
async fn concurrent_overlapping_creations_store_one() {
    let app = spawn_app().await;
    let sku = unique("sku-");
    let start = Utc::now() + chrono::Duration::hours(1);
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let request = app.api.create_activity(&json!({
            "sku": sku, "stock": 10,
            "starts_at": start, "ends_at": start + chrono::Duration::hours(1),
        }));
        tasks.push(tokio::spawn(async move {
            request.send().await.expect("sent").status()
        }));
    }
    let mut created = 0;
    for t in tasks {
        match t.await.expect("task") {
            StatusCode::CREATED => created += 1,
            StatusCode::CONFLICT => {}
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!(created, 1);
    app.stop().await;
}

#[tokio::test]
async fn preload_pause_resume_and_live_figures() {
    let app = spawn_app().await;
    let sku = unique("sku-");
    let now = Utc::now();
    let resp = app
        .create_activity(json!({
            "sku": sku, "stock": 7,
            "starts_at": now - chrono::Duration::seconds(5),
            "ends_at": now + chrono::Duration::hours(1),
        }))
        .await;
    let body: Value = resp.json().await.expect("json");
    let id = body["id"].as_str().expect("id").to_owned();

    a_preload_loads_once_and_is_refused_while_selling(&app, &id).await;
    a_paused_sale_preloads_again_and_refuses_buyers(&app, &id, &sku).await;

    let resp = app.resume(&id).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let resp = app.reserve(&sku, "henry", None).await;
    assert_eq!(resp.status(), StatusCode::ACCEPTED);
    the_live_figures_show_the_reservation(&app, &id, &sku).await;

    for step in ["preload", "pause", "resume"] {
        let resp = app.admin_step("nope", step).await;
        assert_error(resp, StatusCode::NOT_FOUND, "not_found").await;
    }
    let resp = app.activity("nope").await;
    assert_error(resp, StatusCode::NOT_FOUND, "not_found").await;
    app.stop().await;
}

/// Not loaded yet: loaded whatever its window, even though it is open. Loaded,
/// open and not paused: a rebuild would race reservations in flight.
async fn a_preload_loads_once_and_is_refused_while_selling(app: &TestApp, id: &str) {
    let resp = app.preload(id).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let body: Value = resp.json().await.expect("json");
    assert_eq!(body, json!({"stock": 7, "buyers": 0}));
    assert_eq!(
        app.state
            .stock
            .stock_left(id, 1)
            .await
            .expect("redis answers"),
        Some(7)
    );
    let resp = app.preload(id).await;
    assert_error(resp, StatusCode::CONFLICT, "conflict").await;
}

/// Paused, a sale preloads again, idempotently, and refuses reservations.
async fn a_paused_sale_preloads_again_and_refuses_buyers(app: &TestApp, id: &str, sku: &str) {
    let resp = app.pause(id).await;
    assert_eq!(resp.status(), StatusCode::OK);
    for _ in 0..2 {
        // Idempotent: the same state twice.
        let resp = app.preload(id).await;
        assert_eq!(resp.status(), StatusCode::OK);
        let body: Value = resp.json().await.expect("json");
        assert_eq!(body, json!({"stock": 7, "buyers": 0}));
    }
    let status = app.sale_state(sku).await;
    assert_eq!(status["state"], "paused");
    assert_eq!(status["stock_left"], 7);
    let resp = app.reserve(sku, "henry", None).await;
    assert_error(resp, StatusCode::SERVICE_UNAVAILABLE, "paused").await;
}

/// One reservation made: the admin figures and the public status agree.
async fn the_live_figures_show_the_reservation(app: &TestApp, id: &str, sku: &str) {
    let live = app.activity_figures(id).await;
    assert_eq!(live["id"], id);
    assert_eq!(live["live"]["loaded"], true);
    assert_eq!(live["live"]["redis_stock"], 6);
    assert_eq!(live["live"]["reservations_pending"], 1);
    assert_eq!(live["live"]["buyers"], 1);
    assert!(live["orders_by_status"].is_object());

    let status = app.sale_state(sku).await;
    assert_eq!(status["state"], "open");
    assert_eq!(status["stock_left"], 6);
    assert_eq!(status["activity_id"], id);
}

#[tokio::test]
async fn sale_status_moves_through_its_states() {
    let app = spawn_app().await;
    let now = Utc::now();
    let upcoming = unique("sku-");
    app.create_activity(json!({
        "sku": upcoming, "stock": 3,
        "starts_at": now + chrono::Duration::hours(1),
        "ends_at": now + chrono::Duration::hours(2),
    }))
    .await;
    let ended = unique("sku-");
    app.create_activity(json!({
        "sku": ended, "stock": 3,
        "starts_at": now - chrono::Duration::hours(2),
        "ends_at": now - chrono::Duration::hours(1),
    }))
    .await;
    assert_eq!(app.sale_state(&upcoming).await["state"], "upcoming");
    assert_eq!(app.sale_state(&ended).await["state"], "ended");

    let sale = app.open_sale(1, 1).await;
    assert_eq!(app.sale_state(&sale.sku).await["state"], "open");
    assert_eq!(
        app.reserve(&sale.sku, "ivy", None).await.status(),
        StatusCode::ACCEPTED
    );
    let sold = app.sale_state(&sale.sku).await;
    assert_eq!(sold["state"], "sold_out");
    assert_eq!(sold["stock_left"], 0);
    let resp = app.reserve(&sale.sku, "jack", None).await;
    assert_error(resp, StatusCode::CONFLICT, "sold_out").await;
    app.stop().await;
}

/// Found by hand: a window ending at the last second of year 9999 answered
/// `500` (MariaDB stored NULL for a time bound as a TIMESTAMP, whose range ends in
/// 2038). Such times are stored faithfully.
#[tokio::test]
async fn windows_past_2038_are_stored_faithfully() {
    let app = spawn_app().await;
    for end in ["2040-06-01T12:00:00Z", "9999-12-31T23:59:59Z"] {
        let resp = app
            .create_activity(json!({
                "sku": unique("far-"), "stock": 3,
                "starts_at": "2039-01-01T00:00:00Z", "ends_at": end,
            }))
            .await;
        assert_eq!(resp.status(), StatusCode::CREATED, "ends_at {end}");
        let body: Value = resp.json().await.expect("JSON");
        let stored: chrono::DateTime<chrono::Utc> =
            serde_json::from_value(body["ends_at"].clone()).expect("a time");
        assert_eq!(
            stored,
            end.parse::<chrono::DateTime<chrono::Utc>>().expect("time")
        );
        let again = app.activity_figures(body["id"].as_str().expect("id")).await;
        assert_eq!(again["ends_at"], body["ends_at"]);
    }
}

#[tokio::test]
async fn activities_are_listed_newest_first_with_live_figures() {
    let app = spawn_app().await;
    let older = app.open_sale(3, 1).await;
    let newer = app.open_sale(4, 1).await;
    let resp = app.get("/admin/activities").await;
    assert_error(resp, StatusCode::UNAUTHORIZED, "unauthorized").await;
    let resp = app.activities().await;
    assert_eq!(resp.status(), StatusCode::OK);
    let list: Vec<Value> = resp.json().await.expect("JSON");
    let at = |id: &str| list.iter().position(|a| a["id"] == id).expect("listed");
    assert!(at(&newer.id) < at(&older.id), "newest first");
    let entry = &list[at(&newer.id)];
    assert_eq!(entry["live"]["redis_stock"], 4, "{entry}");
    assert_eq!(entry["live"]["reservations_pending"], 0, "{entry}");
    assert!(entry["orders_by_status"].is_object(), "{entry}");
}

/// An app whose Redis is reached through `relay` (which a test can hold);
/// requests held there for a while are late, not failed.
fn app_behind(relay: &Relay) -> TestAppBuilder {
    TestApp::builder()
        .workers()
        .redis_via(relay)
        .redis_response_timeout_ms(5_000)
}

/// Redis loses the sale while a reservation's message still waits in the
/// producer, and an operator preloads at once. The build must wait that publish
/// out, as the automatic rebuild does: built before its order reaches MySQL, it
/// counts the unit as for sale, and the unit is promised twice (the order the
/// message makes, and a new buyer's `202`, which MySQL then refuses).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_preload_waits_out_the_publishes_in_flight() {
    a_preload_while_a_publish_is_in_flight(Lost::Whole).await;
}

/// The same over a state still loaded but older than the last build written:
/// Redis failed over to a replica that missed that build and what followed
/// it, the reservation in flight among them. Paused by an operator, the sale
/// may be preloaded: the build cannot withdraw what the state does not hold,
/// so it must wait the publish out as well.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_preload_over_an_older_build_waits_out_the_publishes_in_flight() {
    a_preload_while_a_publish_is_in_flight(Lost::ToAnOlderBuild).await;
}

/// How Redis lost the reservation in flight.
enum Lost {
    /// Every key of the sale.
    Whole,
    /// To a replica holding the build before the last (no buyer, every unit).
    ToAnOlderBuild,
}

async fn a_preload_while_a_publish_is_in_flight(lost: Lost) {
    let relay = Relay::start("127.0.0.1:6379").await;
    // Every message waits 1.5 s in the producer before it is sent.
    let app = app_behind(&relay)
        .linger_ms(1_500)
        .publish_timeout_ms(2_500)
        .spawn()
        .await;
    let sale = app.open_sale(2, 1).await;
    if let Lost::ToAnOlderBuild = lost {
        // A second build, so that a replica can still hold the first.
        assert_eq!(app.pause(&sale.id).await.status(), StatusCode::OK);
        assert_eq!(app.preload(&sale.id).await.status(), StatusCode::OK);
        assert_eq!(app.resume(&sale.id).await.status(), StatusCode::OK);
    }
    let reserve = |user: &str| {
        let request = app.api.reserve(&sale.sku, Caller::User(user));
        async move { Answer::from_response(request.send().await).await }
    };
    let started = Instant::now();
    let in_flight = tokio::spawn(reserve("in-flight"));
    eventually(WAIT, "the reservation in Redis", || async {
        let s = app.state.stock.snapshot(&sale.id, 1).await.ok()?;
        (s.pending == 1).then_some(())
    })
    .await;
    let k = flashsale::stock::Keys::new(&sale.id);
    let mut conn = app.state.stock.connection();
    match lost {
        Lost::Whole => {
            let _: () = redis::pipe()
                .del(&[&k.stock, &k.state, &k.buyers, &k.pending, &k.res])
                .query_async(&mut conn)
                .await
                .expect("Redis loses the sale");
        }
        Lost::ToAnOlderBuild => {
            let built: u32 = redis::cmd("GET")
                .arg(&k.epoch)
                .query_async(&mut conn)
                .await
                .expect("the build in Redis");
            let _: () = redis::pipe()
                .del(&[&k.buyers, &k.pending, &k.res])
                .set(&k.stock, 2)
                .set(&k.epoch, built - 1)
                .query_async(&mut conn)
                .await
                .expect("Redis goes back a build");
            // Loaded and open: an operator pauses before preloading.
            assert_eq!(app.pause(&sale.id).await.status(), StatusCode::OK);
        }
    }
    // While its message is acknowledged (1.5 s after it was sent to the
    // producer), the service's Redis requests wait: the consumer writes the
    // order before the request can ask MySQL for a withdrawal.
    let hold = async {
        tokio::time::sleep_until((started + Duration::from_millis(1_000)).into()).await;
        relay.hold();
        tokio::time::sleep_until((started + Duration::from_millis(2_200)).into()).await;
        relay.release();
    };
    let preload = async {
        eventually(WAIT, "the preload", || async {
            // 503 while the consumers drain the queue.
            (app.preload(&sale.id).await.status() == StatusCode::OK).then_some(())
        })
        .await;
        if let Lost::ToAnOlderBuild = lost {
            assert_eq!(app.resume(&sale.id).await.status(), StatusCode::OK);
        }
        // Two new buyers as soon as it is built.
        let a = tokio::spawn(reserve("next-1"));
        let b = tokio::spawn(reserve("next-2"));
        vec![a.await.expect("answer"), b.await.expect("answer")]
    };
    let ((), mut answers) = tokio::join!(hold, preload);
    answers.push(in_flight.await.expect("answer"));
    let probe = app.probe(&sale);
    probe.wait_quiet(WAIT).await.expect("quiet");
    let figures = probe.check(&answers).await.expect("invariants hold");
    assert_eq!(figures.accepted, 2, "{figures:?}");
    assert_eq!(figures.failed, 0, "{figures:?}");
}

/// A payment lapses while an operator's preload is between its MySQL snapshot
/// and its Redis write, and the sweeper returns the unit at once, into the state
/// the preload is about to replace. The unit must be on sale once the preload is
/// done: in MySQL's count and in Redis, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lapse_during_a_preload_is_on_sale_after_it() {
    let relay = Relay::start("127.0.0.1:6379").await;
    let app = app_behind(&relay).spawn().await;
    let sale = app.open_sale(3, 1).await;
    let answers = vec![an_order_past_its_deadline(&app, &sale).await];
    let resp = app.pause(&sale.id).await;
    assert_eq!(resp.status(), StatusCode::OK);
    // The sweeper runs on an instance that reaches Redis directly.
    let other = TestApp::builder()
        .database_of(&app)
        .kafka_of(&app)
        .spawn()
        .await;
    let sweeper = other.sweeper();

    let preload = a_preload_held_between_snapshot_and_write(&app, &relay, &sale).await;
    let swept = sweeper.sweep_once().await.expect("sweep");
    assert_eq!((swept.cancelled, swept.returned), (1, 1), "{swept:?}");
    relay.release();
    let resp = preload.await.expect("preload");
    assert_eq!(resp.status(), StatusCode::OK);

    assert_eq!(
        app.redis_stock(&sale).await,
        Some(3),
        "the lapse's unit is back, once"
    );
    let again = sweeper.sweep_once().await.expect("sweep");
    assert_eq!((again.cancelled, again.returned), (0, 0), "{again:?}");
    let resp = app.resume(&sale.id).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let probe = app.probe(&sale);
    probe.wait_quiet(WAIT).await.expect("quiet");
    let figures = probe.check(&answers).await.expect("invariants hold");
    assert_eq!(figures.cancelled, 1, "{figures:?}");
    other.stop().await;
}

/// One order, confirmed, whose payment deadline has passed (no sweeper has
/// run yet); its reservation's answer.
async fn an_order_past_its_deadline(app: &TestApp, sale: &Sale) -> Answer {
    let resp = app.reserve(&sale.sku, "lapser", None).await;
    let answer = Answer::from_response(Ok(resp)).await;
    assert_eq!(answer.status, Some(202));
    eventually(WAIT, "the order, confirmed", || async {
        let s = app.state.stock.snapshot(&sale.id, 1).await.ok()?;
        let ordered = app.order_counts(&sale.id).await.get("pending_payment") == Some(&1);
        (ordered && s.pending == 0).then_some(())
    })
    .await;
    sqlx::query("UPDATE orders SET expires_at = NOW(3) - INTERVAL 1 SECOND WHERE activity_id = ?")
        .bind(&sale.id)
        .execute(&app.state.pool)
        .await
        .expect("the deadline passes");
    answer
}

/// Starts a preload and returns once it has taken its MySQL snapshot and its
/// Redis write is held in the relay (released by the caller).
async fn a_preload_held_between_snapshot_and_write(
    app: &TestApp,
    relay: &Relay,
    sale: &Sale,
) -> tokio::task::JoinHandle<reqwest::Response> {
    let epoch = || async {
        let (epoch,): (u32,) = sqlx::query_as("SELECT redis_epoch FROM activities WHERE id = ?")
            .bind(&sale.id)
            .fetch_one(&app.state.pool)
            .await
            .expect("epoch");
        epoch
    };
    let before = epoch().await;
    // The preload's snapshot waits behind this lock until the relay holds the
    // preload's Redis write.
    let mut lock = app.state.pool.begin().await.expect("a transaction");
    sqlx::query("SELECT id FROM activities WHERE id = ? FOR UPDATE")
        .bind(&sale.id)
        .execute(&mut *lock)
        .await
        .expect("the activity's lock");
    let preload = tokio::spawn({
        let request = app.api.preload(&sale.id);
        async move { request.send().await.expect("an answer") }
    });
    eventually(WAIT, "the preload waiting for its snapshot", || async {
        let (n,): (i64,) = sqlx::query_as(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE DB = DATABASE() \
             AND ID <> CONNECTION_ID() AND INFO LIKE '%redis_epoch FROM activities WHERE id%FOR UPDATE%'",
        )
        .fetch_one(&app.state.pool)
        .await
        .ok()?;
        (n > 0).then_some(())
    })
    .await;
    relay.hold();
    lock.commit().await.expect("commit");
    eventually(WAIT, "the snapshot taken", || async {
        (epoch().await > before).then_some(())
    })
    .await;
    preload
}

/// A buyer whose answer was lost retries while the sale is paused: they are told
/// what they hold (`409 already_reserved`, with its id), never `503`, which says
/// nothing is held; anyone else is told `paused`. Whether this instance knows of
/// the pause (an operator's) or only Redis does (a pause by another instance,
/// an automatic one).
#[tokio::test]
async fn a_buyer_retrying_during_a_pause_learns_what_they_hold() {
    let app = spawn_app().await;
    let sale = app.open_sale(5, 1).await;
    let tell = |body: Value| body["reservation_id"].as_str().map(str::to_owned);
    let held = tell(app.reserve_accepted(&sale.sku, "ann").await).expect("an id");

    assert_eq!(app.pause(&sale.id).await.status(), StatusCode::OK);
    let again = assert_error(
        app.reserve(&sale.sku, "ann", None).await,
        StatusCode::CONFLICT,
        "already_reserved",
    )
    .await;
    assert_eq!(tell(again), Some(held.clone()), "known to this instance");
    assert_error(
        app.reserve(&sale.sku, "bob", None).await,
        StatusCode::SERVICE_UNAVAILABLE,
        "paused",
    )
    .await;

    assert_eq!(app.resume(&sale.id).await.status(), StatusCode::OK);
    let k = flashsale::stock::Keys::new(&sale.id);
    let mut conn = app.state.stock.connection();
    let _: () = redis::cmd("SET")
        .arg(&k.state)
        .arg("paused")
        .query_async(&mut conn)
        .await
        .expect("pause in Redis only");
    let again = assert_error(
        app.reserve(&sale.sku, "ann", None).await,
        StatusCode::CONFLICT,
        "already_reserved",
    )
    .await;
    assert_eq!(tell(again), Some(held), "known to Redis only");
    assert_error(
        app.reserve(&sale.sku, "bob", None).await,
        StatusCode::SERVICE_UNAVAILABLE,
        "paused",
    )
    .await;
    assert_eq!(app.redis_stock(&sale).await, Some(4), "bob holds nothing");
    app.stop().await;
}

/// Redis loses the sale again just after a build wrote it, before the build is
/// recorded, and another instance sees that second loss (and pauses the sale
/// for it, or finds it paused for the first already). The build repaired the
/// first loss only: it must not lift the pause, which the build that repairs
/// the second lifts.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_second_loss_keeps_a_pause_taken_for_it() {
    a_second_loss_keeps_its_pause(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_second_loss_keeps_a_pause_it_sees_already_taken() {
    a_second_loss_keeps_its_pause(true).await;
}

async fn a_second_loss_keeps_its_pause(paused_for_the_first: bool) {
    let redis = Relay::start("127.0.0.1:6379").await;
    let mysql = Relay::start("127.0.0.1:3306").await;
    // `other` reaches Redis and MySQL directly; `app` through the relays.
    let other = TestApp::builder().publish_timeout_ms(500).spawn().await;
    let app = TestApp::builder()
        .database_of(&other)
        .kafka_of(&other)
        .redis_via(&redis)
        .mysql_via(&mysql)
        .redis_response_timeout_ms(5_000)
        .spawn()
        .await;
    let sale = app.open_sale(3, 1).await;
    let k = flashsale::stock::Keys::new(&sale.id);
    let conn = other.state.stock.connection();
    let lose = |conn: flashsale::stock::RedisConn| {
        let k = flashsale::stock::Keys::new(&sale.id);
        async move {
            let mut conn = conn;
            let _: () = redis::pipe()
                .del(&[&k.stock, &k.state, &k.buyers, &k.pending, &k.res])
                .query_async(&mut conn)
                .await
                .expect("Redis loses the sale");
        }
    };
    lose(conn.clone()).await;
    if paused_for_the_first {
        // Paused for the first loss by an instance that saw it.
        assert!(other
            .state
            .activities
            .auto_pause(&sale.id, 1)
            .await
            .expect("a pause"));
    }
    // An operator's preload takes its MySQL snapshot; its Redis write waits in
    // the relay, then its record of the build waits in the other.
    let preload = a_preload_held_between_snapshot_and_write(&app, &redis, &sale).await;
    mysql.hold();
    redis.release();
    eventually(WAIT, "the build written", || {
        let mut conn = conn.clone();
        let epoch = k.epoch.clone();
        async move {
            let e: Option<u32> = redis::cmd("GET")
                .arg(&epoch)
                .query_async(&mut conn)
                .await
                .ok()?;
            e.filter(|e| *e >= 2).map(|_| ())
        }
    })
    .await;
    lose(conn.clone()).await;
    let seen = other
        .state
        .reconciler
        .reconcile(&sale.id)
        .await
        .expect("a pass");
    assert_eq!(seen.paused_automatically, !paused_for_the_first, "{seen:?}");
    mysql.release();
    assert_eq!(preload.await.expect("preload").status(), StatusCode::OK);
    let now = other
        .state
        .activities
        .get(&sale.id)
        .await
        .expect("a query")
        .expect("the sale");
    assert!(
        now.paused && now.auto_paused,
        "the pause for the second loss stands: {now:?}"
    );
    // The build that repairs the second loss lifts it.
    eventually(WAIT, "rebuilt and resumed", || async {
        other.state.reconciler.reconcile(&sale.id).await.ok()?;
        let a = other.state.activities.get(&sale.id).await.ok()??;
        (!a.paused && other.redis_snapshot(&sale).await.loaded()).then_some(())
    })
    .await;
    other.stop().await;
    app.stop().await;
}

/// Two instances preload one split sale at once: one build at a time (the
/// second is refused, `503`, while the first runs), and Redis ends holding the
/// build MySQL last recorded on every shard, never an older one written over a
/// newer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_preloads_of_one_sale_do_not_interleave() {
    let relay = Relay::start("127.0.0.1:6379").await;
    let (app, other) = one_behind_the_relay_one_direct(&relay).await;
    let sale = a_paused_split_sale(&app).await;
    let first = a_preload_held_between_snapshot_and_write(&app, &relay, &sale).await;
    let second = other.preload(&sale.id).await.status();
    relay.release();
    assert_eq!(first.await.expect("preload").status(), StatusCode::OK);
    assert_eq!(
        second,
        StatusCode::SERVICE_UNAVAILABLE,
        "refused while the first build runs"
    );
    every_shard_holds_the_last_build(&other, &sale, "paused").await;
    app.stop().await;
    other.stop().await;
}

/// An operator resumes a split sale while a forced rebuild of it is between
/// its snapshot and its writes: the resume waits for the build, and the sale
/// ends whole (the same build on every shard) and open.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_resume_waits_for_a_forced_rebuild() {
    let relay = Relay::start("127.0.0.1:6379").await;
    let (app, other) = one_behind_the_relay_one_direct(&relay).await;
    let sale = a_paused_split_sale(&app).await;
    let preload = a_preload_held_between_snapshot_and_write(&app, &relay, &sale).await;
    let resume = tokio::spawn({
        let request = other.api.resume(&sale.id);
        async move { request.send().await.expect("an answer").status() }
    });
    // The build stays held in the relay for as long as this takes.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!resume.is_finished(), "the resume waits for the build");
    relay.release();
    assert_eq!(preload.await.expect("preload").status(), StatusCode::OK);
    assert_eq!(resume.await.expect("resume"), StatusCode::OK);
    every_shard_holds_the_last_build(&other, &sale, "open").await;
    app.stop().await;
    other.stop().await;
}

async fn every_shard_holds_the_last_build(app: &TestApp, sale: &Sale, state: &str) {
    let built = app
        .state
        .activities
        .get(&sale.id)
        .await
        .expect("a query")
        .expect("the sale")
        .redis_built_epoch;
    let mut conn = app.state.stock.connection();
    for (i, k) in flashsale::stock::Keys::all(&sale.id, sale.shards)
        .iter()
        .enumerate()
    {
        let (epoch, s): (Option<u32>, Option<String>) = redis::pipe()
            .get(&k.epoch)
            .get(&k.state)
            .query_async(&mut conn)
            .await
            .expect("Redis answers");
        assert_eq!(epoch, Some(built), "shard {i}");
        assert_eq!(s.as_deref(), Some(state), "shard {i}");
    }
}

/// An operator pauses a sale while a build of it is between its MySQL snapshot
/// and its Redis write (a pause takes no build lock): the build ends with the
/// live switch as MySQL then says, paused, not as its snapshot said.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pause_during_a_build_stands_after_it() {
    let relay = Relay::start("127.0.0.1:6379").await;
    let (app, other) = one_behind_the_relay_one_direct(&relay).await;
    let sale = app.open_sale(4, 1).await;
    let k = flashsale::stock::Keys::new(&sale.id);
    let mut conn = other.state.stock.connection();
    let _: () = redis::pipe()
        .del(&[&k.stock, &k.state, &k.buyers, &k.pending, &k.res])
        .query_async(&mut conn)
        .await
        .expect("Redis loses the sale");
    let preload = a_preload_held_between_snapshot_and_write(&app, &relay, &sale).await;
    assert_eq!(other.pause(&sale.id).await.status(), StatusCode::OK);
    relay.release();
    assert_eq!(preload.await.expect("preload").status(), StatusCode::OK);
    every_shard_holds_the_last_build(&other, &sale, "paused").await;
    app.stop().await;
    other.stop().await;
}

/// Two instances of one service: `app` reaches Redis through `relay`, `other`
/// directly.
async fn one_behind_the_relay_one_direct(relay: &Relay) -> (TestApp, TestApp) {
    let other = TestApp::builder().spawn().await;
    let app = app_behind(relay)
        .database_of(&other)
        .kafka_of(&other)
        .spawn()
        .await;
    (app, other)
}

/// A sale over two stock shards, loaded and paused.
async fn a_paused_split_sale(app: &TestApp) -> Sale {
    let sale = app
        .open_sale_spec(&testkit::sale::SaleSpec {
            stock_shards: 2,
            ..testkit::sale::SaleSpec::new(4)
        })
        .await;
    assert_eq!(app.pause(&sale.id).await.status(), StatusCode::OK);
    sale
}
