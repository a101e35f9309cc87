//! Every documented error of the user and admin endpoints, in the documented shape,
//! with nothing held or written because of it.

use chrono::Utc;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use reqwest::{Method, StatusCode};
use serde_json::json;

use crate::helpers::{assert_error, spawn_app, unique, Caller};

fn sign(secret: &str, claims: serde_json::Value) -> String {
    jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(secret.as_bytes()).expect("key"),
    )
    .expect("token")
}

#[tokio::test]
async fn bad_tokens_get_401() {
    let app = spawn_app().await;
    let sale = app.open_sale(5, 1).await;
    let secret =
        secrecy::ExposeSecret::expose_secret(&app.settings.auth.user_token_secret).to_owned();
    let now = Utc::now().timestamp();
    let exp = now + 600;

    let no_token = app.reserve_as(&sale.sku, Caller::Anonymous).await;
    assert_error(no_token, StatusCode::UNAUTHORIZED, "unauthorized").await;

    // Each refused token, and what the refusal's message names (if anything).
    let refused = [
        (
            sign(
                "some-other-secret-entirely",
                json!({"sub": "u1", "exp": exp}),
            ),
            None,
        ),
        (
            sign(&secret, json!({"sub": "u1", "exp": now - 600})),
            Some("expired"),
        ),
        // Found by hand: a token whose nbf lies in the future was accepted.
        (
            sign(&secret, json!({"sub": "u1", "exp": exp, "nbf": now + 300})),
            Some("nbf"),
        ),
        ("garbage.not.jwt".to_owned(), None),
        (sign(&secret, json!({"sub": "u1"})), None),
        (
            sign(&secret, json!({"sub": "not a valid\nid", "exp": exp})),
            None,
        ),
    ];
    for (token, named) in &refused {
        let resp = app.reserve_as(&sale.sku, Caller::Token(token)).await;
        let body = assert_error(resp, StatusCode::UNAUTHORIZED, "unauthorized").await;
        if let Some(word) = named {
            assert!(
                body["message"].as_str().is_some_and(|m| m.contains(word)),
                "{word} in {body}"
            );
        }
    }
    // A past nbf passes authentication (and holds nothing: a status lookup).
    let already = sign(&secret, json!({"sub": "u1", "exp": exp, "nbf": now - 60}));
    let resp = app
        .send(app.api.reservation(&sale.sku, Caller::Token(&already)))
        .await;
    assert_error(resp, StatusCode::NOT_FOUND, "not_found").await;

    let basic = app
        .reserve_as(&sale.sku, Caller::Header("Basic dXNlcjpwYXNz"))
        .await;
    assert_error(basic, StatusCode::UNAUTHORIZED, "unauthorized").await;

    assert_eq!(app.redis_stock(&sale).await, Some(5), "nothing was held");
    app.stop().await;
}

