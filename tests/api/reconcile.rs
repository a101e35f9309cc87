//! The reconciler: reservations that never reached MySQL, stock drift, Redis loss.

use flashsale::kafka::ReservationMessage;
use reqwest::StatusCode;

use crate::helpers::{
    assert_error, eventually, spawn_app, Sale, SaleSpec, TestApp, TestAppBuilder, WAIT,
};

/// The consumer inside the app, and pending reservations decided after 2 s.
fn with_workers() -> TestAppBuilder {
    TestApp::builder().workers().pending_deadline_secs(2)
}

/// The process died between Redis and Kafka: the reservation is pending, never
/// acknowledged, with no message. Past the deadline the reconciler withdraws it
/// (the unit and the user's right come back); a message that turns up later finds
/// it decided and writes nothing.
#[tokio::test]
async fn a_reservation_that_never_reached_the_queue_is_withdrawn_once() {
    let app = with_workers().spawn().await;
    let sale = app.open_sale(5, 1).await;
    let old = chrono::Utc::now() - chrono::Duration::seconds(30);
    let reserved = app
        .state
        .stock
        .reserve(
            &sale.id,
            "ghost",
            1,
            "ghost-reservation",
            old.timestamp_millis(),
        )
        .await
        .expect("reserve");
    assert!(matches!(
        reserved,
        flashsale::stock::ReserveOutcome::Reserved { .. }
    ));
    // A normal reservation alongside, which must be left alone.
    assert_eq!(
        app.reserve(&sale.sku, "normal", None).await.status(),
        StatusCode::ACCEPTED
    );
    app.wait_for_orders(&sale.id, 1).await;
    app.wait_drained().await;
    assert_eq!(app.redis_stock(&sale).await, Some(3));

    let report = app.reconcile(&sale.id).await;
    assert_eq!(report["expired_pending"], 1, "{report}");
    assert_eq!(report["withdrawn"], 1, "{report}");
    assert_eq!(report["honoured"], 0, "{report}");
    assert_eq!(report["drift"], 0, "{report}");
    assert_eq!(
        app.redis_stock(&sale).await,
        Some(4),
        "the ghost's unit is back"
    );
    let again = app.reconcile(&sale.id).await;
    assert_eq!(again["expired_pending"], 0, "{again}");
    assert_eq!(app.redis_stock(&sale).await, Some(4), "returned once");

    the_late_message_loses(&app, &sale, old).await;
    assert_eq!(app.db_available(&sale.id).await, 4);
    assert_eq!(app.redis_stock(&sale).await, Some(4));
    // Nothing was ever acknowledged to the ghost: its right is back.
    assert_eq!(
        app.reserve(&sale.sku, "ghost", None).await.status(),
        StatusCode::ACCEPTED
    );
    app.stop().await;
}

/// The ghost's message turns up after the withdrawal: no order, no second
/// refund, one withdrawal.
async fn the_late_message_loses(
    app: &TestApp,
    sale: &Sale,
    reserved_at: chrono::DateTime<chrono::Utc>,
) {
    app.state
        .publisher
        .publish(&ReservationMessage {
            reservation_id: "ghost-reservation".into(),
            activity_id: sale.id.clone(),
            sku: sale.sku.clone(),
            user_id: "ghost".into(),
            quantity: 1,
            reserved_at,
        })
        .await
        .expect("publish");
    app.wait_drained().await;
    let counts = app.order_counts(&sale.id).await;
    assert_eq!(counts.get("failed"), None, "{counts:?}");
    assert_eq!(counts.get("pending_payment"), Some(&1), "{counts:?}");
    let (withdrawn,): (i64,) = sqlx::query_as(
        "SELECT COUNT(*) FROM withdrawals WHERE reservation_id = 'ghost-reservation'",
    )
    .fetch_one(&app.state.pool)
    .await
    .expect("withdrawals");
    assert_eq!(withdrawn, 1);
}

