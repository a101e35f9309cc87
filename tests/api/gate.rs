//! The sold-out gate: once a sale is sold out, an instance answers `sold_out` from
//! memory, and units that come back are sold again within its recheck bound.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use flashsale::stock::RefundMode;
use reqwest::StatusCode;
use serde_json::Value;

use crate::helpers::{assert_error, eventually, spawn_app};

/// Waits until this instance's sold-out gate is shut for the activity (it
/// shuts once the buyers are read, in the background).
async fn gate_shut(app: &crate::helpers::TestApp, activity_id: &str) {
    eventually(Duration::from_secs(5), "the gate shut", || async {
        app.state
            .stock
            .sold_out_from_memory(activity_id, "probe")
            .then_some(())
    })
    .await;
}

#[tokio::test]
async fn a_sold_out_sale_is_answered_from_memory() {
    let app = spawn_app().await;
    let sale = app.open_sale(3, 1).await;
    let mut winner = None;
    for i in 0..3 {
        let resp = app.reserve(&sale.sku, &format!("w{i}"), None).await;
        assert_eq!(resp.status(), StatusCode::ACCEPTED);
        let body: Value = resp.json().await.expect("JSON");
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
    gate_shut(&app, &sale.id).await;
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
    let mut won = Vec::new();
    for i in 0..10 {
        let user = format!("early-{i}");
        let resp = app.reserve(&sale.sku, &user, None).await;
        assert_eq!(resp.status(), StatusCode::ACCEPTED);
        let body: Value = resp.json().await.expect("JSON");
        won.push((
            user,
            body["reservation_id"].as_str().expect("id").to_owned(),
        ));
    }
    let stop = Arc::new(AtomicBool::new(false));
    let next = Arc::new(AtomicUsize::new(0));
    let accepted = Arc::new(AtomicUsize::new(0));
    let refused = Arc::new(AtomicUsize::new(0));
    let mut flood = Vec::new();
    for _ in 0..8 {
        let (stop, next, accepted, refused) = (
            stop.clone(),
            next.clone(),
            accepted.clone(),
            refused.clone(),
        );
        let (client, url, auth) = (
            app.client.clone(),
            app.url(&format!("/flash/{}/reserve", sale.sku)),
            app.state.auth.clone(),
        );
        flood.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let user = format!("flood-{}", next.fetch_add(1, Ordering::Relaxed));
                let token = auth.issue(&user, 600).expect("token");
                let resp = client.post(&url).bearer_auth(token).send().await;
                match resp.map(|r| r.status()) {
                    Ok(StatusCode::ACCEPTED) => accepted.fetch_add(1, Ordering::Relaxed),
                    Ok(StatusCode::CONFLICT) => refused.fetch_add(1, Ordering::Relaxed),
                    other => panic!("unexpected answer {other:?}"),
                };
            }
        }));
    }
    eventually(Duration::from_secs(10), "the flood refused", || async {
        (refused.load(Ordering::Relaxed) > 200).then_some(())
    })
    .await;
    gate_shut(&app, &sale.id).await;
    // Another instance returns them: this one learns of it only through the
    // restock counts it rechecks.
    let other = flashsale::stock::StockStore::new(
        flashsale::stock::RedisConn::connect(&app.settings.redis)
            .await
            .expect("another instance's Redis"),
    );
    let returned_at = Instant::now();
    for (user, rid) in &won[..4] {
        other
            .refund(&sale.id, rid, user, 1, RefundMode::Return)
            .await
            .expect("refund");
    }
    eventually(Duration::from_secs(10), "four units sold again", || async {
        (accepted.load(Ordering::Relaxed) >= 4).then_some(())
    })
    .await;
    let reopened = returned_at.elapsed();
    // Keep flooding a little: no fifth unit appears.
    let refused_then = refused.load(Ordering::Relaxed);
    eventually(Duration::from_secs(10), "more refusals", || async {
        (refused.load(Ordering::Relaxed) > refused_then + 200).then_some(())
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    for f in flood {
        f.await.expect("flood task");
    }
    println!("units returned during a flood were sold again after {reopened:?}");
    assert_eq!(
        accepted.load(Ordering::Relaxed),
        4,
        "exactly the units returned"
    );
    assert!(
        reopened < Duration::from_secs(2),
        "sold again after {reopened:?}; the gate rechecks every {:?}",
        flashsale::stock::SOLD_OUT_RECHECK
    );
    assert_eq!(app.redis_stock(&sale).await, Some(0));
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
    gate_shut(&app, &sale.id).await;
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
