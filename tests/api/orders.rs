//! The order consumer, payment and the unpaid-order sweeper, on the real services.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use flashsale::kafka::ReservationMessage;
use flashsale::orders::{Incoming, OrderStatus, Sweeper};
use reqwest::StatusCode;
use secrecy::{ExposeSecret, SecretString};
use serde_json::Value;

use crate::helpers::{
    assert_error, db_available, eventually, order_counts, spawn_app_with, topic_len, with_workers,
    Relay, TestApp,
};

const WAIT: Duration = Duration::from_secs(60);

async fn reservation(app: &TestApp, sku: &str, user: &str) -> (StatusCode, Value) {
    let resp = app
        .client
        .get(app.url(&format!("/flash/{sku}/reservation")))
        .bearer_auth(app.token(user))
        .send()
        .await
        .expect("sent");
    let status = resp.status();
    (status, resp.json().await.expect("json"))
}

async fn pay(app: &TestApp, order_id: &str, user: &str) -> reqwest::Response {
    app.client
        .post(app.url(&format!("/orders/{order_id}/pay")))
        .bearer_auth(app.token(user))
        .send()
        .await
        .expect("sent")
}

async fn wait_for_orders(app: &TestApp, activity_id: &str, total: i64) {
    eventually(WAIT, "orders in MySQL", || async {
        let n: i64 = order_counts(app, activity_id).await.values().sum();
        (n >= total).then_some(())
    })
    .await;
}

/// The seed's scenario continued: 200 requests for 10 units become exactly 10
/// orders for 10 distinct users, and MySQL's count reaches 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn seed_scenario_ends_as_ten_orders() {
    let app = spawn_app_with(with_workers).await;
    let sale = app.open_sale(10, 1).await;
    let mut tasks = Vec::new();
    for u in 0..100 {
        for _ in 0..2 {
            let client = app.client.clone();
            let url = app.url(&format!("/flash/{}/reserve", sale.sku));
            let token = app.token(&format!("user-{u}"));
            let user = format!("user-{u}");
            tasks.push(tokio::spawn(async move {
                let s = client
                    .post(url)
                    .bearer_auth(token)
                    .send()
                    .await
                    .expect("sent")
                    .status();
                (user, s)
            }));
        }
    }
    let mut winners = HashSet::new();
    for t in tasks {
        let (user, status) = t.await.expect("task");
        if status == StatusCode::ACCEPTED {
            winners.insert(user);
        }
    }
    assert_eq!(winners.len(), 10);
    wait_for_orders(&app, &sale.id, 10).await;

    let counts = order_counts(&app, &sale.id).await;
    assert_eq!(counts.get("pending_payment"), Some(&10), "{counts:?}");
    assert_eq!(counts.values().sum::<i64>(), 10);
    assert_eq!(db_available(&app, &sale.id).await, 0, "DB count is 0");
    let users: Vec<(String,)> = sqlx::query_as("SELECT user_id FROM orders WHERE activity_id = ?")
        .bind(&sale.id)
        .fetch_all(&app.state.pool)
        .await
        .expect("users");
    let users: HashSet<String> = users.into_iter().map(|(u,)| u).collect();
    assert_eq!(users, winners, "the orders are the winners'");
    for user in &winners {
        let (status, body) = reservation(&app, &sale.sku, user).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(body["status"], "ordered", "{body}");
        assert!(body["order_id"].is_string());
        assert!(body["expires_at"].is_string());
    }
    let (status, _) = reservation(&app, &sale.sku, "user-never-won").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    // The pending marks were cleared once MySQL held the orders.
    let snap = eventually(WAIT, "pending marks cleared", || async {
        let s = app
            .state
            .stock
            .snapshot(&sale.id, sale.shards)
            .await
            .expect("snapshot");
        (s.pending == 0).then_some(s)
    })
    .await;
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
    let app = spawn_app_with(|_| {}).await;
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
    let topic = app.settings.kafka.topic.clone();
    let db = app.settings.mysql.url.expose_secret().to_owned();
    let consumer_app = spawn_app_with(|s| {
        with_workers(s);
        s.kafka.topic = topic;
        s.mysql.url = SecretString::from(db);
    })
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
    let counts = order_counts(&app, &sale.id).await;
    assert_eq!(counts.get("pending_payment"), Some(&4), "{counts:?}");
    assert_eq!(counts.values().sum::<i64>(), 4, "one order each");
    assert_eq!(
        db_available(&app, &sale.id).await,
        6,
        "units taken once each"
    );
    consumer_app.stop().await;
    app.stop().await;
}

