//! One hot SKU split over stock shards (`"stock_shards"`, API version 2): the same
//! counts as one shard, one purchase per user across shards, and units that move
//! between shards without ever being lost or made.

use std::collections::{BTreeMap, HashMap, HashSet};

use flashsale::stock::{home_shard, Keys, RefundMode, RefundOutcome};
use redis::AsyncCommands;
use reqwest::StatusCode;
use serde_json::{json, Value};
use testkit::sale::SaleSpec;

use crate::helpers::{assert_error, eventually, spawn_app, Sale, TestApp, WAIT};

fn spec(stock: u32, per_user_limit: u32, stock_shards: u8) -> SaleSpec {
    SaleSpec {
        per_user_limit,
        stock_shards,
        ..SaleSpec::new(stock)
    }
}

/// Answers by status and code, and the distinct winners.
fn tally(answers: &[(String, StatusCode, Value)]) -> (BTreeMap<String, usize>, HashSet<String>) {
    let mut by_answer = BTreeMap::new();
    let mut winners = HashSet::new();
    for (user, status, body) in answers {
        let key = match status.as_u16() {
            202 => {
                assert!(winners.insert(user.clone()), "{user} won twice");
                "202".to_owned()
            }
            409 => "409".to_owned(),
            s => format!("{s} {}", body["code"]),
        };
        *by_answer.entry(key).or_default() += 1;
    }
    (by_answer, winners)
}

/// Each shard's units left, buyers and pending reservations, read directly.
async fn shards(app: &TestApp, sale: &Sale) -> Vec<(i64, usize, usize)> {
    let mut conn = app.state.stock.connection();
    let mut out = Vec::new();
    for k in Keys::all(&sale.id, sale.shards) {
        let (stock, buyers, pending): (i64, usize, usize) = redis::pipe()
            .get(&k.stock)
            .hlen(&k.buyers)
            .zcard(&k.pending)
            .query_async(&mut conn)
            .await
            .expect("shard read");
        out.push((stock, buyers, pending));
    }
    out
}

/// The seed's two crowds (200 requests for 10 units, 4,000 for 100), each sold
/// once with one shard and once with three: the same answers, exactly as many
/// winners as units, no unit left anywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_shards_sell_exactly_what_one_shard_sells() {
    let app = spawn_app().await;
    for (users, stock) in [(100, 10), (2000, 100)] {
        let mut results = Vec::new();
        for k in [1u8, 3] {
            let sale = app.open_sale_spec(&spec(stock, 1, k)).await;
            let answers = app.crowd(&sale.sku, users, 2, 200).await;
            let (by_answer, winners) = tally(&answers);
            assert_eq!(winners.len(), stock as usize, "K = {k}: {by_answer:?}");
            assert_eq!(app.redis_stock(&sale).await, Some(0), "K = {k}: all sold");
            let parts = shards(&app, &sale).await;
            assert_eq!(parts.len(), usize::from(k));
            let buyers: usize = parts.iter().map(|p| p.1).sum();
            assert_eq!(buyers, stock as usize, "K = {k}: {parts:?}");
            if k > 1 && stock >= 100 {
                assert!(
                    parts.iter().all(|p| p.1 > 0),
                    "every shard sold some units: {parts:?}"
                );
            }
            results.push(by_answer);
        }
        assert_eq!(
            results[0],
            results[1],
            "{} requests for {stock} units: one shard and three answer alike",
            users * 2
        );
    }
}

/// Users clicking five times at once, on three shards: one reservation each, the
/// rest `already_reserved`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_user_never_wins_twice_across_shards() {
    let app = spawn_app().await;
    let sale = app.open_sale_spec(&spec(60, 1, 3)).await;
    let answers = app.crowd(&sale.sku, 40, 5, 200).await;
    let (by_answer, winners) = tally(&answers);
    assert_eq!(winners.len(), 40, "{by_answer:?}");
    assert_eq!(by_answer.get("409"), Some(&160), "{by_answer:?}");
    assert_eq!(app.redis_stock(&sale).await, Some(20));
    // Each winner's reservation lives on their home shard.
    let mut conn = app.state.stock.connection();
    for user in &winners {
        let home = Keys::shard(&sale.id, 3, home_shard(user, 3));
        let held: Option<String> = conn.hget(&home.buyers, user).await.expect("read");
        let rid = held.unwrap_or_else(|| panic!("{user} is not on their home shard"));
        assert_eq!(flashsale::stock::shard_of(&rid), (home.shard, 3));
    }
}