/// A `202` is a promise: with no consumer running, an acknowledged reservation past
/// the deadline is honoured by the reconciler (the order is written from Redis's
/// record), never failed; its message, when it is consumed, is a duplicate.
#[tokio::test]
async fn an_acknowledged_reservation_is_honoured_when_the_consumer_is_down() {
    // No consumer running.
    let app = TestApp::builder().pending_deadline_secs(1).spawn().await;
    let sale = app.open_sale(5, 1).await;
    let body = app.reserve_accepted(&sale.sku, "patient").await;
    let reservation_id = body["reservation_id"].as_str().expect("id").to_owned();
    let report = eventually(WAIT, "the reconciler to honour it", || async {
        let r = app.reconcile(&sale.id).await;
        (r["honoured"] == 1).then_some(r)
    })
    .await;
    assert_eq!(report["withdrawn"], 0, "{report}");
    let counts = app.order_counts(&sale.id).await;
    assert_eq!(counts.get("pending_payment"), Some(&1), "{counts:?}");
    assert_eq!(app.db_available(&sale.id).await, 4);
    assert_eq!(app.redis_stock(&sale).await, Some(4));
    let snap = app.redis_snapshot(&sale).await;
    assert_eq!(snap.pending, 0);
    // The message, consumed late, changes nothing.
    let late = flashsale::orders::Incoming {
        reservation_id,
        activity_id: sale.id.clone(),
        user_id: "patient".into(),
        quantity: 1,
    };
    let decisions = app
        .state
        .orders
        .apply_batch(std::slice::from_ref(&late))
        .await
        .expect("apply");
    assert_eq!(decisions, vec![flashsale::orders::Decision::Duplicate]);
    assert_eq!(app.db_available(&sale.id).await, 4);
    app.stop().await;
}

#[tokio::test]
async fn stock_drift_is_reported_and_repaired_when_safe() {
    let app = with_workers().spawn().await;
    let sale = app.open_sale(10, 1).await;
    for u in ["a", "b", "c"] {
        assert_eq!(
            app.reserve(&sale.sku, u, None).await.status(),
            StatusCode::ACCEPTED
        );
    }
    app.wait_for_orders(&sale.id, 3).await;
    app.wait_drained().await;
    let report = app.reconcile(&sale.id).await;
    assert_eq!(report["drift"], 0, "{report}");

    let mut conn = app.state.stock.connection();
    let key = format!("flash:{{{}}}:stock", sale.id);
    let _: () = redis::cmd("SET")
        .arg(&key)
        .arg(9)
        .query_async(&mut conn)
        .await
        .expect("set");
    let report = app.reconcile(&sale.id).await;
    assert_eq!(report["drift"], 2, "{report}");
    assert_eq!(report["repaired"], true, "{report}");
    assert_eq!(app.redis_stock(&sale).await, Some(7), "10 units - 3 orders");
    let report = app.reconcile(&sale.id).await;
    assert_eq!(report["drift"], 0, "{report}");
    assert_eq!(report["repaired"], false);
    app.stop().await;
}

/// Redis loses the activity mid-sale: 503 (never sold_out), paused, rebuilt from
/// MySQL once drained, resumed; earlier buyers keep their place.
#[tokio::test]
async fn redis_loss_pauses_rebuilds_and_resumes() {
    let app = with_workers().reconciler_every(3600).spawn().await;
    let sale = app.open_sale(5, 1).await;
    assert_eq!(
        app.reserve(&sale.sku, "early", None).await.status(),
        StatusCode::ACCEPTED
    );
    app.wait_for_orders(&sale.id, 1).await;
    // As if Redis restarted empty: this activity's keys are gone (only its own,
    // so the tests running beside this one keep theirs).
    let keys = flashsale::stock::Keys::new(&sale.id);
    let mut conn = app.state.stock.connection();
    let _: () = redis::cmd("DEL")
        .arg(&keys.stock)
        .arg(&keys.buyers)
        .arg(&keys.pending)
        .arg(&keys.res)
        .arg(&keys.refunded)
        .arg(&keys.state)
        .query_async(&mut conn)
        .await
        .map(|_: i64| ())
        .expect("del");

    let resp = app.reserve(&sale.sku, "late", None).await;
    assert_error(resp, StatusCode::SERVICE_UNAVAILABLE, "unavailable").await;
    // The 503 woke the reconciler: rebuilt and resumed without an operator.
    eventually(WAIT, "the rebuild", || async {
        (app.redis_stock(&sale).await == Some(4)).then_some(())
    })
    .await;
    let activity = eventually(WAIT, "the automatic resume", || async {
        let a = app.state.activities.get(&sale.id).await.ok()??;
        (!a.paused && !a.auto_paused).then_some(a)
    })
    .await;
    assert_eq!(activity.available, 4);
    app.state.cache.refresh().await.expect("refresh");
    let resp = app.reserve(&sale.sku, "early", None).await;
    assert_error(resp, StatusCode::CONFLICT, "already_reserved").await;
    assert_eq!(
        app.reserve(&sale.sku, "late", None).await.status(),
        StatusCode::ACCEPTED
    );
    assert_eq!(app.redis_stock(&sale).await, Some(3));
    app.stop().await;
}

