//! Reservation-status polls spare MySQL (API version 4): a pending reservation is
//! answered from Redis, an order from the copy its first poll cached, until the
//! order changes; a change shows on the next poll. Each claim is checked with
//! MySQL held (the relay keeps the connections open and forwards nothing), so a
//! poll that asked MySQL would not answer.

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{json, Value};
use testkit::relay::Relay;

use crate::helpers::{eventually, TestApp, WAIT};

/// Long enough for Redis, far too short for a held MySQL.
const QUICK: Duration = Duration::from_secs(2);

async fn poll_quickly(app: &TestApp, sku: &str, user: &str) -> (StatusCode, Value) {
    tokio::time::timeout(QUICK, app.reservation_state(sku, user))
        .await
        .unwrap_or_else(|_| panic!("{user}'s poll waited for MySQL"))
}

#[tokio::test]
async fn polls_that_cannot_have_changed_never_ask_mysql() {
    let relay = Relay::start("127.0.0.1:3306").await;
    let app = TestApp::builder()
        .workers()
        .sweeper_every(1)
        .mysql_via(&relay)
        .spawn()
        .await;
    let sale = app.open_sale(5, 1).await;
    // Pending: made in Redis, its message never sent.
    let made = chrono::Utc::now().timestamp_millis();
    app.state
        .stock
        .reserve(&sale.id, "waiting", 1, "waiting-reservation", made)
        .await
        .expect("reserve");
    app.reserve_accepted(&sale.sku, "alice").await;
    app.wait_for_orders(&sale.id, 1).await;
    // The first poll of an order (once Redis has settled it) reads MySQL and
    // caches it.
    let first = eventually(WAIT, "alice's order on her poll", || async {
        let (status, view) = app.reservation_state(&sale.sku, "alice").await;
        (status == StatusCode::OK && view["status"] == "ordered").then_some(view)
    })
    .await;

    relay.hold();
    let (status, pending) = poll_quickly(&app, &sale.sku, "waiting").await;
    assert_eq!(
        (status, &pending["status"]),
        (StatusCode::OK, &json!("pending")),
        "{pending}"
    );
    for _ in 0..3 {
        let (status, again) = poll_quickly(&app, &sale.sku, "alice").await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(again, first, "the same answer, from the cached copy");
    }
    relay.release();

    // A change shows on the next poll, then is cached in turn.
    let order_id = first["order_id"].as_str().expect("order id");
    assert_eq!(app.pay(order_id, "alice").await.status(), StatusCode::OK);
    let (status, paid) = app.reservation_state(&sale.sku, "alice").await;
    assert_eq!((status, &paid["status"]), (StatusCode::OK, &json!("paid")));
    relay.hold();
    let (_, again) = poll_quickly(&app, &sale.sku, "alice").await;
    assert_eq!(again, paid);
    relay.release();
    app.stop().await;
}

/// A lapse shows too, though its order was cached as awaiting payment.
#[tokio::test]
async fn a_lapsed_order_is_cancelled_on_the_next_poll() {
    let app = TestApp::builder().workers().sweeper_every(1).spawn().await;
    let sale = app.open_sale_with(5, 1, 8).await;
    app.reserve_accepted(&sale.sku, "bob").await;
    app.wait_for_orders(&sale.id, 1).await;
    let (_, ordered) = app.reservation_state(&sale.sku, "bob").await;
    assert_eq!(ordered["status"], "ordered", "{ordered}");
    eventually(WAIT, "the lapse on the poll", || async {
        let (_, now) = app.reservation_state(&sale.sku, "bob").await;
        (now["status"] == "cancelled").then_some(())
    })
    .await;
    app.stop().await;
}