/// Three units dealt one per shard; one user buys all three: their home shard
/// borrows the other two from its siblings.
#[tokio::test]
async fn a_dry_home_shard_borrows_from_its_siblings() {
    let app = spawn_app().await;
    let sale = app.open_sale_spec(&spec(3, 3, 3)).await;
    assert_eq!(
        shards(&app, &sale)
            .await
            .iter()
            .map(|p| p.0)
            .collect::<Vec<_>>(),
        vec![1, 1, 1]
    );
    let resp = app
        .reserve(&sale.sku, "greedy", Some(json!({"quantity": 3})))
        .await;
    assert_eq!(resp.status(), StatusCode::ACCEPTED);
    let parts = shards(&app, &sale).await;
    assert_eq!(parts.iter().map(|p| p.0).sum::<i64>(), 0, "{parts:?}");
    let home = usize::from(home_shard("greedy", 3));
    assert_eq!(
        parts[home].2, 1,
        "the reservation is pending on the home shard"
    );
    assert_error(
        app.reserve(&sale.sku, "late", None).await,
        StatusCode::CONFLICT,
        "sold_out",
    )
    .await;
    let audit = app
        .state
        .stock
        .audit(&sale.id, 3, 3, 0, &[])
        .await
        .expect("audit");
    assert_eq!(audit.in_transit, 0, "every unit lent was received");
    assert_eq!(audit.stock - audit.expected, 0, "no drift: {audit:?}");
}

/// A unit refunded on one shard is bought by a user whose home is another.
#[tokio::test]
async fn a_refund_on_one_shard_is_sold_again() {
    let app = spawn_app().await;
    let sale = app.open_sale_spec(&spec(3, 1, 3)).await;
    let mut won = Vec::new();
    for i in 0.. {
        let user = format!("buyer-{i}");
        let resp = app.reserve(&sale.sku, &user, None).await;
        if resp.status() == StatusCode::ACCEPTED {
            let body: Value = resp.json().await.expect("JSON");
            won.push((
                user,
                body["reservation_id"].as_str().expect("id").to_owned(),
            ));
        } else {
            assert_error(resp, StatusCode::CONFLICT, "sold_out").await;
            break;
        }
    }
    assert_eq!(won.len(), 3);
    let (user, rid) = &won[0];
    let refunded = app
        .state
        .stock
        .refund(&sale.id, rid, user, 1, RefundMode::Return)
        .await
        .expect("refund");
    assert_eq!(refunded, RefundOutcome::Returned { units: 1 });
    let from = home_shard(user, 3);
    let other = (0..)
        .map(|i| format!("other-{i}"))
        .find(|u| home_shard(u, 3) != from)
        .expect("some user lives elsewhere");
    assert_eq!(
        app.reserve(&sale.sku, &other, None).await.status(),
        StatusCode::ACCEPTED,
        "the refunded unit is sold again, across shards"
    );
    assert_error(
        app.reserve(&sale.sku, "too-late", None).await,
        StatusCode::CONFLICT,
        "sold_out",
    )
    .await;
    assert_eq!(app.redis_stock(&sale).await, Some(0));
}

