//! The sold-out gate: once a sale is sold out, an instance answers `sold_out` from
//! memory, and units that come back are sold again within its recheck bound.

use std::time::{Duration, Instant};

use flashsale::stock::RefundMode;
use reqwest::StatusCode;

use crate::helpers::{assert_error, eventually, spawn_app, Flood, Sale, TestApp};

#[tokio::test]
async fn a_sold_out_sale_is_answered_from_memory() {
    let app = spawn_app().await;
    let sale = app.open_sale(3, 1).await;
    let mut winner = None;
    for i in 0..3 {
        let body = app.reserve_accepted(&sale.sku, &format!("w{i}")).await;
        winner.get_or_insert((format!("w{i}"), body["reservation_id"].clone()));
    }
    assert_error(
        app.reserve(&sale.sku, "first-refused", None).await,
        StatusCode::CONFLICT,
        "sold_out",
    )
    .await;
    // A winner asking again still learns their reservation, from Redis.
    let (user, reservation_id) = winner.expect("a winner");
    let body = assert_error(
        app.reserve(&sale.sku, &user, None).await,
        StatusCode::CONFLICT,
        "already_reserved",
    )
    .await;
    assert_eq!(body["reservation_id"], reservation_id);
    // The gate shuts once this instance has read the buyers, in the background.
    app.wait_gate_shut(&sale.id).await;
    // Take the sale's stock away from Redis: a request that reached the reserve
    // script now would be answered 503 (not loaded). Every one is 409 sold_out.
    let keys = flashsale::stock::Keys::new(&sale.id);
    let mut conn = app.state.stock.connection();
    let _: () = redis::cmd("DEL")
        .arg(&keys.stock)
        .query_async(&mut conn)
        .await
        .expect("DEL");
    for i in 0..100 {
        assert_error(
            app.reserve(&sale.sku, &format!("late-{i}"), None).await,
            StatusCode::CONFLICT,
            "sold_out",
        )
        .await;
    }
}

/// Units returned by another instance while a flood is answered from memory are
/// sold again, to exactly as many users, within the gate's recheck bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn returned_units_are_sold_again_during_a_flood() {
    let app = spawn_app().await;
    let sale = app.open_sale(10, 1).await;
    let won = sell_out(&app, &sale).await;
    let flood = Flood::start(&app, &sale.sku, 8);
    eventually(Duration::from_secs(10), "the flood refused", || async {
        (flood.refused() > 200).then_some(())
    })
    .await;
    app.wait_gate_shut(&sale.id).await;
    let returned_at = Instant::now();
    return_from_another_instance(&app, &sale, &won[..4]).await;
    eventually(Duration::from_secs(10), "four units sold again", || async {
        (flood.accepted() >= 4).then_some(())
    })
    .await;
    let reopened = returned_at.elapsed();
    // Keep flooding a little: no fifth unit appears.
    let refused_then = flood.refused();
    eventually(Duration::from_secs(10), "more refusals", || async {
        (flood.refused() > refused_then + 200).then_some(())
    })
    .await;
    let answers = flood.stop().await;
    let accepted = answers.iter().filter(|a| a.status == Some(202)).count();
    let unexpected: Vec<_> = answers
        .iter()
        .filter(|a| !matches!(a.status, Some(202 | 409)))
        .collect();
    assert!(unexpected.is_empty(), "unexpected answers {unexpected:?}");
    println!("units returned during a flood were sold again after {reopened:?}");
    assert_eq!(accepted, 4, "exactly the units returned");
    assert!(
        reopened < Duration::from_secs(2),
        "sold again after {reopened:?}; the gate rechecks every {:?}",
        flashsale::stock::SOLD_OUT_RECHECK
    );
    assert_eq!(app.redis_stock(&sale).await, Some(0));
}

/// Every unit reserved, one user each; the winners and their reservations.
async fn sell_out(app: &TestApp, sale: &Sale) -> Vec<(String, String)> {
    let mut won = Vec::new();
    for i in 0..10 {
        let user = format!("early-{i}");
        let body = app.reserve_accepted(&sale.sku, &user).await;
        won.push((
            user,
            body["reservation_id"].as_str().expect("id").to_owned(),
        ));
    }
    won
}

/// Another instance returns these reservations' units: this one learns of it
/// only through the restock counts it rechecks.
async fn return_from_another_instance(
    app: &TestApp,
    sale: &Sale,
    reservations: &[(String, String)],
) {
    let other = flashsale::stock::StockStore::new(
        flashsale::stock::RedisConn::connect(&app.settings.redis)
            .await
            .expect("another instance's Redis"),
    );
    for (user, rid) in reservations {
        other
            .refund(&sale.id, rid, user, 1, RefundMode::Return)
            .await
            .expect("refund");
    }
}

/// Hundreds of requests discovering the sell-out at once cost Redis one reading
/// of the buyers (a batched scan in the background), not one full copy each;
/// buyers asking meanwhile still learn their reservation.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_sell_out_is_discovered_once_per_instance() {
    let app = spawn_app().await;
    let sale = app.open_sale(40, 1).await;
    let buyers: Vec<String> = (0..40).map(|i| format!("buyer-{i}")).collect();
    let bought =
        futures::future::join_all(buyers.iter().map(|u| app.reserve(&sale.sku, u, None))).await;
    assert!(bought.iter().all(|r| r.status() == StatusCode::ACCEPTED));
    let before = app.state.stock.sold_out_gate_readings();
    let late: Vec<String> = (0..400).map(|i| format!("late-{i}")).collect();
    let flood =
        futures::future::join_all(late.iter().map(|u| app.reserve(&sale.sku, u, None))).await;
    for resp in flood {
        assert_eq!(resp.status(), StatusCode::CONFLICT);
    }
    app.wait_gate_shut(&sale.id).await;
    assert_eq!(
        app.state.stock.sold_out_gate_readings() - before,
        1,
        "one reading of the buyers for the whole flood"
    );
    // Every buyer is known to the shut gate: each still hears already_reserved.
    for u in &buyers {
        assert!(!app.state.stock.sold_out_from_memory(&sale.id, u), "{u}");
    }
}