/// An automatic pause left over a sale that is whole and current in Redis (a
/// pause that lost a race with a build, or a build whose own resume failed):
/// the next pass lifts it.
#[tokio::test]
async fn an_automatic_pause_left_over_a_whole_sale_is_lifted() {
    let app = spawn_app().await;
    let sale = app.open_sale(5, 1).await;
    let built = stored(&app, &sale.id).await.redis_built_epoch;
    assert!(
        app.state
            .activities
            .auto_pause(&sale.id, built)
            .await
            .expect("pause"),
        "the race's pause lands"
    );
    app.state.cache.refresh().await.expect("refresh");
    let resp = app.reserve(&sale.sku, "shut-out", None).await;
    assert_error(resp, StatusCode::SERVICE_UNAVAILABLE, "paused").await;
    let report = app.reconcile(&sale.id).await;
    assert_eq!(report["resumed"], true, "{report}");
    assert_eq!(report["rebuilt"], false, "{report}");
    let activity = stored(&app, &sale.id).await;
    assert!(!activity.paused && !activity.auto_paused, "resumed");
    app.state.cache.refresh().await.expect("refresh");
    assert_eq!(
        app.reserve(&sale.sku, "shut-out", None).await.status(),
        StatusCode::ACCEPTED
    );
    assert_eq!(app.redis_stock(&sale).await, Some(4));
    app.stop().await;
}

/// A flushed script cache costs one extra round trip, never a failed request.
#[tokio::test]
async fn script_flush_fails_no_request() {
    let app = spawn_app().await;
    let sale = app.open_sale(50, 1).await;
    let mut conn = app.state.stock.connection();
    for i in 0..20 {
        let _: String = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut conn)
            .await
            .expect("flush");
        assert_eq!(
            app.reserve(&sale.sku, &format!("f{i}"), None)
                .await
                .status(),
            StatusCode::ACCEPTED
        );
    }
    assert_eq!(app.redis_stock(&sale).await, Some(30));
    app.stop().await;
}

/// Redis holds an older build than MySQL's last one (a failover to a replica that
/// missed the rebuild): the reconciler sees the epoch go back, pauses the sale,
/// rebuilds it from MySQL once drained and resumes it.
#[tokio::test]
async fn an_older_build_in_redis_is_detected_and_rebuilt() {
    let app = with_workers().spawn().await;
    let sale = app.open_sale(5, 1).await;
    assert_eq!(
        app.reserve(&sale.sku, "early", None).await.status(),
        StatusCode::ACCEPTED
    );
    app.wait_for_orders(&sale.id, 1).await;
    app.wait_drained().await;
    // As a replica that missed the build would: an older epoch, and a stock that
    // forgot the early order.
    let keys = flashsale::stock::Keys::new(&sale.id);
    let mut conn = app.state.stock.connection();
    let _: () = redis::pipe()
        .set(&keys.epoch, 0)
        .set(&keys.stock, 5)
        .hdel(&keys.buyers, "early")
        .query_async(&mut conn)
        .await
        .expect("go back in time");
    // Found stale at once; rebuilt once the publishes that may have been in
    // flight at that moment have been waited out.
    let report = app.reconcile(&sale.id).await;
    assert_eq!(report["stale"], true, "{report}");
    eventually(WAIT, "the rebuild", || async {
        let report = app.reconcile(&sale.id).await;
        (report["rebuilt"] == true).then_some(())
    })
    .await;
    assert_eq!(app.redis_stock(&sale).await, Some(4));
    let activity = stored(&app, &sale.id).await;
    assert!(!activity.paused && !activity.auto_paused, "resumed");
    app.state.cache.refresh().await.expect("refresh");
    let resp = app.reserve(&sale.sku, "early", None).await;
    assert_error(resp, StatusCode::CONFLICT, "already_reserved").await;
    let again = app.reconcile(&sale.id).await;
    assert_eq!(again["stale"], false, "{again}");
    app.stop().await;
}