/// A Redis that lost writes holds more stock than MySQL: MySQL never oversells, the
/// excess reservations end failed (an incident), and Redis is lowered to MySQL's
/// count instead of being refunded (a refund would resell units MySQL lacks).
#[tokio::test]
async fn redis_ahead_of_mysql_fails_the_excess() {
    let app = spawn_app_with(with_workers).await;
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
    wait_for_orders(&app, &sale.id, 8).await;
    let counts = order_counts(&app, &sale.id).await;
    assert_eq!(counts.get("pending_payment"), Some(&5), "{counts:?}");
    assert_eq!(counts.get("failed"), Some(&3), "{counts:?}");
    assert_eq!(db_available(&app, &sale.id).await, 0);
    let snap = eventually(WAIT, "the failed to leave Redis's pending set", || async {
        let s = app.state.stock.snapshot(&sale.id, sale.shards).await.ok()?;
        (s.pending == 0).then_some(s)
    })
    .await;
    assert_eq!(
        snap.stock,
        Some(0),
        "lowered to MySQL's count, never refunded"
    );
    let resp = app.reserve(&sale.sku, "late-buyer", None).await;
    assert_error(resp, StatusCode::CONFLICT, "sold_out").await;
    let failed: Vec<(String, bool)> = sqlx::query_as(
        "SELECT user_id, units_returned FROM orders WHERE activity_id = ? AND status = 'failed'",
    )
    .bind(&sale.id)
    .fetch_all(&app.state.pool)
    .await
    .expect("failed rows");
    for (user, returned) in &failed {
        assert!(returned, "units of {user} marked returned");
        let (status, body) = reservation(&app, &sale.sku, user).await;
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
    let port = relay.port;
    let app = spawn_app_with(|s| {
        with_workers(s);
        let url = s
            .mysql
            .url
            .expose_secret()
            .replace(":3306/", &format!(":{port}/"));
        s.mysql.url = SecretString::from(url);
        s.mysql.acquire_timeout_ms = 500;
    })
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
    let snap = app
        .state
        .stock
        .snapshot(&sale.id, sale.shards)
        .await
        .expect("snapshot");
    assert_eq!(snap.pending, 5);

    relay.up();
    wait_for_orders(&app, &sale.id, 5).await;
    let counts = order_counts(&app, &sale.id).await;
    assert_eq!(counts.get("pending_payment"), Some(&5), "{counts:?}");
    assert_eq!(counts.get("failed"), None);
    assert_eq!(db_available(&app, &sale.id).await, 5);
    assert_eq!(
        app.redis_stock(&sale).await,
        Some(5),
        "still nothing refunded"
    );
    app.stop().await;
}

#[tokio::test]
async fn paying_an_order() {
    let app = spawn_app_with(with_workers).await;
    let sale = app.open_sale(3, 1).await;
    assert_eq!(
        app.reserve(&sale.sku, "payer", None).await.status(),
        StatusCode::ACCEPTED
    );
    let (_, body) = reservation(&app, &sale.sku, "payer").await;
    assert_eq!(body["status"], "pending");
    let order_id = eventually(WAIT, "the order", || async {
        let (_, body) = reservation(&app, &sale.sku, "payer").await;
        body["order_id"].as_str().map(str::to_owned)
    })
    .await;

    let resp = pay(&app, &order_id, "someone-else").await;
    assert_error(resp, StatusCode::NOT_FOUND, "not_found").await;
    let resp = pay(&app, "999999999", "payer").await;
    assert_error(resp, StatusCode::NOT_FOUND, "not_found").await;
    let resp = pay(&app, "not-a-number", "payer").await;
    assert_error(resp, StatusCode::NOT_FOUND, "not_found").await;

    let resp = pay(&app, &order_id, "payer").await;
    assert_eq!(resp.status(), StatusCode::OK);
    let paid: Value = resp.json().await.expect("json");
    assert_eq!(paid["status"], "paid");
    assert_eq!(paid["order_id"], order_id.as_str());
    let again = pay(&app, &order_id, "payer").await;
    assert_eq!(again.status(), StatusCode::OK, "paying twice is fine");
    let (_, body) = reservation(&app, &sale.sku, "payer").await;
    assert_eq!(body["status"], "paid");
    app.stop().await;
}

/// An order lapses, its unit goes back, another user buys it; MySQL never holds
/// more live units than stock.
#[tokio::test]
async fn a_lapsed_unit_is_sold_again() {
    let app = spawn_app_with(|s| {
        with_workers(s);
        s.orders.sweeper_enabled = true;
        s.orders.sweep_interval_secs = 1;
    })
    .await;
    let sale = app.open_sale_with(1, 1, 1).await;
    let (id, sku) = (sale.id, sale.sku);
    assert_eq!(
        app.reserve(&sku, "slow", None).await.status(),
        StatusCode::ACCEPTED
    );
    let resp = app.reserve(&sku, "fast", None).await;
    assert_error(resp, StatusCode::CONFLICT, "sold_out").await;

    let order_id = eventually(WAIT, "the lapse", || async {
        let (_, body) = reservation(&app, &sku, "slow").await;
        (body["status"] == "cancelled")
            .then(|| body["order_id"].as_str().map(str::to_owned))
            .flatten()
    })
    .await;
    let resp = pay(&app, &order_id, "slow").await;
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
        let (_, body) = reservation(&app, &sku, "fast").await;
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
    let app = spawn_app_with(with_workers).await;
    let sale = app.open_sale_with(40, 1, 2).await;
    let (id, sku) = (sale.id, sale.sku);
    for i in 0..40 {
        assert_eq!(
            app.reserve(&sku, &format!("p{i}"), None).await.status(),
            StatusCode::ACCEPTED
        );
    }
    wait_for_orders(&app, &id, 40).await;
    let orders: Vec<(u64, String, chrono::DateTime<chrono::Utc>)> =
        sqlx::query_as("SELECT id, user_id, expires_at FROM orders WHERE activity_id = ?")
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
    let sweeper = Arc::new(Sweeper {
        repo: app.state.orders.clone(),
        stock: app.state.stock.clone(),
    });
    let mut sweeps = Vec::new();
    for _ in 0..2 {
        let sweeper = sweeper.clone();
        sweeps.push(tokio::spawn(async move {
            let mut cancelled = 0;
            for _ in 0..30 {
                cancelled += sweeper.sweep_once().await.expect("sweep").cancelled;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            cancelled
        }));
    }
    let mut payments = Vec::new();
    for (i, (order_id, user, _)) in orders.iter().enumerate() {
        let client = app.client.clone();
        let url = app.url(&format!("/orders/{order_id}/pay"));
        let token = app.token(user);
        payments.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(10 * i as u64)).await;
            client
                .post(url)
                .bearer_auth(token)
                .send()
                .await
                .expect("sent")
                .status()
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
    let mut cancelled_by_sweepers = 0;
    for s in sweeps {
        cancelled_by_sweepers += s.await.expect("sweeper");
    }
    // Whatever remains unpaid past its deadline is swept now.
    sweeper.sweep_once().await.expect("final sweep");

    let counts = order_counts(&app, &id).await;
    let paid = counts.get("paid").copied().unwrap_or(0);
    let cancelled = counts.get("cancelled").copied().unwrap_or(0);
    assert_eq!(
        paid + cancelled,
        40,
        "each order is paid or cancelled: {counts:?}"
    );
    assert_eq!(paid, paid_answers, "every 200 is a paid order");
    assert!(cancelled_by_sweepers <= cancelled as usize);
    assert_eq!(
        i64::from(db_available(&app, &id).await),
        cancelled,
        "DB units back for the cancelled only"
    );
    assert_eq!(
        app.state
            .stock
            .stock_left(&id, 1)
            .await
            .expect("redis answers"),
        Some(cancelled),
        "Redis units back once each"
    );
    let statuses: Vec<(String,)> =
        sqlx::query_as("SELECT CAST(status AS CHAR) FROM orders WHERE activity_id = ?")
            .bind(&id)
            .fetch_all(&app.state.pool)
            .await
            .expect("statuses");
    for (s,) in statuses {
        assert!(matches!(
            OrderStatus::parse(&s),
            Some(OrderStatus::Paid | OrderStatus::Cancelled)
        ));
    }
    app.stop().await;
}

/// A payload that cannot be read goes to the dead-letter topic with its reason,
/// and the partition keeps moving.
#[tokio::test]
async fn poison_messages_go_to_the_dead_letter_topic() {
    let app = spawn_app_with(with_workers).await;
    let sale = app.open_sale(5, 1).await;
    for payload in [&b"not json"[..], br#"{"reservation_id":"x"}"#, br#"{"reservation_id":"r","activity_id":"a","sku":"s","user_id":"bad id!","quantity":1,"reserved_at":"2026-01-01T00:00:00Z"}"#] {
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
    wait_for_orders(&app, &sale.id, 1).await;
    let dead = eventually(WAIT, "three dead letters", || async {
        let n = topic_len(&app.settings.kafka.dead_letter_topic).await;
        (n >= 3).then_some(n)
    })
    .await;
    assert_eq!(dead, 3);
    app.stop().await;
}
