//! `POST /admin/activities/{id}/stock`: more units during a sale, in MySQL and
//! Redis together, while reservations, the consumer and the reconciler run.

use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::helpers::{assert_error, eventually, spawn_app, Flood, SaleSpec, TestApp, WAIT};

/// A flood that sells 100 units, topped up by 50 mid-sale with the reconciler
/// running: exactly 150 winners, and the invariants hold once quiet.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_top_up_mid_sale_sells_exactly_the_new_stock() {
    for shards in [1u8, 3] {
        let app = TestApp::builder().workers().spawn().await;
        let sale = app
            .open_sale_spec(&SaleSpec {
                stock_shards: shards,
                ..SaleSpec::new(100)
            })
            .await;
        let flood = Flood::start(&app, &sale.sku, 16);
        eventually(WAIT, "60 units sold", || async {
            (flood.accepted() >= 60).then_some(())
        })
        .await;
        let resp = app.top_up(&sale.id, json!({"add": 50})).await;
        assert_eq!(resp.status(), StatusCode::OK);
        let body: Value = resp.json().await.expect("JSON");
        assert_eq!(body["stock"], 150);
        for _ in 0..3 {
            app.reconcile(&sale.id).await;
        }
        eventually(WAIT, "150 units sold", || async {
            (flood.accepted() >= 150 && app.redis_stock(&sale).await == Some(0)).then_some(())
        })
        .await;
        // A few more refused, then stop.
        let refused_from = flood.answered();
        eventually(WAIT, "sold-out answers", || async {
            (flood.answered() > refused_from + 50).then_some(())
        })
        .await;
        let answers = flood.stop().await;
        let probe = app.probe(&sale);
        probe.wait_quiet(WAIT).await.expect("quiet");
        let figures = probe.check(&answers).await.expect("invariants hold");
        assert_eq!(figures.accepted, 150, "K = {shards}: {figures:?}");
        assert_eq!(figures.live_orders, 150, "K = {shards}: {figures:?}");
    }
}

#[tokio::test]
async fn bad_top_ups_are_refused_and_change_nothing() {
    let app = spawn_app().await;
    let sale = app.open_sale(5, 1).await;
    for body in [
        json!({"add": 0}),
        json!({"add": -3}),
        json!({"add": 1_000_001}),
        json!({"add": "ten"}),
        json!({"add": 1.5}),
        json!({}),
        json!({"add": 1, "extra": true}),
    ] {
        let resp = app.top_up(&sale.id, body).await;
        assert_error(resp, StatusCode::UNPROCESSABLE_ENTITY, "invalid_request").await;
    }
    let resp = app.top_up("no-such-activity", json!({"add": 1})).await;
    assert_error(resp, StatusCode::NOT_FOUND, "not_found").await;
    assert_eq!(app.redis_stock(&sale).await, Some(5));
    let body = app.activity_figures(&sale.id).await;
    assert_eq!(body["stock"], 5);
    assert_eq!(body["available"], 5);
}

/// A top-up whose Redis step never happened (its request died after MySQL's
/// commit) is added by the reconciler, once; a rebuild counts it from MySQL.
#[tokio::test]
async fn the_reconciler_finishes_a_top_up_and_a_rebuild_counts_it_once() {
    let app = spawn_app().await;
    let sale = app.open_sale(5, 1).await;
    let (activity, key) = app
        .state
        .activities
        .top_up(&sale.id, 7)
        .await
        .expect("MySQL top-up");
    assert_eq!(activity.stock, 12);
    assert_eq!(
        app.redis_stock(&sale).await,
        Some(5),
        "Redis has not got it"
    );
    let reconcile = || app.reconcile(&sale.id);
    // The Redis step of the same top-up, arriving late.
    let late_redis_step = || async {
        app.state
            .stock
            .top_up(&sale.id, 1, &key, 7)
            .await
            .expect("redis")
    };
    let report = reconcile().await;
    assert_eq!(report["topups_finished"], 1, "{report}");
    assert_eq!(report["drift"], 0, "{report}");
    assert_eq!(app.redis_stock(&sale).await, Some(12));
    let report = reconcile().await;
    assert_eq!(report["topups_finished"], 0, "{report}");
    assert_eq!(app.redis_stock(&sale).await, Some(12));
    // The late Redis step of the same top-up adds nothing.
    assert_eq!(
        late_redis_step().await,
        flashsale::stock::RefundOutcome::AlreadyRefunded
    );
    // A rebuild from MySQL holds it once, and remembers it.
    app.pause(&sale.id).await;
    let resp = app.preload(&sale.id).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(app.redis_stock(&sale).await, Some(12));
    assert_eq!(
        late_redis_step().await,
        flashsale::stock::RefundOutcome::AlreadyRefunded
    );
    assert_eq!(app.redis_stock(&sale).await, Some(12));
}

/// Two instances: a top-up through one, while the other's reconciler still has
/// the activity's old stock in its activity cache. Its audit must take MySQL's
/// figures fresh, and so find no drift: the new units stay in Redis.
#[tokio::test]
async fn another_instance_s_reconciler_keeps_a_fresh_top_up() {
    let a = spawn_app().await;
    let sale = a.open_sale(5, 1).await;
    // Its cache is loaded at start (with the sale) and not refreshed again within
    // the test, the widest form of the window every instance has.
    let b = TestApp::builder()
        .database_of(&a)
        .kafka_of(&a)
        .reconciler_every(1)
        .cache_refresh_ms(600_000)
        .spawn()
        .await;
    let last_pass = || async {
        let body: Value = b.activity(&sale.id).await.json().await.ok()?;
        let last = &body["live"]["reconciler"];
        let at: chrono::DateTime<chrono::Utc> =
            serde_json::from_value(last["checked_at"].clone()).ok()?;
        Some((at, last.clone()))
    };
    // B's background work has begun (its cache took its copy at start).
    eventually(WAIT, "a first pass on B", last_pass).await;
    let resp = a.top_up(&sale.id, json!({"add": 3})).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(a.redis_stock(&sale).await, Some(8));
    let mut since = chrono::Utc::now();
    // Two of B's background passes that began after the top-up.
    for pass in 0..2 {
        let (at, last) = eventually(WAIT, "a reconciler pass on B", || async {
            last_pass().await.filter(|(at, _)| *at > since)
        })
        .await;
        assert_eq!(last["drift"], 0, "pass {pass}: {last}");
        assert_eq!(last["repaired"], false, "pass {pass}: {last}");
        assert_eq!(a.redis_stock(&sale).await, Some(8), "pass {pass}");
        since = at;
    }
    b.stop().await;
    a.stop().await;
}
