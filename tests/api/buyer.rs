//! The buyer's page (`GET /buy/{sku}`) in real headless browsers, one per
//! user: whole sales as buyers live them (the countdown, the waiting room, a
//! pause, a lost answer, sold out, paying), each outcome checked on the page
//! and in the service.

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::Duration;

use reqwest::StatusCode;
use testkit::browser::Browser;

use crate::helpers::{assert_error, eventually, SaleSpec, TestApp};

/// How long a page may take to show what the service decided (its polling
/// pace is a second or two; the consumer writes the order meanwhile).
const WAIT: Duration = Duration::from_secs(40);

/// One user and their own browser on the sale's page.
struct Buyer {
    user: String,
    browser: Browser,
}

impl Buyer {
    /// Opens `/buy/{sku}#token=…` as `user`; the page signs in with the token
    /// and takes it out of the address bar.
    async fn open(app: &TestApp, sku: &str, user: &str, browser: Browser) -> Buyer {
        let url = app.url(&format!("/buy/{sku}#token={}", app.token(user)));
        browser.goto(&url).await.expect("the page loads");
        browser
            .wait_text("#who", WAIT, |t| t == format!("signed in as {user}"))
            .await
            .expect("signed in with the token from the address");
        let shown = browser.url().await.expect("the address");
        assert!(!shown.contains("token"), "the token stays in {shown}");
        Buyer {
            user: user.to_owned(),
            browser,
        }
    }

    async fn text(&self, css: &str) -> String {
        self.browser.text(css).await.expect("the element's text")
    }

    async fn phase(&self) -> String {
        self.text("#phase").await
    }

    /// Waits until the page shows this phase of the purchase.
    async fn wait_phase(&self, want: &str) {
        let user = &self.user;
        self.browser
            .wait_text("#phase", WAIT, |t| t == want)
            .await
            .unwrap_or_else(|e| panic!("{user}'s page never reads {want}: {e}"));
    }

    /// Waits until the page shows an error whose text contains `want`.
    async fn wait_notice(&self, want: &str) {
        let user = &self.user;
        self.browser
            .wait_text("#notice", WAIT, |t| t.contains(want))
            .await
            .unwrap_or_else(|e| panic!("{user}'s page never shows {want:?}: {e}"));
    }

    /// Presses Buy once it is offered.
    async fn buy(&self) {
        self.browser
            .click_when_enabled("#buy", WAIT)
            .await
            .expect("Buy is offered");
    }

    /// From the order to `paid`: presses Pay once it is offered.
    async fn pay(&self) {
        self.wait_phase("ordered").await;
        self.browser
            .click_when_enabled("#pay", WAIT)
            .await
            .expect("Pay is offered");
        self.wait_phase("paid").await;
    }
}

/// Browsers for `users`, started before the sale so the countdown is seen.
async fn browsers(dir: &tempfile::TempDir, users: &[&str]) -> Vec<Browser> {
    Browser::start_each(dir.path(), users)
        .await
        .expect("headless browsers")
}

/// Where the screenshots go (not committed): `target/tmp/`.
fn screenshot_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name)
}

/// The orders of the activity in MySQL: (user, order id, reservation id, status).
async fn orders(app: &TestApp, activity_id: &str) -> Vec<(String, u64, String, String)> {
    sqlx::query_as(
        "SELECT CAST(user_id AS CHAR), id, reservation_id, CAST(status AS CHAR) FROM orders \
         WHERE activity_id = ? ORDER BY user_id",
    )
    .bind(activity_id)
    .fetch_all(&app.state.pool)
    .await
    .expect("orders")
}

