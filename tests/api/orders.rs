//! The order consumer, payment and the unpaid-order sweeper, on the real services.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use flashsale::kafka::ReservationMessage;
use flashsale::orders::{Incoming, OrderStatus, Sweeper};
use reqwest::StatusCode;
use serde_json::Value;

use crate::helpers::{
    assert_error, eventually, spawn_app, topic_len, Caller, Relay, Sale, TestApp, WAIT,
};

/// The seed's scenario continued: 200 requests for 10 units become exactly 10
/// orders for 10 distinct users, and MySQL's count reaches 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn seed_scenario_ends_as_ten_orders() {
    let app = TestApp::builder().workers().spawn().await;
    let sale = app.open_sale(10, 1).await;
    let winners: HashSet<String> = app
        .crowd(&sale.sku, 100, 2, 200)
        .await
        .into_iter()
        .filter(|(_, status, _)| *status == StatusCode::ACCEPTED)
        .map(|(user, _, _)| user)
        .collect();
    assert_eq!(winners.len(), 10);
    app.wait_for_orders(&sale.id, 10).await;

    let counts = app.order_counts(&sale.id).await;
    assert_eq!(counts.get("pending_payment"), Some(&10), "{counts:?}");
    assert_eq!(counts.values().sum::<i64>(), 10);
    assert_eq!(app.db_available(&sale.id).await, 0, "DB count is 0");
    let users: Vec<(String,)> =
        sqlx::query_as("SELECT CAST(user_id AS CHAR) FROM orders WHERE activity_id = ?")
            .bind(&sale.id)
            .fetch_all(&app.state.pool)
            .await
            .expect("users");
    let users: HashSet<String> = users.into_iter().map(|(u,)| u).collect();
    assert_eq!(users, winners, "the orders are the winners'");
    for user in &winners {
        let (status, body) = app.reservation_state(&sale.sku, user).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(body["status"], "ordered", "{body}");
        assert!(body["order_id"].is_string());
        assert!(body["expires_at"].is_string());
    }
    let (status, _) = app.reservation_state(&sale.sku, "user-never-won").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    // The pending marks were cleared once MySQL held the orders.
    let snap = app.wait_nothing_pending(&sale).await;
    assert_eq!(snap.stock, Some(0));
    assert_eq!(snap.buyers, 10);
    app.stop().await;
}

fn message(sale_id: &str, sku: &str, user: &str, reservation: &str) -> ReservationMessage {
    ReservationMessage {
        reservation_id: reservation.into(),
        activity_id: sale_id.into(),
        sku: sku.into(),
        user_id: user.into(),
        quantity: 1,
        reserved_at: chrono::Utc::now(),
    }
}

/// The same message twice, and a batch written to MySQL whose offsets were never
/// committed (the consumer killed in between): one order each.
#[tokio::test]
async fn redelivered_messages_are_no_ops() {
    let app = spawn_app().await;
    let sale = app.open_sale(10, 1).await;
    let msgs: Vec<_> = (0..4)
        .map(|i| message(&sale.id, &sale.sku, &format!("u{i}"), &format!("r{i}")))
        .collect();
    // A consumer that died after its MySQL commit and before its offset commit:
    // the orders exist, the offsets do not.
    let incoming: Vec<Incoming> = msgs
        .iter()
        .map(|m| Incoming {
            reservation_id: m.reservation_id.clone(),
            activity_id: m.activity_id.clone(),
            user_id: m.user_id.clone(),
            quantity: m.quantity,
        })
        .collect();
    app.state
        .orders
        .apply_batch(&incoming)
        .await
        .expect("first delivery");
    for m in &msgs {
        app.state.publisher.publish(m).await.expect("published");
    }
    // And the first message once more.
    app.state
        .publisher
        .publish(&msgs[0])
        .await
        .expect("published");

    // Now a consumer starts on the same group, from the beginning of the topic.
    let consumer_app = TestApp::builder()
        .workers()
        .topic_of(&app)
        .database_of(&app)
        .spawn()
        .await;
    let redeliveries = eventually(WAIT, "five redeliveries absorbed", || async {
        let (n,): (i64,) = sqlx::query_as(
            "SELECT CAST(COALESCE(SUM(redeliveries), 0) AS SIGNED) FROM orders WHERE activity_id = ?",
        )
        .bind(&sale.id)
        .fetch_one(&app.state.pool)
        .await
        .expect("sum");
        (n >= 5).then_some(n)
    })
    .await;
    assert_eq!(redeliveries, 5);
    let counts = app.order_counts(&sale.id).await;
    assert_eq!(counts.get("pending_payment"), Some(&4), "{counts:?}");
    assert_eq!(counts.values().sum::<i64>(), 4, "one order each");
    assert_eq!(app.db_available(&sale.id).await, 6, "units taken once each");
    consumer_app.stop().await;
    app.stop().await;
}

