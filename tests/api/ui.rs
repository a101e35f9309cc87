//! The operators' page (`GET /admin/ui`) in a real headless browser: enter the
//! token, watch a sale's figures move as reservations arrive, pause it from the
//! page and see reservations refused; a named operator's action appears in the
//! page's audit trail under their name.

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

/// No page of the service's can be framed by another site (clickjacking):
/// each says so in its one policy and in `X-Frame-Options`.
#[tokio::test]
async fn every_page_refuses_to_be_framed() {
    let app = spawn_app().await;
    for path in ["/admin/ui", "/docs", "/buy/any-sku"] {
        let page = app.get(path).await;
        assert_eq!(page.status(), StatusCode::OK, "{path}");
        let policies: Vec<&str> = page
            .headers()
            .get_all("content-security-policy")
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect();
        assert_eq!(policies.len(), 1, "one policy on {path}: {policies:?}");
        assert!(
            policies[0]
                .split(';')
                .any(|d| d.trim() == "frame-ancestors 'none'"),
            "{path}: {policies:?}"
        );
        assert!(
            policies[0].contains("default-src 'self'"),
            "{path}: {policies:?}"
        );
        assert_eq!(
            page.headers()
                .get("x-frame-options")
                .and_then(|v| v.to_str().ok()),
            Some("DENY"),
            "{path}"
        );
    }
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_action_on_the_page_appears_in_the_audit_trail_under_the_operators_name() {
    const OLGA: &str = "Olga-token-0123456789xyz";
    let app = TestApp::builder()
        .operators(&[("olga", OLGA)])
        .spawn()
        .await;
    let sale = app.open_sale(20, 1).await;
    let other = app.open_sale(5, 1).await;

    let dir = tempfile::tempdir().expect("a temporary folder");
    let browser = Browser::start(dir.path())
        .await
        .expect("a headless browser");
    an_operator_opens_the_sale_with(&browser, &app, &sale, OLGA).await;

    // Before any action of hers: the chosen sale's trail, set up with the
    // shared token.
    browser
        .wait_text("#audit-scope", WAIT, |t| t == sale.id)
        .await
        .expect("the trail follows the chosen sale");
    let trail = browser
        .wait_text("#audit-entries", WAIT, |t| t.contains("preload"))
        .await
        .expect("the sale's preload listed");
    assert!(trail.contains("admin_token (shared)"), "{trail}");
    assert!(
        !trail.contains("olga") && !trail.contains(&other.id),
        "{trail}"
    );

    pause_from_the_page(&browser).await;
    let newest = browser
        .wait_text("#audit-entries tr:first-child", WAIT, |t| {
            t.contains("olga")
        })
        .await
        .expect("her pause is the newest entry");
    assert!(
        newest.contains("pause") && newest.contains(&sale.id) && newest.contains("200"),
        "{newest}"
    );

    // A paused sale preloads again; then resumed: each action listed, in order.
    for step in ["preload", "resume"] {
        browser
            .click(&format!("#btn-{step}"))
            .await
            .expect("clicked");
        browser.accept_dialog().await.expect("confirmed");
        browser
            .wait_text("#answer", WAIT, |t| t.contains(&format!("/{step} → 200")))
            .await
            .expect("the page shows the answer");
    }
    let newest = browser
        .wait_text("#audit-entries tr:first-child", WAIT, |t| {
            t.contains("resume")
        })
        .await
        .expect("her resume is the newest entry");
    assert!(newest.contains("olga"), "{newest}");
    let entries = app.audit_entries(&format!("activity_id={}", sale.id)).await;
    let by_olga: Vec<(&str, u64)> = entries
        .iter()
        .filter(|e| e["operator"] == "olga")
        .map(|e| {
            (
                e["action"].as_str().unwrap_or("?"),
                e["status"].as_u64().unwrap_or(0),
            )
        })
        .collect();
    assert_eq!(by_olga, [("resume", 200), ("preload", 200), ("pause", 200)]);

    // Every sale's trail on demand.
    browser.click("#audit-all").await.expect("clicked");
    browser
        .wait_text("#audit-entries", WAIT, |t| t.contains(&other.id))
        .await
        .expect("the other sale's entries listed");
    drop(browser);
}

/// The token entered, the page connected, the sale chosen with its 20 units.
async fn an_operator_opens_the_sale(browser: &Browser, app: &TestApp, sale: &Sale) {
    an_operator_opens_the_sale_with(browser, app, sale, &app.admin_token()).await;
}

/// `an_operator_opens_the_sale` with this token.
async fn an_operator_opens_the_sale_with(
    browser: &Browser,
    app: &TestApp,
    sale: &Sale,
    token: &str,
) {
    browser.goto(&app.url("/admin/ui")).await.expect("page");
    browser
        .type_into("#token", token)
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
