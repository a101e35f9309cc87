//! The operators' page (`GET /admin/ui`) in a real headless browser: enter the
//! token, watch a sale's figures move as reservations arrive, pause it from the
//! page and see reservations refused.

use std::time::Duration;

use reqwest::StatusCode;
use testkit::browser::Browser;

use crate::helpers::{assert_error, spawn_app, Sale, TestApp};

const WAIT: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_watches_and_pauses_a_sale_in_the_browser() {
    let app = spawn_app().await;
    let sale = app.open_sale(20, 1).await;

    // The page itself needs no token and holds no data.
    let page = app.send(app.api.admin_ui()).await;
    assert_eq!(page.status(), StatusCode::OK);
    assert!(page
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/html")));
    assert!(!page.text().await.expect("text").contains(&sale.id));

    let dir = tempfile::tempdir().expect("a temporary folder");
    let browser = Browser::start(dir.path())
        .await
        .expect("a headless browser");
    an_operator_opens_the_sale(&browser, &app, &sale).await;

    // Reservations arrive; the page follows.
    for i in 0..3 {
        assert_eq!(
            app.reserve(&sale.sku, &format!("buyer-{i}"), None)
                .await
                .status(),
            StatusCode::ACCEPTED
        );
    }
    browser
        .wait_text("#redis-stock", WAIT, |t| t == "17")
        .await
        .expect("17 units left after three reservations");
    browser
        .wait_text("#pending", WAIT, |t| t != "–")
        .await
        .expect("pending reservations shown");

    pause_from_the_page(&browser).await;
    assert_error(
        app.reserve(&sale.sku, "after-pause", None).await,
        StatusCode::SERVICE_UNAVAILABLE,
        "paused",
    )
    .await;

    let png = browser.screenshot().await.expect("a screenshot");
    assert!(png.starts_with(b"\x89PNG"), "a PNG");
    let out = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("admin-ui.png");
    std::fs::write(&out, png).expect("screenshot written");
    drop(browser);
}

/// The token entered, the page connected, the sale chosen with its 20 units.
async fn an_operator_opens_the_sale(browser: &Browser, app: &TestApp, sale: &Sale) {
    browser.goto(&app.url("/admin/ui")).await.expect("page");
    browser
        .type_into("#token", &app.admin_token())
        .await
        .expect("token typed");
    browser.click("#use-token").await.expect("clicked");
    browser
        .wait_text("#connection", WAIT, |t| t.starts_with("connected"))
        .await
        .expect("the page connects with the token");
    let row = format!("tr[data-id='{}']", sale.id);
    browser
        .wait_text(&row, WAIT, |t| t.contains(&sale.sku))
        .await
        .expect("the sale is listed");
    browser.click(&row).await.expect("sale chosen");
    browser
        .wait_text("#redis-stock", WAIT, |t| t == "20")
        .await
        .expect("20 units left");
}

/// Pause from the page, confirmed: the page shows the answer and the state.
async fn pause_from_the_page(browser: &Browser) {
    browser.click("#btn-pause").await.expect("clicked");
    browser.accept_dialog().await.expect("confirmed");
    browser
        .wait_text("#answer", WAIT, |t| t.contains("/pause → 200"))
        .await
        .expect("the page shows the answer");
    browser
        .wait_text("#state", WAIT, |t| t == "paused")
        .await
        .expect("the switch shows paused");
}