/// A Redis that lost writes holds more stock than MySQL: MySQL never oversells, the
/// excess reservations end failed (an incident), and Redis is lowered to MySQL's
/// count instead of being refunded (a refund would resell units MySQL lacks).
#[tokio::test]
async fn redis_ahead_of_mysql_fails_the_excess() {
    let app = TestApp::builder().workers().spawn().await;
    let sale = app.open_sale(5, 1).await;
    let mut conn = app.state.stock.connection();
    let _: () = redis::cmd("SET")
        .arg(format!("flash:{{{}}}:stock", sale.id))
        .arg(8)
        .query_async(&mut conn)
        .await
        .expect("set");
    for i in 0..8 {
        let resp = app.reserve(&sale.sku, &format!("buyer-{i}"), None).await;
        assert_eq!(resp.status(), StatusCode::ACCEPTED);
    }
    app.wait_for_orders(&sale.id, 8).await;
    let counts = app.order_counts(&sale.id).await;
    assert_eq!(counts.get("pending_payment"), Some(&5), "{counts:?}");
    assert_eq!(counts.get("failed"), Some(&3), "{counts:?}");
    assert_eq!(app.db_available(&sale.id).await, 0);
    // The failed leave Redis's pending set.
    let snap = app.wait_nothing_pending(&sale).await;
    assert_eq!(
        snap.stock,
        Some(0),
        "lowered to MySQL's count, never refunded"
    );
    let resp = app.reserve(&sale.sku, "late-buyer", None).await;
    assert_error(resp, StatusCode::CONFLICT, "sold_out").await;
    let failed: Vec<(String, bool)> = sqlx::query_as(
        "SELECT CAST(user_id AS CHAR), units_returned FROM orders WHERE activity_id = ? AND status = 'failed'",
    )
    .bind(&sale.id)
    .fetch_all(&app.state.pool)
    .await
    .expect("failed rows");
    for (user, returned) in &failed {
        assert!(returned, "units of {user} marked returned");
        let (status, body) = app.reservation_state(&sale.sku, user).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(body["status"], "failed");
    }
    app.stop().await;
}

/// MySQL unreachable while messages arrive: no refunds, no failed orders; every
/// order lands once it is back.
#[tokio::test]
async fn mysql_outage_delays_orders_without_refunds() {
    let relay = Relay::start("127.0.0.1:3306").await;
    let app = TestApp::builder()
        .workers()
        .mysql_via(&relay)
        .mysql_acquire_timeout_ms(500)
        .spawn()
        .await;
    let sale = app.open_sale(10, 1).await;
    relay.down();
    for i in 0..5 {
        let resp = app.reserve(&sale.sku, &format!("w{i}"), None).await;
        assert_eq!(
            resp.status(),
            StatusCode::ACCEPTED,
            "reserving needs no MySQL"
        );
    }
    // The consumer has tried and been refused several times.
    eventually(WAIT, "the consumer to hit the outage", || async {
        (relay.refused() >= 3).then_some(())
    })
    .await;
    assert_eq!(app.redis_stock(&sale).await, Some(5), "nothing refunded");
    let snap = app.redis_snapshot(&sale).await;
    assert_eq!(snap.pending, 5);

    relay.up();
    app.wait_for_orders(&sale.id, 5).await;
    let counts = app.order_counts(&sale.id).await;
    assert_eq!(counts.get("pending_payment"), Some(&5), "{counts:?}");
    assert_eq!(counts.get("failed"), None);
    assert_eq!(app.db_available(&sale.id).await, 5);
    assert_eq!(
        app.redis_stock(&sale).await,
        Some(5),
        "still nothing refunded"
    );
    app.stop().await;
}

#[tokio::test]
async fn paying_an_order() {
    let app = TestApp::builder().workers().spawn().await;
    let sale = app.open_sale(3, 1).await;
    assert_eq!(
        app.reserve(&sale.sku, "payer", None).await.status(),
        StatusCode::ACCEPTED
    );
    let (_, body) = app.reservation_state(&sale.sku, "payer").await;
    assert_eq!(body["status"], "pending");
    let order_id = eventually(WAIT, "the order", || async {
        let (_, body) = app.reservation_state(&sale.sku, "payer").await;
        body["order_id"].as_str().map(str::to_owned)
    })
    .await;

    let resp = app.pay(&order_id, "someone-else").await;
    assert_error(resp, StatusCode::NOT_FOUND, "not_found").await;
    let resp = app.pay("999999999", "payer").await;
    assert_error(resp, StatusCode::NOT_FOUND, "not_found").await;
    let resp = app.pay("not-a-number", "payer").await;
    assert_error(resp, StatusCode::NOT_FOUND, "not_found").await;

    let resp = app.pay(&order_id, "payer").await;
    assert_eq!(resp.status(), StatusCode::OK);
    let paid: Value = resp.json().await.expect("json");
    assert_eq!(paid["status"], "paid");
    assert_eq!(paid["order_id"], order_id.as_str());
    let again = app.pay(&order_id, "payer").await;
    assert_eq!(again.status(), StatusCode::OK, "paying twice is fine");
    let (_, body) = app.reservation_state(&sale.sku, "payer").await;
    assert_eq!(body["status"], "paid");
    app.stop().await;
}

