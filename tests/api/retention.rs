//! Retention: a finished sale's Redis state is removed `redis.retain_after_end_secs`
//! after its end, and nothing a client or an operator sees changes; what comes
//! after (a late message, a lapse, a preload, a reconcile) never brings it back.

use std::time::Duration;

use chrono::Utc;
use flashsale::kafka::ReservationMessage;
use reqwest::StatusCode;
use serde_json::json;

use crate::helpers::{assert_error, eventually, TestApp, WAIT};

#[tokio::test]
async fn an_ended_sale_leaves_redis_and_is_still_answered_from_mysql() {
    let app = TestApp::builder()
        .workers()
        .sweeper_every(1)
        .reconciler_every(1)
        .retain_after_end_secs(1)
        .spawn()
        .await;
    // Beside it, a sale that goes on: the removal must leave it alone.
    let other = app.open_sale(5, 1).await;
    let now = Utc::now();
    // Ends at +4 s; its payments lapse after the removal.
    let sale = app.open_sale_ending(5, Duration::from_secs(4), 14).await;
    let (id, sku) = (sale.id.clone(), sale.sku.clone());
    for user in ["payer", "lapser"] {
        app.reserve_accepted(&sku, user).await;
    }
    assert_eq!(
        app.reserve(&other.sku, "neighbour", None).await.status(),
        StatusCode::ACCEPTED
    );
    app.wait_for_orders(&id, 2).await;
    let (status, payer) = app.reservation_state(&sku, "payer").await;
    assert_eq!(status, StatusCode::OK, "{payer}");
    let order_id = payer["order_id"].as_str().expect("order id").to_owned();
    assert_eq!(app.pay(&order_id, "payer").await.status(), StatusCode::OK);

    // Ended at +4 s, removed within a pass of +5 s.
    let removed = eventually(WAIT, "the removal", || async {
        app.state.activities.get(&id).await.ok()??.redis_removed_at
    })
    .await;
    // What is left is the marker that keeps any build from writing it again.
    let marker = flashsale::stock::Keys::new(&id).removed;
    let mut conn = app.state.stock.connection();
    let ttl: i64 = redis::cmd("TTL")
        .arg(&marker)
        .query_async(&mut conn)
        .await
        .expect("TTL");
    assert!(ttl > 0, "the marker expires: {ttl}");
    // A build that read MySQL before the removal began, written after it,
    // meets the marker and writes nothing.
    let build = app
        .state
        .activities
        .build_snapshot(&id)
        .await
        .expect("query")
        .expect("activity");
    let preloaded = app
        .state
        .stock
        .preload(&id, 1, &build, flashsale::stock::PreloadMode::Force)
        .await
        .expect("preload");
    assert_eq!(preloaded, flashsale::stock::Preloaded::Removed);
    assert!(removed > now + chrono::Duration::seconds(5), "{removed}");
    assert_eq!(
        keys_left(&app, &id).await,
        0,
        "every key of the sale is gone"
    );
    assert!(!app.redis_snapshot(&sale).await.loaded());
    assert!(
        app.redis_snapshot(&other).await.loaded(),
        "the other sale keeps its state"
    );

    // What a client and an operator see, now from MySQL.
    assert_eq!(app.sale_state(&sku).await["state"], "ended");
    let (status, payer) = app.reservation_state(&sku, "payer").await;
    assert_eq!((status, &payer["status"]), (StatusCode::OK, &json!("paid")));
    let (status, lapser) = app.reservation_state(&sku, "lapser").await;
    assert_eq!(
        (status, &lapser["status"]),
        (StatusCode::OK, &json!("ordered"))
    );
    let figures = app.activity_figures(&id).await;
    assert_eq!(
        figures["orders_by_status"],
        json!({"paid": 1, "pending_payment": 1}),
        "{figures}"
    );
    assert!(figures["redis_removed_at"].is_string(), "{figures}");
    assert_error(app.preload(&id).await, StatusCode::CONFLICT, "conflict").await;

    // A message that comes late: an order, and the sale stays out of Redis.
    app.state
        .publisher
        .publish(&ReservationMessage {
            reservation_id: "late-reservation".into(),
            activity_id: id.clone(),
            sku: sku.clone(),
            user_id: "late".into(),
            quantity: 1,
            reserved_at: now,
        })
        .await
        .expect("publish");
    app.wait_for_orders(&id, 3).await;
    // The lapse: cancelled, its unit back in MySQL, nothing written to Redis.
    eventually(WAIT, "the lapse", || async {
        let counts = app.order_counts(&id).await;
        (counts.get("cancelled") == Some(&1)).then_some(())
    })
    .await;
    eventually(WAIT, "the lapse's unit returned", || async {
        let (owed,): (i64,) = sqlx::query_as(
            "SELECT COUNT(*) FROM orders WHERE activity_id = ? AND status = 'cancelled' AND units_returned = FALSE",
        )
        .bind(&id)
        .fetch_one(&app.state.pool)
        .await
        .ok()?;
        (owed == 0).then_some(())
    })
    .await;
    let (status, lapser) = app.reservation_state(&sku, "lapser").await;
    assert_eq!(
        (status, &lapser["status"]),
        (StatusCode::OK, &json!("cancelled"))
    );
    assert_eq!(app.db_available(&id).await, 3, "5 - paid - late order");
    let report = app.reconcile(&id).await;
    assert_eq!(report["loaded"], false, "{report}");
    assert_eq!(
        keys_left(&app, &id).await,
        0,
        "nothing brought the sale back"
    );
    assert!(app.redis_snapshot(&other).await.loaded());
    app.stop().await;
}

/// How many of the sale's keys exist, over its stock shards and its room (each
/// asked on its own, so on a Cluster too); on one node, any other key under the
/// sale's hash tags too, so a key the service's lists forget is found.
async fn keys_left(app: &TestApp, id: &str) -> i64 {
    let mut left = listed_keys_left(app, id).await;
    if std::env::var_os("FLASHSALE_TEST_REDIS_URL").is_none() {
        let mut conn = app.state.stock.connection();
        for pattern in [format!("flash:{{{id}}}*"), format!("flash:{{{id}#*")] {
            let found: Vec<String> = redis::cmd("KEYS")
                .arg(&pattern)
                .query_async(&mut conn)
                .await
                .expect("KEYS");
            let others = found.iter().filter(|k| !k.ends_with(":removed")).count();
            left = left.max(others as i64);
        }
    }
    left
}

async fn listed_keys_left(app: &TestApp, id: &str) -> i64 {
    let stored = app
        .state
        .activities
        .get(id)
        .await
        .expect("query")
        .expect("activity");
    let mut names: Vec<String> = Vec::new();
    for k in flashsale::stock::Keys::all(id, stored.stock_shards) {
        names.extend([
            k.stock, k.buyers, k.pending, k.res, k.refunded, k.state, k.epoch, k.barrier, k.lent,
            k.received, k.restock, k.filter, k.views,
        ]);
    }
    let room = flashsale::stock::RoomKeys::new(id, stored.stock_shards);
    names.extend(room.all().iter().map(|k| k.to_string()));
    let mut conn = app.state.stock.connection();
    let mut left = 0;
    for name in names {
        let n: i64 = redis::cmd("EXISTS")
            .arg(&name)
            .query_async(&mut conn)
            .await
            .expect("EXISTS");
        left += n;
    }
    left
}
