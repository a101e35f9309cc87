//! The sold-out gate: once a sale is sold out, an instance answers `sold_out` from
//! memory, and units that come back are sold again within its recheck bound.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use flashsale::stock::RefundMode;
use futures::StreamExt;
use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::helpers::{assert_error, eventually, spawn_app, Flood, Sale, TestApp, WAIT};

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
    // The gate shuts once this instance has read the buyers' filter, in the
    // background.
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
/// of the buyers' filter (in the background), not one each; buyers asking
/// meanwhile still learn their reservation.
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

/// Sends `users`' reserve requests, 32 at a time; (user, status, body) each.
async fn ask(app: &TestApp, sku: &str, users: &[String]) -> Vec<(String, StatusCode, Value)> {
    futures::stream::iter(users)
        .map(|u| async move {
            let resp = app.reserve(sku, u, None).await;
            let status = resp.status();
            let body: Value = resp.json().await.expect("a JSON answer");
            (u.clone(), status, body)
        })
        .buffer_unordered(32)
        .collect()
        .await
}

/// The commands Redis ran for the sale besides the gate's own recheck of the
/// restock counts (`GET …:restock`, every `SOLD_OUT_RECHECK`, not per request).
fn requests_commands(lines: Vec<String>) -> Vec<String> {
    lines
        .into_iter()
        .filter(|l| !(l.contains("\"GET\"") && l.contains(":restock\"")))
        .collect()
}

/// A sale sold out to more buyers than the filter's first layer holds: the gate
/// shuts on the buyers' filter (a few kilobytes, not the buyers), every buyer
/// asking again still reaches Redis and hears `already_reserved` with their
/// reservation, users the filter rules out are answered without a single Redis
/// command naming the sale, and a top-up reopens it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sale_with_many_buyers_is_gated_by_their_filter() {
    let app = spawn_app().await;
    let units = 1_500;
    let sale = app.open_sale(units, 1).await;
    let won = app.crowd(&sale.sku, units as usize, 1, 32).await;
    let mut reservations = HashMap::new();
    for (user, status, body) in won {
        assert_eq!(status, StatusCode::ACCEPTED, "{user}: {body}");
        reservations.insert(user, body["reservation_id"].clone());
    }
    assert_error(
        app.reserve(&sale.sku, "first-refused", None).await,
        StatusCode::CONFLICT,
        "sold_out",
    )
    .await;
    app.wait_gate_shut(&sale.id).await;
    // A 5-byte header, 1,024 buyers in layer 0 and the rest in layer 1, 16 bits
    // each: the filter's size follows the units, however many users ask.
    let bytes = app.state.stock.sold_out_gate_bytes();
    assert!(bytes <= 5 + 3 * 1024 * 16 / 8, "{bytes} bytes");

    let others: Vec<String> = (0..3_000).map(|i| format!("other-{i}")).collect();
    let (ruled_out, maybe): (Vec<String>, Vec<String>) = others
        .into_iter()
        .partition(|u| app.state.stock.sold_out_from_memory(&sale.id, u));
    assert!(
        maybe.len() <= 30,
        "{} of 3,000 non-buyers not ruled out",
        maybe.len()
    );
    for u in reservations.keys() {
        assert!(!app.state.stock.sold_out_from_memory(&sale.id, u), "{u}");
    }

    let watch = app.watch_redis(&sale).await;
    for (user, status, body) in ask(&app, &sale.sku, &ruled_out).await {
        assert_eq!(status, StatusCode::CONFLICT, "{user}: {body}");
        assert_eq!(body["code"], "sold_out", "{user}");
    }
    let commands = requests_commands(app.watched(&sale, watch).await);
    assert!(
        commands.is_empty(),
        "{} ruled-out non-buyers cost Redis {} commands: {:?}",
        ruled_out.len(),
        commands.len(),
        &commands[..commands.len().min(5)]
    );

    // Every buyer, clicking again, goes to Redis and learns their reservation.
    let buyers: Vec<String> = reservations.keys().cloned().collect();
    for (user, status, body) in ask(&app, &sale.sku, &buyers).await {
        assert_eq!(status, StatusCode::CONFLICT, "{user}: {body}");
        assert_eq!(body["code"], "already_reserved", "{user}");
        assert_eq!(body["reservation_id"], reservations[&user], "{user}");
    }
    // The few the filter could not rule out are answered by Redis, exactly.
    for (user, status, body) in ask(&app, &sale.sku, &maybe).await {
        assert_eq!(status, StatusCode::CONFLICT, "{user}: {body}");
        assert_eq!(body["code"], "sold_out", "{user}");
    }

    // A top-up reopens the sale: a new user buys, a buyer is still a buyer.
    let resp = app.top_up(&sale.id, json!({"add": 1})).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let after = ruled_out.first().expect("a ruled-out user");
    eventually(WAIT, "the top-up's unit sold", || async {
        (app.reserve(&sale.sku, after, None).await.status() == StatusCode::ACCEPTED).then_some(())
    })
    .await;
    let buyer = buyers.first().expect("a buyer");
    let body = assert_error(
        app.reserve(&sale.sku, buyer, None).await,
        StatusCode::CONFLICT,
        "already_reserved",
    )
    .await;
    assert_eq!(body["reservation_id"], reservations[buyer]);
}

