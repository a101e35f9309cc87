//! Operators and the audit trail: named tokens and operator JWTs beside the
//! shared token; every admin change recorded once with who, what and the answer,
//! refused ones too, reads never; `GET /admin/audit`'s filter and limit.

use chrono::Utc;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use reqwest::{Method, StatusCode};
use secrecy::ExposeSecret;
use serde_json::{json, Value};

use testkit::identity::{claims, IdentityProvider, TestKey};

use crate::helpers::{assert_error, unique, Caller, TestApp, TestAppBuilder};

const ALICE: &str = "Alice-token-0123456789";
const BOB: &str = "Bob-token-0123456789ab";

fn with_operators() -> TestAppBuilder {
    TestApp::builder().operators(&[("alice", ALICE), ("bob", BOB)])
}

/// The newest entry, checked against who did what and what they were answered.
fn assert_entry(e: &Value, who: (&str, &str), action: &str, activity: &str, status: u16) {
    assert_eq!(e["operator"], who.0, "{e}");
    assert_eq!(e["via"], who.1, "{e}");
    assert_eq!(e["action"], action, "{e}");
    assert_eq!(e["activity_id"], activity, "{e}");
    assert_eq!(e["status"], status, "{e}");
    assert!(e["at"].as_str().is_some_and(|t| t.ends_with('Z')), "{e}");
}

/// The request id the service answered with (`x-request-id`).
fn request_id_of(resp: &reqwest::Response) -> String {
    resp.headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .expect("a request id")
        .to_owned()
}

/// The identity provider's token for `sub`, with these extra claims.
fn provider_token(key: &TestKey, sub: &str, extra: Value) -> String {
    let mut c = claims(sub);
    if let (Some(c), Some(extra)) = (c.as_object_mut(), extra.as_object()) {
        c.extend(extra.clone());
    }
    key.sign(&c)
}