/// A borrower that died between the loan and its receipt leaves a unit in
/// transit: the reconciler receives it on the borrower's shard, once.
#[tokio::test]
async fn the_reconciler_finishes_a_transfer_left_half_done() {
    let app = spawn_app().await;
    let sale = app.open_sale_spec(&spec(3, 1, 3)).await;
    let lender = Keys::shard(&sale.id, 3, 0);
    let borrower = Keys::shard(&sale.id, 3, 2);
    let long_ago = chrono::Utc::now().timestamp_millis() - 60_000;
    let mut conn = app.state.stock.connection();
    let _: () = redis::pipe()
        .decr(&lender.stock, 1)
        .ignore()
        .hset(&lender.lent, "dead-borrower>0", format!("1|2|{long_ago}"))
        .ignore()
        .query_async(&mut conn)
        .await
        .expect("a loan");
    let audit = app
        .state
        .stock
        .audit(&sale.id, 3, 3, 0, &[])
        .await
        .expect("audit");
    assert_eq!(audit.in_transit, 1);
    assert_eq!(audit.stock - audit.expected, 0, "in transit is not drift");

    for expected in [1, 0] {
        let report = app.reconcile(&sale.id).await;
        assert_eq!(report["transfers_finished"], expected, "{report}");
        assert_eq!(report["drift"], 0, "{report}");
    }
    let stock: i64 = conn.get(&borrower.stock).await.expect("read");
    assert_eq!(stock, 2, "the unit landed on the borrower's shard, once");
    assert_eq!(
        app.redis_stock(&sale).await,
        Some(3),
        "no unit lost or made"
    );
}

/// A loan received on its borrower, then the whole sale rebuilt before the loan
/// is marked done on its lender (an instance that stalled between the two
/// steps): closing it afterwards must not write the loan back into the lender's
/// new build, where nobody would ever receive it and its unit would be counted
/// in transit for good (and then repaired out of the stock).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loan_closed_after_a_rebuild_is_not_written_back() {
    let app = TestApp::builder().workers().spawn().await;
    let sale = app.open_sale_spec(&spec(3, 1, 3)).await;
    // Two users of one home shard: the second borrows from a sibling.
    let mut users = (0..).map(|i| format!("neighbour-{i}"));
    let first = users.next().expect("a user");
    let home = home_shard(&first, 3);
    let second = users
        .find(|u| home_shard(u, 3) == home)
        .expect("a neighbour");
    for user in [&first, &second] {
        assert_eq!(
            app.reserve(&sale.sku, user, None).await.status(),
            StatusCode::ACCEPTED
        );
    }
    let loans = app
        .state
        .stock
        .open_loans(&sale.id, 3, chrono::Utc::now().timestamp_millis() + 1_000)
        .await
        .expect("loans");
    assert_eq!(loans.len(), 1, "{loans:?}");
    let loan = &loans[0];
    assert_eq!(loan.to, home);
    assert_eq!(
        app.state
            .stock
            .receive_loan(&sale.id, 3, loan)
            .await
            .expect("receive"),
        Some(false),
        "the borrower received it with the reservation"
    );
    app.wait_for_status(&sale.id, "pending_payment", 2).await;
    app.wait_nothing_pending(&sale).await;
    for step in ["pause", "preload", "resume"] {
        let resp = app.admin_step(&sale.id, step).await;
        assert_eq!(resp.status(), StatusCode::OK, "{step}");
    }
    let marked = app
        .state
        .stock
        .mark_loan_done(&sale.id, 3, loan)
        .await
        .expect("mark");
    assert!(!marked, "a loan of the old build is left alone");
    let lender = Keys::shard(&sale.id, 3, loan.lender);
    let mut conn = app.state.stock.connection();
    let records: std::collections::HashMap<String, String> =
        conn.hgetall(&lender.lent).await.expect("read");
    assert!(records.is_empty(), "nothing written back: {records:?}");
    let audit = app
        .state
        .stock
        .audit(&sale.id, 3, 3, 2, &[])
        .await
        .expect("audit");
    assert_eq!(audit.in_transit, 0, "{audit:?}");
    assert_eq!(audit.stock - audit.expected, 0, "no drift: {audit:?}");
    let report = app.reconcile(&sale.id).await;
    assert_eq!(report["drift"], 0, "{report}");
    assert_eq!(app.redis_stock(&sale).await, Some(1), "3 units, 2 ordered");
}