/// Each buyer's page names the order and reservation MySQL holds for them, paid.
async fn pages_match_the_orders(app: &TestApp, activity_id: &str, winners: &[&Buyer]) {
    let rows = orders(app, activity_id).await;
    let users: HashSet<&str> = rows.iter().map(|r| r.0.as_str()).collect();
    let expected: HashSet<&str> = winners.iter().map(|b| b.user.as_str()).collect();
    assert_eq!(users, expected, "the orders' owners: {rows:?}");
    for (user, order_id, reservation_id, status) in &rows {
        assert_eq!(status, "paid", "{user}'s order");
        let page = winners
            .iter()
            .find(|b| &b.user == user)
            .expect("a page per order");
        assert_eq!(page.text("#order-id").await, order_id.to_string(), "{user}");
        assert_eq!(
            page.text("#reservation-id").await,
            *reservation_id,
            "{user}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_buyers_wait_in_line_for_two_units_two_pay_and_one_is_told_sold_out() {
    let app = TestApp::builder().workers().turn_secs(120).spawn().await;
    let dir = tempfile::tempdir().expect("a temporary folder");
    let users = ["ada", "bo", "cy"];
    let started = browsers(&dir, &users).await;
    let sale = app
        .open_sale_spec(&SaleSpec {
            starts_in_secs: 15,
            waiting_room: true,
            payment_timeout_secs: 3600,
            ..SaleSpec::new(2)
        })
        .await;
    let mut buyers = Vec::new();
    for (user, browser) in users.iter().zip(started) {
        buyers.push(Buyer::open(&app, &sale.sku, user, browser).await);
    }

    // Before the start: each page joined the room by itself and counts down.
    for b in &buyers {
        b.wait_phase("waiting").await;
        assert_eq!(b.text("#countdown-label").await, "Starts in", "{}", b.user);
        assert_eq!(b.text("#admission").await, "waiting room");
        assert_eq!(b.text("#place").await, "in the room, not drawn yet");
        assert!(!b.browser.enabled("#buy").await.expect("Buy"), "no Buy yet");
    }
    let room = &app.activity_figures(&sale.id).await["live"]["waiting_room"];
    assert_eq!(room["joined"], 3, "{room}");

    // The draw at the start: two admitted (two units), one first in line.
    let (admitted, waiting) = eventually(WAIT, "two admitted, one first in line", || async {
        let (mut admitted, mut waiting) = (Vec::new(), Vec::new());
        for b in &buyers {
            match b.phase().await.as_str() {
                "admitted" => admitted.push(b),
                "waiting" if b.text("#place").await == "number 1 (0 ahead of you)" => {
                    waiting.push(b)
                }
                _ => return None,
            }
        }
        (admitted.len() == 2 && waiting.len() == 1).then(|| (admitted, waiting[0]))
    })
    .await;
    assert_eq!(waiting.text("#headline").await, "You are number 1 in line");
    assert!(!waiting.browser.enabled("#buy").await.expect("Buy"));
    waiting
        .browser
        .save_screenshot(&screenshot_path("buyer-waiting-room.png"))
        .await
        .expect("a screenshot of a place in line");

    // The admitted two reserve and pay, each from their page.
    for b in &admitted {
        assert!(b.text("#place").await.starts_with("your turn"));
        b.buy().await;
    }
    for b in &admitted {
        b.pay().await;
    }
    // Nothing can come back now: the one in line is told at once.
    waiting.wait_phase("sold_out").await;
    assert_eq!(waiting.text("#headline").await, "Sold out");
    assert!(!waiting.browser.enabled("#buy").await.expect("Buy"));

    // The service agrees: two paid orders, the pages' own; nothing for the third.
    pages_match_the_orders(&app, &sale.id, &admitted).await;
    assert_error(
        app.reservation(&sale.sku, &waiting.user).await,
        StatusCode::NOT_FOUND,
        "not_found",
    )
    .await;
    let place: serde_json::Value = app
        .queue_place(&sale.sku, &waiting.user)
        .await
        .json()
        .await
        .expect("JSON");
    assert_eq!(place["state"], "sold_out");
    let status = app.sale_state(&sale.sku).await;
    assert_eq!(status["stock_left"], 0, "{status}");
    assert_eq!(status["state"], "sold_out", "{status}");
    // What the page counted down by and joined on.
    assert_eq!(status["admission"], "waiting_room", "{status}");
    let time = |field: &str| {
        status[field]
            .as_str()
            .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
            .unwrap_or_else(|| panic!("{field} is a time in {status}"))
    };
    assert_eq!(
        time("starts_at") - time("queue_opens_at"),
        chrono::Duration::seconds(600)
    );
    let skew = time("server_time").signed_duration_since(chrono::Utc::now());
    assert!(skew.num_seconds().abs() < 5, "server_time is now: {status}");
    drop(buyers);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_buyers_race_for_two_units_through_a_pause_and_a_lost_answer() {
    let app = TestApp::builder().workers().spawn().await;
    let dir = tempfile::tempdir().expect("a temporary folder");
    let users = ["ann", "ben", "cat"];
    let started = browsers(&dir, &users).await;
    let sale = app
        .open_sale_spec(&SaleSpec {
            starts_in_secs: 12,
            payment_timeout_secs: 3600,
            price: Some((1999, "usd".into())),
            ..SaleSpec::new(2)
        })
        .await;
    let mut buyers = Vec::new();
    for (user, browser) in users.iter().zip(started) {
        buyers.push(Buyer::open(&app, &sale.sku, user, browser).await);
    }
    let [ann, ben, cat] = &buyers[..] else {
        unreachable!("three buyers")
    };

    // Before the start the pages count down and offer no Buy; at the start
    // (by the service's clock) they do.
    for b in &buyers {
        b.wait_phase("waiting_start").await;
        assert_eq!(b.text("#countdown-label").await, "Starts in");
        assert_eq!(b.text("#admission").await, "first come");
        assert_eq!(b.text("#price").await, "$19.99");
        assert!(!b.browser.enabled("#buy").await.expect("Buy"));
    }
    for b in &buyers {
        b.wait_phase("ready").await;
        assert_eq!(b.text("#countdown-label").await, "Ends in");
    }

    // Cat's first press reached the service but its answer was lost: the
    // service holds her reservation. Her page presses again and gets
    // `409 already_reserved` with the same id, which is her reservation.
    let first = app.reserve_accepted(&sale.sku, &cat.user).await;
    cat.buy().await;
    cat.wait_phase("ordered").await;
    assert_eq!(
        cat.text("#reservation-id").await,
        first["reservation_id"].as_str().expect("an id")
    );
    assert!(cat.text("#log").await.contains("409 already_reserved"));

    // Paused: `503 paused` with Retry-After. The pages show the message and
    // try again at that pace, holding nothing meanwhile.
    assert_eq!(app.pause(&sale.id).await.status(), StatusCode::OK);
    ann.buy().await;
    ben.buy().await;
    for b in [ann, ben] {
        b.wait_notice("the sale is paused (503 paused)").await;
        assert_eq!(b.phase().await, "reserving");
    }
    assert_eq!(app.sale_state(&sale.sku).await["stock_left"], 1);
    assert_eq!(app.resume(&sale.id).await.status(), StatusCode::OK);

    // Resumed: without another press, one page gets the last unit and the
    // other is told it is sold out.
    let (winner, loser) = eventually(WAIT, "one ordered, one sold out", || async {
        match (ann.phase().await.as_str(), ben.phase().await.as_str()) {
            ("ordered", "sold_out") => Some((ann, ben)),
            ("sold_out", "ordered") => Some((ben, ann)),
            _ => None,
        }
    })
    .await;
    loser.wait_notice("sold out (409 sold_out)").await;
    winner
        .browser
        .save_screenshot(&screenshot_path("buyer-ordered.png"))
        .await
        .expect("a screenshot of an order awaiting payment");
    winner.pay().await;
    cat.pay().await;

    // The service agrees: two paid orders, the pages' own; none for the loser.
    pages_match_the_orders(&app, &sale.id, &[cat, winner]).await;
    assert_error(
        app.reservation(&sale.sku, &loser.user).await,
        StatusCode::NOT_FOUND,
        "not_found",
    )
    .await;
    let status = app.sale_state(&sale.sku).await;
    assert_eq!(status["stock_left"], 0, "{status}");
    assert_eq!(status["admission"], "open", "{status}");
    assert!(status.get("queue_opens_at").is_none(), "{status}");

    // Every error answer is shown with its message: an unknown SKU, a token
    // the service refuses.
    loser
        .browser
        .goto(&app.url("/buy/no-such-sku"))
        .await
        .expect("page");
    loser.wait_phase("no_sale").await;
    loser
        .wait_notice("no sale for this sku (404 not_found)")
        .await;
    loser
        .browser
        .goto(&app.url(&format!("/buy/{}#token=not-a-token", sale.sku)))
        .await
        .expect("page");
    loser.wait_phase("signed_out").await;
    loser.wait_notice("(401 unauthorized)").await;
    drop(buyers);
}