#[tokio::test]
async fn each_change_is_recorded_once_with_who_what_and_the_answer() {
    let app = with_operators().spawn().await;
    assert!(app.audit_entries("").await.is_empty());

    let id = unique("audited-");
    let now = Utc::now();
    let resp = app
        .send(
            app.api
                .request(Method::POST, "/admin/activities", Caller::Token(ALICE))
                .header("x-request-id", "req-create")
                .json(&json!({
                    "id": id, "sku": unique("sku-"), "stock": 10,
                    "starts_at": now - chrono::Duration::seconds(5),
                    "ends_at": now + chrono::Duration::hours(1),
                })),
        )
        .await;
    assert_eq!(resp.status(), StatusCode::CREATED);
    let answered_id = request_id_of(&resp);
    let entries = app.audit_entries("").await;
    assert_eq!(entries.len(), 1, "{entries:?}");
    let e = &entries[0];
    assert_entry(e, ("alice", "named"), "create", &id, 201);
    // The request's id is the service's own, as answered; the client's beside it.
    assert_eq!(e["request_id"], answered_id.as_str(), "{e}");
    assert_ne!(e["request_id"], "req-create", "{e}");
    assert_eq!(e["client_request_id"], "req-create", "{e}");
    assert_eq!(e["code"], Value::Null);
    let request = e["request"].as_str().expect("request text");
    assert!(request.starts_with("POST /admin/activities {") && request.contains(&id));
    assert!(
        e["summary"].as_str().is_some_and(|s| s.contains(&id)),
        "{e}"
    );

    // Each change by its own caller: one entry more each time, newest first.
    for (step, caller, who) in [
        ("preload", Caller::Admin, ("admin_token", "shared")),
        ("pause", Caller::Token(BOB), ("bob", "named")),
        ("resume", Caller::Token(ALICE), ("alice", "named")),
        ("reconcile", Caller::Token(BOB), ("bob", "named")),
    ] {
        let before = app.audit_entries("").await.len();
        let request_id = format!("req-{step}");
        let resp = app
            .send(
                app.api
                    .admin_step_as(&id, step, caller)
                    .header("x-request-id", &request_id),
            )
            .await;
        assert_eq!(resp.status(), StatusCode::OK, "{step}");
        let answered_id = request_id_of(&resp);
        let entries = app.audit_entries("").await;
        assert_eq!(entries.len(), before + 1, "{step}");
        assert_entry(&entries[0], who, step, &id, 200);
        assert_eq!(entries[0]["request_id"], answered_id.as_str());
        assert_eq!(entries[0]["client_request_id"], request_id.as_str());
        assert_eq!(
            entries[0]["request"],
            format!("POST /admin/activities/{id}/{step}")
        );
    }
    let resp = app
        .send(
            app.api
                .request(
                    Method::POST,
                    &format!("/admin/activities/{id}/stock"),
                    Caller::Token(ALICE),
                )
                .json(&json!({"add": 5})),
        )
        .await;
    assert_eq!(resp.status(), StatusCode::OK);
    let sent_id = request_id_of(&resp);
    let entries = app.audit_entries("").await;
    assert_eq!(entries.len(), 6);
    assert_entry(&entries[0], ("alice", "named"), "top_up", &id, 200);
    // The id the service gave the request, as the answer and the logs carry it;
    // the client sent none.
    assert_eq!(entries[0]["request_id"], sent_id.as_str());
    assert_eq!(entries[0]["client_request_id"], Value::Null);
    assert!(entries[0]["request"]
        .as_str()
        .is_some_and(|r| r.ends_with(r#"{"add":5}"#)));
    assert!(entries[0]["summary"]
        .as_str()
        .is_some_and(|s| s.contains(r#""stock":15"#)));

    // Reads are not recorded, whoever reads.
    assert_eq!(app.activities().await.status(), StatusCode::OK);
    assert_eq!(app.activity(&id).await.status(), StatusCode::OK);
    let resp = app.send(app.api.audit("", Caller::Token(BOB))).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let ids: Vec<u64> = app
        .audit_entries("")
        .await
        .iter()
        .map(|e| e["id"].as_u64().expect("id"))
        .collect();
    assert_eq!(ids.len(), 6);
    assert!(ids.windows(2).all(|w| w[0] > w[1]), "newest first: {ids:?}");
    app.stop().await;
}

/// A client's `X-Request-Id` never becomes the request's id: the answer, the
/// logs and the trail carry the service's own, and the client's is kept beside
/// it only when it is 1 to 128 visible ASCII characters.
#[tokio::test]
async fn a_clients_request_id_is_kept_beside_the_services_own() {
    let app = with_operators().spawn().await;
    let sale = app.open_sale(5, 1).await;
    let longest = "r".repeat(128);
    let too_long = format!("{longest}r");
    for (step, sent, kept) in [
        ("pause", longest.as_str(), Some(longest.as_str())),
        ("resume", too_long.as_str(), None),
        ("pause", "two words", None),
        ("resume", "", None),
    ] {
        let resp = app
            .send(
                app.api
                    .admin_step_as(&sale.id, step, Caller::Token(ALICE))
                    .header("x-request-id", sent),
            )
            .await;
        assert_eq!(resp.status(), StatusCode::OK, "{step} {sent:?}");
        let answered_id = request_id_of(&resp);
        assert_ne!(answered_id, sent, "the answer carries the service's id");
        let e = &app.audit_entries("").await[0];
        assert_entry(e, ("alice", "named"), step, &sale.id, 200);
        assert_eq!(e["request_id"], answered_id.as_str(), "{e}");
        assert_eq!(e["client_request_id"], json!(kept), "{sent:?}: {e}");
    }
    app.stop().await;
}

#[tokio::test]
async fn refused_changes_are_recorded_with_their_answer() {
    let app = with_operators().spawn().await;
    let sale = app.open_sale(10, 1).await;
    assert_eq!(app.audit_entries("").await.len(), 2, "create and preload");

    // 409: a preload while the sale is open.
    let resp = app
        .send(
            app.api
                .admin_step_as(&sale.id, "preload", Caller::Token(BOB)),
        )
        .await;
    let body = assert_error(resp, StatusCode::CONFLICT, "conflict").await;
    let e = &app.audit_entries("").await[0];
    assert_entry(e, ("bob", "named"), "preload", &sale.id, 409);
    assert_eq!(e["code"], "conflict");
    assert_eq!(e["summary"], body["message"]);

    // 404: no such activity (a valid id: recorded as named).
    let resp = app
        .send(
            app.api
                .admin_step_as("no-such-sale", "pause", Caller::Token(ALICE)),
        )
        .await;
    assert_error(resp, StatusCode::NOT_FOUND, "not_found").await;
    let e = &app.audit_entries("").await[0];
    assert_entry(e, ("alice", "named"), "pause", "no-such-sale", 404);
    assert_eq!(e["code"], "not_found");

    // 422: a top-up of nothing.
    let top_up = |body: String| {
        app.api
            .request(
                Method::POST,
                &format!("/admin/activities/{}/stock", sale.id),
                Caller::Token(ALICE),
            )
            .header("content-type", "application/json")
            .body(body)
    };
    let resp = app.send(top_up(r#"{"add": 0}"#.into())).await;
    assert_error(resp, StatusCode::UNPROCESSABLE_ENTITY, "invalid_request").await;
    let e = &app.audit_entries("").await[0];
    assert_entry(e, ("alice", "named"), "top_up", &sale.id, 422);
    assert_eq!(e["code"], "invalid_request");
    assert!(e["request"]
        .as_str()
        .is_some_and(|r| r.ends_with(r#"{"add": 0}"#)));

    // 413: a body over the limit, refused before any handler; recorded cut short.
    let pad = "x".repeat(app.settings.server.body_limit_bytes);
    let resp = app
        .send(top_up(format!(r#"{{"add": 1, "pad": "{pad}"}}"#)))
        .await;
    assert_error(resp, StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large").await;
    let e = &app.audit_entries("").await[0];
    assert_entry(e, ("alice", "named"), "top_up", &sale.id, 413);
    assert_eq!(e["code"], "payload_too_large");

    // 409: the same id again; the entry names the id asked for.
    let now = Utc::now();
    let resp = app
        .send(
            app.api
                .request(Method::POST, "/admin/activities", Caller::Token(BOB))
                .json(&json!({
                    "id": sale.id, "sku": unique("sku-"), "stock": 1,
                    "starts_at": now + chrono::Duration::hours(1),
                    "ends_at": now + chrono::Duration::hours(2),
                })),
        )
        .await;
    assert_error(resp, StatusCode::CONFLICT, "conflict").await;
    let e = &app.audit_entries("").await[0];
    assert_entry(e, ("bob", "named"), "create", &sale.id, 409);

    // Nothing was changed by any of them, and each left exactly one entry.
    assert_eq!(app.audit_entries("").await.len(), 7);
    let figures = app.activity_figures(&sale.id).await;
    assert_eq!(figures["stock"], 10);
    assert_eq!(figures["paused"], false);
    app.stop().await;
}

#[tokio::test]
async fn operators_are_named_by_their_token_and_strangers_refused() {
    let key = TestKey::rsa_a();
    let idp = IdentityProvider::start(&[&key]).await;
    let app = with_operators().identity_provider(&idp).spawn().await;
    let sale = app.open_sale(5, 1).await;
    let entries_before = app.audit_entries("").await.len();

    // Unknown tokens, a near miss, no token, another scheme: 401, on changes
    // and reads alike, and nothing recorded.
    let near_miss = format!("{ALICE}x");
    // A user's token from the provider: valid, but no operator role.
    let user = provider_token(&key, "carol", json!({}));
    // The service's own HS256 secret never grants a role.
    let own = app.token("carol");
    let own_operator = {
        let secret = app.settings.auth.user_token_secret.expose_secret();
        jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &json!({"sub": "eve", "exp": Utc::now().timestamp() + 600, "role": "operator"}),
            &EncodingKey::from_secret(secret.as_bytes()).expect("a key"),
        )
        .expect("signed")
    };
    for caller in [
        Caller::Token(&own),
        Caller::Token(&own_operator),
        Caller::Token("Mallory-token-0123456789"),
        Caller::Token(&near_miss),
        Caller::Token(&ALICE[..ALICE.len() - 1]),
        Caller::Anonymous,
        Caller::Header(&format!("Basic {ALICE}")),
        // A user's token carries no operator role.
        Caller::Token(&user),
        // An operator's JWT signed with another key, or expired.
        Caller::Token(
            &jsonwebtoken::encode(
                &Header::new(Algorithm::HS256),
                &json!({"sub": "eve", "exp": Utc::now().timestamp() + 600, "role": "operator"}),
                &EncodingKey::from_secret(b"not-the-service-secret-0123").expect("a key"),
            )
            .expect("signed"),
        ),
        Caller::Token(&provider_token(
            &key,
            "eve",
            json!({"exp": Utc::now().timestamp() - 600, "role": "operator"}),
        )),
    ] {
        let resp = app
            .send(app.api.admin_step_as(&sale.id, "pause", caller))
            .await;
        assert_error(resp, StatusCode::UNAUTHORIZED, "unauthorized").await;
        let resp = app.send(app.api.audit("", caller)).await;
        assert_error(resp, StatusCode::UNAUTHORIZED, "unauthorized").await;
    }
    let resp = app
        .send(
            app.api
                .admin_step_as(&sale.id, "pause", Caller::Token(&user)),
        )
        .await;
    let body = assert_error(resp, StatusCode::UNAUTHORIZED, "unauthorized").await;
    assert!(body["message"]
        .as_str()
        .is_some_and(|m| m.contains("operator role")));
    assert_eq!(app.audit_entries("").await.len(), entries_before);
    assert_eq!(app.activity_figures(&sale.id).await["paused"], false);

    // An identity provider's JWT with role "operator": named by its subject.
    let dora = provider_token(&key, "dora", json!({"role": "operator"}));
    let resp = app
        .send(
            app.api
                .admin_step_as(&sale.id, "pause", Caller::Token(&dora)),
        )
        .await;
    assert_eq!(resp.status(), StatusCode::OK);
    let entries = app.audit_entries("").await;
    assert_eq!(entries.len(), entries_before + 1);
    assert_entry(&entries[0], ("dora", "jwt"), "pause", &sale.id, 200);

    // The shared token is recorded as such.
    let resp = app.resume(&sale.id).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_entry(
        &app.audit_entries("").await[0],
        ("admin_token", "shared"),
        "resume",
        &sale.id,
        200,
    );
    app.stop().await;
}

#[tokio::test]
async fn the_trail_filters_by_activity_and_limits_and_refuses_bad_parameters() {
    let app = with_operators().spawn().await;
    let first = app.open_sale(5, 1).await;
    let second = app.open_sale(5, 1).await;
    for _ in 0..2 {
        for step in ["pause", "resume"] {
            let resp = app
                .send(app.api.admin_step_as(&first.id, step, Caller::Token(BOB)))
                .await;
            assert_eq!(resp.status(), StatusCode::OK);
        }
    }
    let resp = app.pause(&second.id).await;
    assert_eq!(resp.status(), StatusCode::OK);

    // 2 + 4 for the first sale, 2 + 1 for the second.
    assert_eq!(app.audit_entries("").await.len(), 9);
    let of_first = app
        .audit_entries(&format!("activity_id={}", first.id))
        .await;
    assert_eq!(of_first.len(), 6);
    assert!(of_first
        .iter()
        .all(|e| e["activity_id"] == first.id.as_str()));
    let actions: Vec<&str> = of_first
        .iter()
        .map(|e| e["action"].as_str().expect("action"))
        .collect();
    assert_eq!(
        actions,
        ["resume", "pause", "resume", "pause", "preload", "create"]
    );
    let of_second = app
        .audit_entries(&format!("activity_id={}&limit=1000", second.id))
        .await;
    assert_eq!(of_second.len(), 3);
    assert_eq!(of_second[0]["action"], "pause");

    // The newest two, of all and of one; an empty parameter is no filter.
    let newest = app.audit_entries("limit=2").await;
    assert_eq!(newest.len(), 2);
    assert_eq!(newest[0]["activity_id"], second.id.as_str());
    assert_eq!(newest[1]["activity_id"], first.id.as_str());
    let two = app
        .audit_entries(&format!("limit=2&activity_id={}", first.id))
        .await;
    assert_eq!(two, of_first[..2]);
    assert_eq!(app.audit_entries("activity_id=&limit=").await.len(), 9);
    assert!(app
        .audit_entries("activity_id=never-acted-on")
        .await
        .is_empty());

    for bad in [
        "limit=0",
        "limit=1001",
        "limit=-1",
        "limit=ten",
        "limit=2.5",
        "activity_id=not%20an%20id",
        "activity=x",
        "limit=1&limit=2",
    ] {
        assert_error(
            app.audit(bad).await,
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_request",
        )
        .await;
    }
    app.stop().await;
}