/// Pausing reaches every shard; a preload deals the units left over the shards
/// again and puts each buyer back on their home shard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_and_preload_cover_every_shard() {
    let app = TestApp::builder().workers().spawn().await;
    let sale = app.open_sale_spec(&spec(6, 1, 3)).await;
    let buyers: Vec<String> = (0..4).map(|i| format!("early-{i}")).collect();
    for b in &buyers {
        assert_eq!(
            app.reserve(&sale.sku, b, None).await.status(),
            StatusCode::ACCEPTED
        );
    }
    app.wait_for_status(&sale.id, "pending_payment", 4).await;
    app.wait_nothing_pending(&sale).await;

    a_pause_reaches_every_shard(&app, &sale).await;
    a_preload_deals_the_units_and_buyers_again(&app, &sale, &buyers).await;

    let resp = app.resume(&sale.id).await;
    assert_eq!(resp.status(), StatusCode::OK);
    for b in &buyers {
        assert_error(
            app.reserve(&sale.sku, b, None).await,
            StatusCode::CONFLICT,
            "already_reserved",
        )
        .await;
    }
    let mut late = Vec::new();
    for i in 0..4 {
        let resp = app.reserve(&sale.sku, &format!("late-{i}"), None).await;
        late.push(resp.status());
    }
    assert_eq!(
        late.iter().filter(|s| **s == StatusCode::ACCEPTED).count(),
        2,
        "{late:?}"
    );
}

/// Paused: every request refused, every shard's state says so.
async fn a_pause_reaches_every_shard(app: &TestApp, sale: &Sale) {
    let resp = app.pause(&sale.id).await;
    assert_eq!(resp.status(), StatusCode::OK);
    for i in 0..6 {
        assert_error(
            app.reserve(&sale.sku, &format!("paused-{i}"), None).await,
            StatusCode::SERVICE_UNAVAILABLE,
            "paused",
        )
        .await;
    }
    let mut conn = app.state.stock.connection();
    for k in Keys::all(&sale.id, 3) {
        let state: Option<String> = conn.get(&k.state).await.expect("read");
        assert_eq!(state.as_deref(), Some("paused"), "shard {}", k.shard);
    }
}

/// The 2 units left are dealt over the shards again, and each buyer is back
/// on their home shard.
async fn a_preload_deals_the_units_and_buyers_again(app: &TestApp, sale: &Sale, buyers: &[String]) {
    let resp = app.preload(&sale.id).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let body: Value = resp.json().await.expect("JSON");
    assert_eq!(body["stock"], 2);
    let parts = shards(app, sale).await;
    assert_eq!(
        parts.iter().map(|p| p.0).collect::<Vec<_>>(),
        vec![1, 1, 0],
        "the 2 units left are dealt again"
    );
    let mut conn = app.state.stock.connection();
    for b in buyers {
        let home = Keys::shard(&sale.id, 3, home_shard(b, 3));
        let held: bool = conn.hexists(&home.buyers, b).await.expect("read");
        assert!(held, "{b} is back on their home shard");
    }
}

/// One shard's keys lost (its primary came back empty) while the others still
/// hold the sale: the whole activity is rebuilt, and nothing is sold twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_shard_rebuilds_the_whole_sale() {
    let app = TestApp::builder().workers().spawn().await;
    let sale = app.open_sale_spec(&spec(6, 1, 3)).await;
    for i in 0..3 {
        assert_eq!(
            app.reserve(&sale.sku, &format!("before-{i}"), None)
                .await
                .status(),
            StatusCode::ACCEPTED
        );
    }
    app.wait_for_status(&sale.id, "pending_payment", 3).await;
    let lost = Keys::shard(&sale.id, 3, 1);
    let mut conn = app.state.stock.connection();
    let _: () = redis::pipe()
        .del(&lost.stock)
        .ignore()
        .del(&lost.state)
        .ignore()
        .del(&lost.buyers)
        .ignore()
        .query_async(&mut conn)
        .await
        .expect("a shard lost");

    eventually(WAIT, "the rebuild", || async {
        let resp = app.admin_step(&sale.id, "reconcile").await;
        let report: Value = resp.json().await.ok()?;
        let s = app.state.stock.snapshot(&sale.id, 3).await.ok()?;
        (s.loaded() && s.state.as_deref() == Some("open") && report["loaded"] == true).then_some(())
    })
    .await;
    assert_eq!(app.redis_stock(&sale).await, Some(3), "6 units, 3 ordered");
    for i in 0..3 {
        assert_error(
            app.reserve(&sale.sku, &format!("before-{i}"), None).await,
            StatusCode::CONFLICT,
            "already_reserved",
        )
        .await;
    }
}