/// A buyer Redis did not know, adopted from MySQL's order by the consumer's
/// confirmation (`confirm.lua`), is added to the filter and bumps the restock
/// count: a shut gate reopens, reads the filter again, and never tells the
/// adopted buyer `sold_out`.
#[tokio::test]
async fn an_adopted_buyer_is_never_refused_from_memory() {
    let app = spawn_app().await;
    let sale = app.open_sale(2, 1).await;
    for u in ["w0", "w1"] {
        app.reserve_accepted(&sale.sku, u).await;
    }
    assert_error(
        app.reserve(&sale.sku, "refused", None).await,
        StatusCode::CONFLICT,
        "sold_out",
    )
    .await;
    app.wait_gate_shut(&sale.id).await;
    let adopted = (0..)
        .map(|i| format!("adopted-{i}"))
        .find(|u| app.state.stock.sold_out_from_memory(&sale.id, u))
        .expect("a user the filter rules out");
    let rid = flashsale::stock::new_reservation_id(&adopted, 1);
    let n = app
        .state
        .stock
        .confirm(&sale.id, &[(rid.clone(), adopted.clone(), 1)])
        .await
        .expect("confirm");
    assert_eq!(n, 1, "adopted");
    eventually(Duration::from_secs(5), "the gate reopened", || async {
        (!app.state.stock.sold_out_from_memory(&sale.id, &adopted)).then_some(())
    })
    .await;
    let body = assert_error(
        app.reserve(&sale.sku, &adopted, None).await,
        StatusCode::CONFLICT,
        "already_reserved",
    )
    .await;
    assert_eq!(body["reservation_id"], rid.as_str());
    // Shut again, on a filter that holds the adopted buyer.
    assert_error(
        app.reserve(&sale.sku, "refused-again", None).await,
        StatusCode::CONFLICT,
        "sold_out",
    )
    .await;
    app.wait_gate_shut(&sale.id).await;
    assert!(!app.state.stock.sold_out_from_memory(&sale.id, &adopted));
}

/// A sale loaded without a filter (by a version that kept none), or whose
/// filter lost its header, is never gated: its buyers could not be told apart.
/// Its filter is read once (its header only), not again on every sold-out
/// answer, until a restock count moves.
#[tokio::test]
async fn a_sale_without_a_complete_filter_is_not_gated() {
    ungated_after(|keys| redis::pipe().cmd("DEL").arg(&keys.filter).ignore().clone()).await;
}

/// A filter recreated by a buyer's bits after its key was lost (evicted, say)
/// has no header: not trusted, and read once.
#[tokio::test]
async fn a_filter_recreated_without_its_header_is_not_trusted() {
    ungated_after(|keys| {
        redis::pipe()
            .cmd("DEL")
            .arg(&keys.filter)
            .ignore()
            .cmd("BITFIELD")
            .arg(&keys.filter)
            .arg(&["SET", "u1", "100", "1"])
            .ignore()
            .clone()
    })
    .await;
}