#[tokio::test]
async fn bad_bodies_get_422_or_413() {
    let app = spawn_app().await;
    let sale = app.open_sale(5, 2).await;

    for body in [
        json!({"quantity": 0}),
        json!({"quantity": -1}),
        json!({"quantity": "two"}),
        json!({"quantity": 1.5}),
        json!({"quantity": 3}),
        json!({"quantity": 4_294_967_296_u64}),
        json!("one"),
    ] {
        let resp = app.reserve(&sale.sku, "u2", Some(body)).await;
        assert_error(resp, StatusCode::UNPROCESSABLE_ENTITY, "invalid_request").await;
    }

    let broken = app.reserve_raw(&sale.sku, "u2", "{\"quantity\": ").await;
    assert_error(broken, StatusCode::UNPROCESSABLE_ENTITY, "invalid_request").await;

    let huge = format!(
        "{{\"quantity\": 1, \"pad\": \"{}\"}}",
        "x".repeat(64 * 1024)
    );
    let resp = app.reserve_raw(&sale.sku, "u2", &huge).await;
    assert_error(resp, StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large").await;

    assert_eq!(app.redis_stock(&sale).await, Some(5), "nothing was held");
    let snap = app.redis_snapshot(&sale).await;
    assert_eq!(snap.buyers, 0);
    app.stop().await;
}

#[tokio::test]
async fn unknown_sku_and_closed_windows() {
    let app = spawn_app().await;
    let resp = app.reserve("no-such-sku", "u3", None).await;
    assert_error(resp, StatusCode::NOT_FOUND, "not_found").await;
    let resp = app.sale("no-such-sku").await;
    assert_error(resp, StatusCode::NOT_FOUND, "not_found").await;

    let now = Utc::now();
    let later = unique("sku-");
    let resp = app
        .create_activity(json!({
            "sku": later, "stock": 5,
            "starts_at": now + chrono::Duration::hours(1),
            "ends_at": now + chrono::Duration::hours(2),
        }))
        .await;
    assert_eq!(resp.status(), StatusCode::CREATED);
    let resp = app.reserve(&later, "u3", None).await;
    assert_error(resp, StatusCode::FORBIDDEN, "not_started").await;

    let past = unique("sku-");
    let resp = app
        .create_activity(json!({
            "sku": past, "stock": 5,
            "starts_at": now - chrono::Duration::hours(2),
            "ends_at": now - chrono::Duration::hours(1),
        }))
        .await;
    assert_eq!(resp.status(), StatusCode::CREATED);
    let resp = app.reserve(&past, "u3", None).await;
    assert_error(resp, StatusCode::FORBIDDEN, "ended").await;
    app.stop().await;
}

#[tokio::test]
async fn admin_endpoints_need_the_admin_token() {
    let app = spawn_app().await;
    let body = json!({
        "sku": unique("sku-"), "stock": 5,
        "starts_at": Utc::now(), "ends_at": Utc::now() + chrono::Duration::hours(1),
    });
    let not_the_admin = format!("{}x", app.admin_token());
    for caller in [
        Caller::Anonymous,
        Caller::User("mallory"),
        Caller::Token(&not_the_admin),
    ] {
        let request = app
            .api
            .request(Method::POST, "/admin/activities", caller)
            .json(&body);
        let resp = app.send(request).await;
        assert_error(resp, StatusCode::UNAUTHORIZED, "unauthorized").await;
    }
    app.stop().await;
}

#[tokio::test]
async fn invalid_activity_fields_get_422() {
    let app = spawn_app().await;
    let now = Utc::now();
    let hour = chrono::Duration::hours(1);
    let good = json!({
        "sku": unique("sku-"), "stock": 5, "per_user_limit": 1,
        "starts_at": now, "ends_at": now + hour, "payment_timeout_secs": 900,
    });
    let mut cases = Vec::new();
    for (field, value) in [
        ("stock", json!(0)),
        ("stock", json!(-5)),
        ("stock", json!("many")),
        ("per_user_limit", json!(0)),
        ("per_user_limit", json!(6)),
        ("starts_at", json!("yesterday")),
        ("ends_at", json!(now - hour)),
        ("starts_at", json!("1969-12-31T23:59:59Z")),
        ("payment_timeout_secs", json!(0)),
        ("id", json!("has spaces")),
        ("id", json!("x".repeat(65))),
        ("sku", json!("")),
        ("sku", json!("a/b")),
        ("unexpected", json!(1)),
    ] {
        let mut body = good.clone();
        body[field] = value;
        cases.push(body);
    }
    let mut missing = good.clone();
    missing.as_object_mut().expect("object").remove("sku");
    cases.push(missing);
    for body in cases {
        let resp = app.create_activity(body.clone()).await;
        assert_error(resp, StatusCode::UNPROCESSABLE_ENTITY, "invalid_request").await;
    }
    let request = app
        .api
        .request(Method::POST, "/admin/activities", Caller::Admin)
        .header("content-type", "application/json")
        .body("{not json");
    let resp = app.send(request).await;
    assert_error(resp, StatusCode::UNPROCESSABLE_ENTITY, "invalid_request").await;
    // None of them was stored.
    let count: (i64,) = sqlx::query_as("SELECT COUNT(*) FROM activities")
        .fetch_one(&app.state.pool)
        .await
        .expect("count");
    assert_eq!(count.0, 0);
    // The good one is accepted.
    let resp = app.create_activity(good).await;
    assert_eq!(resp.status(), StatusCode::CREATED);
    app.stop().await;
}

#[tokio::test]
async fn unknown_routes_and_methods_answer_json() {
    let app = spawn_app().await;
    let resp = app.get("/nope").await;
    assert_error(resp, StatusCode::NOT_FOUND, "not_found").await;
    let resp = app
        .send(
            app.api
                .request(Method::DELETE, "/flash/x", Caller::Anonymous),
        )
        .await;
    assert_error(resp, StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed").await;
    app.stop().await;
}

/// Found by the fuzzer: JSON Schema counts `5.0` as a whole number and a `null`
/// body as no body; the service now agrees.
#[tokio::test]
async fn whole_numbers_written_with_a_fraction_and_null_bodies_are_accepted() {
    let app = spawn_app().await;
    let now = Utc::now();
    let resp = app
        .create_activity(json!({
            "sku": unique("sku-"), "stock": 5.0, "per_user_limit": 2.0,
            "starts_at": now - chrono::Duration::seconds(5),
            "ends_at": now + chrono::Duration::hours(1),
            "payment_timeout_secs": 900.0, "stock_shards": 1.0,
        }))
        .await;
    assert_eq!(resp.status(), StatusCode::CREATED);
    let created: serde_json::Value = resp.json().await.expect("JSON");
    assert_eq!(created["stock"], 5);
    let id = created["id"].as_str().expect("id").to_owned();
    let sku = created["sku"].as_str().expect("sku").to_owned();
    let resp = app.preload(&id).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let resp = app.top_up(&id, json!({"add": 3.0})).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let resp = app.reserve_raw(&sku, "null-body", "null").await;
    assert_eq!(resp.status(), StatusCode::ACCEPTED, "null is no body");
    let resp = app
        .reserve(&sku, "two-point-oh", Some(json!({"quantity": 2.0})))
        .await;
    assert_eq!(resp.status(), StatusCode::ACCEPTED);
    for bad in [json!({"quantity": 1.5}), json!({"quantity": 0.0})] {
        let resp = app.reserve(&sku, "fractional", Some(bad)).await;
        assert_error(resp, StatusCode::UNPROCESSABLE_ENTITY, "invalid_request").await;
    }
    assert_eq!(
        app.state.stock.stock_left(&id, 1).await.expect("redis"),
        Some(5)
    );
    // An unknown readiness role is refused in the error shape.
    let resp = app.get("/readyz?role=").await;
    assert_error(resp, StatusCode::UNPROCESSABLE_ENTITY, "invalid_request").await;
}