/// An order lapses, its unit goes back, another user buys it; MySQL never holds
/// more live units than stock.
#[tokio::test]
async fn a_lapsed_unit_is_sold_again() {
    let app = TestApp::builder().workers().sweeper_every(1).spawn().await;
    let sale = app.open_sale_with(1, 1, 1).await;
    let (id, sku) = (sale.id, sale.sku);
    assert_eq!(
        app.reserve(&sku, "slow", None).await.status(),
        StatusCode::ACCEPTED
    );
    let resp = app.reserve(&sku, "fast", None).await;
    assert_error(resp, StatusCode::CONFLICT, "sold_out").await;

    let order_id = eventually(WAIT, "the lapse", || async {
        let (_, body) = app.reservation_state(&sku, "slow").await;
        (body["status"] == "cancelled")
            .then(|| body["order_id"].as_str().map(str::to_owned))
            .flatten()
    })
    .await;
    let resp = app.pay(&order_id, "slow").await;
    assert_error(resp, StatusCode::CONFLICT, "expired").await;
    // The right stays spent for the lapsed user.
    let resp = app.reserve(&sku, "slow", None).await;
    assert_error(resp, StatusCode::CONFLICT, "already_reserved").await;
    // The unit is on sale again.
    eventually(WAIT, "the unit back in Redis", || async {
        (app.state
            .stock
            .stock_left(&id, 1)
            .await
            .expect("redis answers")
            == Some(1))
        .then_some(())
    })
    .await;
    assert_eq!(
        app.reserve(&sku, "fast", None).await.status(),
        StatusCode::ACCEPTED
    );
    eventually(WAIT, "the second order", || async {
        let (_, body) = app.reservation_state(&sku, "fast").await;
        (body["status"] == "ordered").then_some(())
    })
    .await;
    let (live,): (i64,) = sqlx::query_as(
        "SELECT CAST(COALESCE(SUM(quantity), 0) AS SIGNED) FROM orders \
         WHERE activity_id = ? AND status IN ('pending_payment', 'paid')",
    )
    .bind(&id)
    .fetch_one(&app.state.pool)
    .await
    .expect("live units");
    assert_eq!(live, 1, "never more live units than stock");
    app.stop().await;
}

/// Payments racing the sweeper on many orders at the deadline: each order ends
/// paid or cancelled, and units come back only for the cancelled, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn payments_race_the_sweeper() {
    let app = TestApp::builder().workers().spawn().await;
    let sale = app.open_sale_with(40, 1, 2).await;
    let id = sale.id.clone();
    for i in 0..40 {
        assert_eq!(
            app.reserve(&sale.sku, &format!("p{i}"), None)
                .await
                .status(),
            StatusCode::ACCEPTED
        );
    }
    app.wait_for_orders(&id, 40).await;
    let orders: Vec<(u64, String, chrono::DateTime<chrono::Utc>)> = sqlx::query_as(
        "SELECT id, CAST(user_id AS CHAR), expires_at FROM orders WHERE activity_id = ?",
    )
    .bind(&id)
    .fetch_all(&app.state.pool)
    .await
    .expect("orders");
    // Start both sides just before the earliest deadline, so some payments land
    // before it and some after, while two sweepers run.
    let first_deadline = orders.iter().map(|o| o.2).min().expect("orders");
    let wait = (first_deadline - chrono::Utc::now() - chrono::Duration::milliseconds(150))
        .to_std()
        .unwrap_or_default();
    tokio::time::sleep(wait).await;
    let sweeper = Arc::new(app.sweeper());
    let sweeps: Vec<_> = (0..2)
        .map(|_| tokio::spawn(sweep_for_a_while(sweeper.clone())))
        .collect();
    let paid_answers = pay_one_after_another(&app, &orders).await;
    let mut cancelled_by_sweepers = 0;
    for s in sweeps {
        cancelled_by_sweepers += s.await.expect("sweeper");
    }
    // Whatever remains unpaid past its deadline is swept now.
    sweeper.sweep_once().await.expect("final sweep");

    let counts = app.order_counts(&id).await;
    let paid = counts.get("paid").copied().unwrap_or(0);
    let cancelled = counts.get("cancelled").copied().unwrap_or(0);
    assert_eq!(
        paid + cancelled,
        40,
        "each order is paid or cancelled: {counts:?}"
    );
    assert_eq!(paid, paid_answers, "every 200 is a paid order");
    assert!(cancelled_by_sweepers <= cancelled as usize);
    units_came_back_for_the_cancelled_only(&app, &sale, cancelled).await;
    app.stop().await;
}