#[tokio::test]
async fn stock_shards_out_of_range_are_refused() {
    let app = spawn_app().await;
    let now = chrono::Utc::now();
    for shards in [json!(0), json!(65), json!("3"), json!(-1)] {
        let resp = app
            .create_activity(json!({
                "sku": testkit::unique("sku-"),
                "stock": 10,
                "starts_at": now,
                "ends_at": now + chrono::Duration::hours(1),
                "stock_shards": shards,
            }))
            .await;
        assert_error(resp, StatusCode::UNPROCESSABLE_ENTITY, "invalid_request").await;
    }
    let resp = app
        .create_activity(json!({
            "sku": testkit::unique("sku-"),
            "stock": 10,
            "starts_at": now,
            "ends_at": now + chrono::Duration::hours(1),
            "stock_shards": 64,
        }))
        .await;
    assert_eq!(resp.status(), StatusCode::CREATED);
    let body: Value = resp.json().await.expect("JSON");
    assert_eq!(body["stock_shards"], 64);
}

/// A split sale sold out is gated on every shard's buyers' filter: each buyer
/// (on their home shard) still reaches Redis and hears `already_reserved`,
/// users every filter rules out cost Redis no command. After a rebuild from
/// MySQL (pause, preload, resume) the filters are written anew from the orders
/// and the gate, shut again, still knows every buyer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_split_sale_is_gated_by_every_shards_filter() {
    let app = TestApp::builder().workers().spawn().await;
    let sale = app.open_sale_spec(&spec(60, 1, 3)).await;
    let mut reservations = HashMap::new();
    for (user, status, body) in app.crowd(&sale.sku, 60, 1, 16).await {
        assert_eq!(status, StatusCode::ACCEPTED, "{user}: {body}");
        reservations.insert(user, body["reservation_id"].clone());
    }
    app.wait_for_status(&sale.id, "pending_payment", 60).await;
    app.wait_nothing_pending(&sale).await;
    gated_on_filters(&app, &sale, &reservations).await;
    for step in ["pause", "preload", "resume"] {
        let resp = app.admin_step(&sale.id, step).await;
        assert_eq!(resp.status(), StatusCode::OK, "{step}");
    }
    assert!(
        !app.state.stock.sold_out_from_memory(&sale.id, "other-0"),
        "a rebuild reopens the gate"
    );
    gated_on_filters(&app, &sale, &reservations).await;
}

async fn gated_on_filters(app: &TestApp, sale: &Sale, reservations: &HashMap<String, Value>) {
    assert_error(
        app.reserve(&sale.sku, &testkit::unique("refused-"), None)
            .await,
        StatusCode::CONFLICT,
        "sold_out",
    )
    .await;
    app.wait_gate_shut(&sale.id).await;
    for (user, rid) in reservations {
        assert!(
            !app.state.stock.sold_out_from_memory(&sale.id, user),
            "{user}"
        );
        let body = assert_error(
            app.reserve(&sale.sku, user, None).await,
            StatusCode::CONFLICT,
            "already_reserved",
        )
        .await;
        assert_eq!(&body["reservation_id"], rid, "{user}");
    }
    let ruled_out: Vec<String> = (0..200)
        .map(|i| format!("other-{i}"))
        .filter(|u| app.state.stock.sold_out_from_memory(&sale.id, u))
        .collect();
    assert!(ruled_out.len() >= 195, "{} ruled out", ruled_out.len());
    let watch = app.watch_redis(sale).await;
    for u in &ruled_out {
        assert_error(
            app.reserve(&sale.sku, u, None).await,
            StatusCode::CONFLICT,
            "sold_out",
        )
        .await;
    }
    let commands: Vec<String> = app
        .watched(sale, watch)
        .await
        .into_iter()
        .filter(|l| !(l.contains("\"GET\"") && l.contains(":restock\"")))
        .collect();
    assert!(commands.is_empty(), "{commands:?}");
}