/// A buyer recorded by code that sets no bits (an older version still serving
/// during a rolling deploy) makes the filter's count of buyers differ from the
/// buyers: the gate does not trust it, and that buyer hears `already_reserved`.
#[tokio::test]
async fn a_buyer_recorded_without_its_bits_keeps_the_gate_open() {
    let (app, sale_id, sku) = ungated_after(|keys| {
        redis::pipe()
            .cmd("HSET")
            .arg(&keys.buyers)
            .arg("ghost")
            .arg("ghost-reservation")
            .ignore()
            .clone()
    })
    .await;
    assert!(!app.state.stock.sold_out_from_memory(&sale_id, "ghost"));
    let body = assert_error(
        app.reserve(&sku, "ghost", None).await,
        StatusCode::CONFLICT,
        "already_reserved",
    )
    .await;
    assert_eq!(body["reservation_id"], "ghost-reservation");
}

/// A buyer removed by `lower.lua` lowers the filter's count with it: the
/// filter still counts exactly the buyers, and the gate shuts.
#[tokio::test]
async fn a_buyer_removed_keeps_the_filter_trusted() {
    let app = spawn_app().await;
    let sale = app.open_sale(2, 1).await;
    app.reserve_accepted(&sale.sku, "w0").await;
    let body = app.reserve_accepted(&sale.sku, "w1").await;
    let rid = body["reservation_id"].as_str().expect("a reservation id");
    let lowered = app
        .state
        .stock
        .lower(&sale.id, rid, "w1", 0, &[])
        .await
        .expect("lower");
    assert_eq!(lowered, Some(0));
    assert_error(
        app.reserve(&sale.sku, "refused", None).await,
        StatusCode::CONFLICT,
        "sold_out",
    )
    .await;
    app.wait_gate_shut(&sale.id).await;
}

/// Sells out a one-unit sale, spoils its filter or buyers with `spoil`, and
/// checks that sold-out answers come from Redis, the filter read once. Returns
/// the app, the sale's id and its sku.
async fn ungated_after(
    spoil: impl FnOnce(&flashsale::stock::Keys) -> redis::Pipeline,
) -> (TestApp, String, String) {
    let app = spawn_app().await;
    let sale = app.open_sale(1, 1).await;
    app.reserve_accepted(&sale.sku, "w0").await;
    let keys = flashsale::stock::Keys::new(&sale.id);
    let mut conn = app.state.stock.connection();
    let _: () = spoil(&keys)
        .query_async(&mut conn)
        .await
        .expect("spoiling the filter");
    let begun = app.state.stock.sold_out_gate_readings_begun();
    let before = app.state.stock.sold_out_gate_readings();
    assert_error(
        app.reserve(&sale.sku, "late-0", None).await,
        StatusCode::CONFLICT,
        "sold_out",
    )
    .await;
    eventually(
        Duration::from_secs(5),
        "a reading of the filter",
        || async { (app.state.stock.sold_out_gate_readings() > before).then_some(()) },
    )
    .await;
    // The reading found no filter to trust: the gate stays open, every answer
    // from Redis, and the filter is not read again at the same restock count.
    for i in 1..50 {
        assert_error(
            app.reserve(&sale.sku, &format!("late-{i}"), None).await,
            StatusCode::CONFLICT,
            "sold_out",
        )
        .await;
    }
    assert!(!app.state.stock.sold_out_from_memory(&sale.id, "anyone"));
    assert_eq!(
        app.state.stock.sold_out_gate_readings_begun() - begun,
        1,
        "one reading of the filter"
    );
    let body = assert_error(
        app.reserve(&sale.sku, "w0", None).await,
        StatusCode::CONFLICT,
        "already_reserved",
    )
    .await;
    assert!(body["reservation_id"].is_string());
    (app, sale.id, sale.sku)
}