/// Thirty sweeps 20 ms apart; how many orders they cancelled.
async fn sweep_for_a_while(sweeper: Arc<Sweeper>) -> usize {
    let mut cancelled = 0;
    for _ in 0..30 {
        cancelled += sweeper.sweep_once().await.expect("sweep").cancelled;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cancelled
}

/// Each order paid by its owner, 10 ms after the one before; how many were
/// answered `200` (the others `409 expired`).
async fn pay_one_after_another(
    app: &TestApp,
    orders: &[(u64, String, chrono::DateTime<chrono::Utc>)],
) -> i64 {
    let mut payments = Vec::new();
    for (i, (order_id, user, _)) in orders.iter().enumerate() {
        let request = app.api.pay(&order_id.to_string(), Caller::User(user));
        payments.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(10 * i as u64)).await;
            request.send().await.expect("sent").status()
        }));
    }
    let mut paid_answers = 0;
    for p in payments {
        match p.await.expect("payment") {
            StatusCode::OK => paid_answers += 1,
            StatusCode::CONFLICT => {}
            other => panic!("unexpected payment answer {other}"),
        }
    }
    paid_answers
}

/// MySQL's count and Redis's stock hold exactly the cancelled orders' units,
/// and every order ended paid or cancelled.
async fn units_came_back_for_the_cancelled_only(app: &TestApp, sale: &Sale, cancelled: i64) {
    assert_eq!(
        i64::from(app.db_available(&sale.id).await),
        cancelled,
        "DB units back for the cancelled only"
    );
    assert_eq!(
        app.state
            .stock
            .stock_left(&sale.id, 1)
            .await
            .expect("redis answers"),
        Some(cancelled),
        "Redis units back once each"
    );
    let statuses: Vec<(String,)> =
        sqlx::query_as("SELECT CAST(status AS CHAR) FROM orders WHERE activity_id = ?")
            .bind(&sale.id)
            .fetch_all(&app.state.pool)
            .await
            .expect("statuses");
    for (s,) in statuses {
        assert!(matches!(
            OrderStatus::parse(&s),
            Some(OrderStatus::Paid | OrderStatus::Cancelled)
        ));
    }
}

/// A payload that cannot be read goes to the dead-letter topic with its reason,
/// and the partition keeps moving.
#[tokio::test]
async fn poison_messages_go_to_the_dead_letter_topic() {
    let app = TestApp::builder().workers().spawn().await;
    let sale = app.open_sale(5, 1).await;
    for payload in [&b"not json"[..], br#"{"reservation_id":"x"}"#, br#"{"reservation_id":"r","activity_id":"a","sku":"s","user_id":"bad\nid","quantity":1,"reserved_at":"2026-01-01T00:00:00Z"}"#] {
        app.state
            .publisher
            .publish_raw(&app.settings.kafka.topic, Some(b"poison"), payload, "test")
            .await
            .expect("published");
    }
    assert_eq!(
        app.reserve(&sale.sku, "after-poison", None).await.status(),
        StatusCode::ACCEPTED
    );
    app.wait_for_orders(&sale.id, 1).await;
    let dead = eventually(WAIT, "three dead letters", || async {
        let n = topic_len(&app.settings.kafka.dead_letter_topic).await;
        (n >= 3).then_some(n)
    })
    .await;
    assert_eq!(dead, 3);
    app.stop().await;
}

/// MySQL is everyone's: with a budget the consumer writes no faster than it
/// allows, the backlog waits in the topic meanwhile, and no reservation is
/// refused for it.
#[tokio::test]
async fn the_consumer_keeps_to_its_budget_and_the_backlog_waits_in_the_topic() {
    const BUYERS: usize = 40;
    let app = TestApp::builder()
        .workers()
        .max_orders_per_sec(20)
        .spawn()
        .await;
    let sale = app.open_sale(BUYERS as u32, 1).await;
    for i in 0..BUYERS {
        app.reserve_accepted(&sale.sku, &format!("b{i}")).await;
    }
    let first = eventually(WAIT, "the first order", || async {
        let n = app.order_counts(&sale.id).await.values().sum::<i64>();
        (n > 0).then(std::time::Instant::now)
    })
    .await;
    app.wait_for_orders(&sale.id, BUYERS as i64).await;
    let took = first.elapsed();
    // 40 orders at 20 a second: about two seconds; unbudgeted, a few batches.
    assert!(
        took >= Duration::from_millis(1_500),
        "{BUYERS} orders in {took:?}"
    );
    app.stop().await;
}