/// Redis lost acknowledged writes and holds more stock than MySQL (an incident),
/// while a lapsed order's unit is back in MySQL's count but not yet in Redis.
/// When MySQL refuses a reservation for want of units, Redis is lowered to what
/// MySQL still has minus what Redis is still owed: the lapse's refund, when it
/// comes, then brings Redis level with MySQL, not above it.
#[tokio::test]
async fn a_lowered_stock_leaves_room_for_the_units_still_owed_to_redis() {
    let app = with_workers().spawn().await;
    let sale = app
        .open_sale_spec(&SaleSpec {
            per_user_limit: 2,
            ..SaleSpec::new(4)
        })
        .await;
    let buy = |user: &'static str, quantity: u32| {
        let app = &app;
        let sku = sale.sku.clone();
        async move {
            let resp = app
                .reserve(
                    &sku,
                    user,
                    Some(serde_json::json!({ "quantity": quantity })),
                )
                .await;
            assert_eq!(resp.status(), StatusCode::ACCEPTED, "{user}");
        }
    };
    buy("lapser", 1).await;
    app.wait_for_status(&sale.id, "pending_payment", 1).await;
    // Its payment lapses: cancelled in MySQL (the unit is back in MySQL's count),
    // not yet refunded to Redis (the sweeper's Redis step comes later).
    sqlx::query("UPDATE orders SET expires_at = NOW(3) - INTERVAL 1 SECOND WHERE activity_id = ?")
        .bind(&sale.id)
        .execute(&app.state.pool)
        .await
        .expect("expire the order");
    let cancelled = app.state.orders.cancel_expired(10).await.expect("cancel");
    assert_eq!(cancelled.len(), 1);
    assert_eq!(app.db_available(&sale.id).await, 4);
    assert_eq!(app.redis_stock(&sale).await, Some(3));
    // The incident: Redis holds 4 units more than it should.
    let k = flashsale::stock::Keys::shard(&sale.id, 1, 0);
    let mut conn = app.state.stock.connection();
    let _: i64 = redis::AsyncCommands::incr(&mut conn, &k.stock, 4)
        .await
        .expect("incr");
    buy("first", 2).await;
    buy("second", 1).await;
    app.wait_for_status(&sale.id, "pending_payment", 2).await;
    // MySQL has 1 unit left; Redis hands out 2 more to one user: refused.
    buy("refused", 2).await;
    eventually(WAIT, "the refusal", || async {
        let failed = app.order_counts(&sale.id).await.get("failed") == Some(&1);
        let s = app.state.stock.snapshot(&sale.id, 1).await.ok()?;
        (failed && s.pending == 0).then_some(())
    })
    .await;
    assert_eq!(app.db_available(&sale.id).await, 1);
    // The lapse's refund, as the sweeper makes it.
    let swept = app.sweeper().sweep_once().await.expect("sweep");
    assert_eq!(swept.returned, 1, "{swept:?}");
    assert_eq!(
        app.redis_stock(&sale).await,
        Some(1),
        "Redis holds what MySQL has, not more"
    );
    app.stop().await;
}

/// The activity as MySQL holds it now.
async fn stored(app: &TestApp, id: &str) -> flashsale::activity::Activity {
    app.state
        .activities
        .get(id)
        .await
        .expect("query")
        .expect("activity")
}

/// A pass costs what the live sales cost: an ended sale with nothing pending is
/// looked at in Redis alone and never passed in full, however often the
/// reconciler runs, while the live sale beside it is.
#[tokio::test]
async fn an_ended_sale_with_nothing_pending_is_left_out_of_the_passes() {
    let app = with_workers().reconciler_every(1).spawn().await;
    let live = app.open_sale(5, 1).await;
    let ended = app
        .open_sale_ending(5, std::time::Duration::from_secs(3), 900)
        .await;
    app.reserve_accepted(&ended.sku, "early").await;
    app.wait_for_orders(&ended.id, 1).await;
    eventually(WAIT, "the sale to end with nothing pending", || async {
        let state = app.sale_state(&ended.sku).await;
        let pending = app.redis_snapshot(&ended).await.pending;
        (state["state"] == "ended" && pending == 0).then_some(())
    })
    .await;
    // Two full passes of the live sale since: the loop that judged the sale
    // still open (a pass begun before its end) is over.
    full_passes(&app, &live.id, 2).await;
    let before = app
        .state
        .reconciler
        .last_report(&ended.id)
        .map(|r| r.checked_at);
    let from = chrono::Utc::now();
    full_passes(&app, &live.id, 2).await;
    let after = app
        .state
        .reconciler
        .last_report(&ended.id)
        .map(|r| r.checked_at);
    assert_eq!(after, before, "no full pass over the ended sale");
    assert!(after.is_none_or(|t| t < from));
    app.stop().await;
}

/// Waits for `n` full passes of the reconciler's loop over a live sale, each
/// begun after the last.
async fn full_passes(app: &TestApp, activity_id: &str, n: usize) {
    for _ in 0..n {
        let since = chrono::Utc::now();
        eventually(WAIT, "a pass over the live sale", || async {
            let r = app.state.reconciler.last_report(activity_id)?;
            (r.checked_at > since).then_some(())
        })
        .await;
    }
}
