//! Per-user and per-IP token buckets answer 429 with Retry-After before Redis.

use reqwest::StatusCode;

use crate::helpers::{assert_error, TestApp};

#[tokio::test]
async fn a_user_over_quota_gets_429_while_another_is_served() {
    let app = TestApp::builder().per_user_limit(1, 2).spawn().await;
    let sale = app.open_sale(10, 1).await;

    let mut statuses = Vec::new();
    let mut limited = None;
    for _ in 0..5 {
        let resp = app.reserve(&sale.sku, "greedy", None).await;
        statuses.push(resp.status());
        if resp.status() == StatusCode::TOO_MANY_REQUESTS && limited.is_none() {
            let retry_after: u64 = resp
                .headers()
                .get("retry-after")
                .expect("Retry-After header")
                .to_str()
                .expect("text")
                .parse()
                .expect("seconds");
            assert!(retry_after >= 1);
            limited = Some(assert_error(resp, StatusCode::TOO_MANY_REQUESTS, "rate_limited").await);
        }
    }
    assert_eq!(statuses[0], StatusCode::ACCEPTED);
    assert_eq!(
        statuses[1],
        StatusCode::CONFLICT,
        "second is already_reserved"
    );
    assert!(limited.is_some(), "the user was limited: {statuses:?}");
    let limited_count = statuses
        .iter()
        .filter(|s| **s == StatusCode::TOO_MANY_REQUESTS)
        .count();
    assert!(limited_count >= 2, "burst of 2 then limited: {statuses:?}");

    let other = app.reserve(&sale.sku, "patient", None).await;
    assert_eq!(
        other.status(),
        StatusCode::ACCEPTED,
        "another user is served"
    );
    assert_eq!(app.redis_stock(&sale).await, Some(8));
    app.stop().await;
}

#[tokio::test]
async fn per_ip_limit_applies_before_auth() {
    let app = TestApp::builder().per_ip_limit(1, 3).spawn().await;
    let mut statuses = Vec::new();
    for _ in 0..6 {
        statuses.push(app.sale("unknown-sku").await.status());
    }
    assert_eq!(&statuses[..3], &[StatusCode::NOT_FOUND; 3]);
    assert!(
        statuses[3..]
            .iter()
            .all(|s| *s == StatusCode::TOO_MANY_REQUESTS),
        "{statuses:?}"
    );
    // Probes are not limited.
    let health = app.healthz().await;
    assert_eq!(health.status(), StatusCode::OK);
    app.stop().await;
}

/// Fires `n` requests at an unknown SKU, each with its own forged
/// `X-Forwarded-For`, and returns how many were rate limited.
async fn forged_clients(app: &TestApp, n: usize) -> usize {
    let mut limited = 0;
    for i in 0..n {
        let resp = forwarded_for(app, &format!("198.51.100.{i}")).await;
        if resp.status() == StatusCode::TOO_MANY_REQUESTS {
            limited += 1;
        } else {
            assert_eq!(resp.status(), StatusCode::NOT_FOUND);
        }
    }
    limited
}

#[tokio::test]
async fn a_forged_forwarded_for_from_an_untrusted_peer_is_ignored() {
    let app = TestApp::builder().per_ip_limit(1, 3).spawn().await;
    assert!(
        forged_clients(&app, 8).await >= 5,
        "one bucket for the peer, whatever the header says"
    );
}

#[tokio::test]
async fn behind_a_trusted_proxy_each_client_has_its_own_bucket() {
    let app = TestApp::builder()
        .per_ip_limit(1, 3)
        .trusted_proxies(&["127.0.0.1"])
        .spawn()
        .await;
    assert_eq!(
        forged_clients(&app, 8).await,
        0,
        "eight clients, eight buckets"
    );
    // One client behind the proxy still has one bucket.
    let mut statuses = Vec::new();
    for _ in 0..6 {
        statuses.push(forwarded_for(&app, "203.0.113.50").await.status());
    }
    assert!(
        statuses[3..]
            .iter()
            .all(|s| *s == StatusCode::TOO_MANY_REQUESTS),
        "{statuses:?}"
    );
}

/// An IPv6 client is counted by its /64: addresses it picks within it share
/// one bucket; another /64 has its own. An IPv4-mapped address counts as its
/// IPv4 address.
#[tokio::test]
async fn an_ipv6_client_is_counted_by_its_64() {
    let app = TestApp::builder()
        .per_ip_limit(1, 3)
        .trusted_proxies(&["127.0.0.1"])
        .spawn()
        .await;
    let mut statuses = Vec::new();
    for i in 1..=6 {
        let client = format!("2001:db8:1:2::{i:x}");
        statuses.push(forwarded_for(&app, &client).await.status());
    }
    assert_eq!(&statuses[..3], &[StatusCode::NOT_FOUND; 3], "{statuses:?}");
    assert!(
        statuses[3..]
            .iter()
            .all(|s| *s == StatusCode::TOO_MANY_REQUESTS),
        "six addresses of one /64, one bucket: {statuses:?}"
    );
    let neighbour = forwarded_for(&app, "2001:db8:1:3::1").await;
    assert_eq!(
        neighbour.status(),
        StatusCode::NOT_FOUND,
        "the next /64 has its own bucket"
    );

    let mut statuses = Vec::new();
    for client in ["203.0.113.60", "::ffff:203.0.113.60"].repeat(3) {
        statuses.push(forwarded_for(&app, client).await.status());
    }
    assert!(
        statuses[3..]
            .iter()
            .all(|s| *s == StatusCode::TOO_MANY_REQUESTS),
        "an IPv4-mapped address is its IPv4 address: {statuses:?}"
    );
}

/// `GET /flash/unknown-sku` with this `X-Forwarded-For`.
async fn forwarded_for(app: &TestApp, client: &str) -> reqwest::Response {
    let request = app
        .api
        .sale("unknown-sku")
        .header("x-forwarded-for", client);
    app.send(request).await
}
