//! User tokens from an identity provider: RS256 and ES256 tokens verified with
//! the keys of a JWKS served by the test kit (which a test rotates, breaks or
//! stops) or of PEM files, and everything that must be refused.

use reqwest::StatusCode;
use serde_json::{json, Value};
use testkit::identity::{claims, sign_hs256, unsigned, Answer, IdentityProvider, TestKey};

use crate::helpers::{assert_error, eventually, Caller, TestApp, TestAppBuilder, WAIT};

/// Starts `builder`'s app trusting `idp`, once the provider has answered the
/// app's first fetch. A token arriving before that answer is stored joins the
/// fetch under way (it waits for it, and sends no request of its own).
async fn spawn_with(builder: TestAppBuilder, idp: &IdentityProvider) -> TestApp {
    let app = builder.identity_provider(idp).spawn().await;
    eventually(WAIT, "the JWKS fetched at start", || async {
        (idp.requests() >= 1).then_some(())
    })
    .await;
    app
}

/// Sends every token's reservation at once; (status, body) of each, in order.
async fn reserve_all(app: &TestApp, sku: &str, tokens: &[String]) -> Vec<(StatusCode, Value)> {
    let tasks: Vec<_> = tokens
        .iter()
        .map(|token| {
            let request = app.api.reserve(sku, Caller::Token(token));
            tokio::spawn(async move {
                let resp = request.send().await.expect("request sent");
                let status = resp.status();
                (status, resp.json::<Value>().await.expect("JSON body"))
            })
        })
        .collect();
    let mut answers = Vec::with_capacity(tasks.len());
    for task in tasks {
        answers.push(task.await.expect("request task"));
    }
    answers
}

async fn refused(app: &TestApp, sku: &str, token: &str, why: &str) -> String {
    let resp = app.reserve_as(sku, Caller::Token(token)).await;
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED, "{why}");
    let body = assert_error(resp, StatusCode::UNAUTHORIZED, "unauthorized").await;
    body["message"].as_str().expect("message").to_owned()
}

#[tokio::test]
async fn rs256_and_es256_tokens_reserve_and_read_their_reservation() {
    let idp = IdentityProvider::start(&[&TestKey::rsa_a(), &TestKey::ec_a()]).await;
    let app = spawn_with(TestApp::builder(), &idp).await;
    let sale = app.open_sale(10, 1).await;

    for (key, user) in [(TestKey::rsa_a(), "rs-user"), (TestKey::ec_a(), "es-user")] {
        let token = key.token(user);
        let resp = app.reserve_as(&sale.sku, Caller::Token(&token)).await;
        assert_eq!(resp.status(), StatusCode::ACCEPTED, "{user}");
        let reserved: Value = resp.json().await.expect("JSON");
        assert_eq!(reserved["status"], "pending");
        let resp = app
            .send(app.api.reservation(&sale.sku, Caller::Token(&token)))
            .await;
        assert_eq!(resp.status(), StatusCode::OK, "{user}");
        let state: Value = resp.json().await.expect("JSON");
        assert_eq!(
            state["reservation_id"], reserved["reservation_id"],
            "{user}"
        );
    }
    // The service's own HS256 tokens keep working beside them.
    app.reserve_accepted(&sale.sku, "hs-user").await;
    assert_eq!(app.redis_stock(&sale).await, Some(7));
    app.stop().await;
}

#[tokio::test]
async fn a_key_rotated_in_mid_sale_refuses_no_valid_token() {
    let (old, new) = (TestKey::rsa_a(), TestKey::rsa_b());
    let idp = IdentityProvider::start(&[&old]).await;
    let app = spawn_with(TestApp::builder(), &idp).await;
    let sale = app.open_sale(40, 1).await;

    let before_rotation: Vec<String> = (0..10).map(|i| old.token(&format!("early-{i}"))).collect();
    let mut answers = reserve_all(&app, &sale.sku, &before_rotation).await;

    // The provider publishes a new key and signs with it at once: the first
    // token naming it fetches the set again, the others wait for that fetch.
    idp.publish(&[&old, &new]);
    let fetches = idp.requests();
    let after_rotation: Vec<String> = (0..20).map(|i| new.token(&format!("late-{i}"))).collect();
    answers.extend(reserve_all(&app, &sale.sku, &after_rotation).await);
    // Tokens of the old key, still published, go on working.
    answers.extend(reserve_all(&app, &sale.sku, &[old.token("late-old")]).await);

    let statuses: Vec<StatusCode> = answers.iter().map(|(s, _)| *s).collect();
    assert!(
        statuses.iter().all(|s| *s == StatusCode::ACCEPTED),
        "every valid token reserved: {answers:?}"
    );
    assert_eq!(
        idp.requests(),
        fetches + 1,
        "one fetch for the whole burst of the new kid"
    );
    assert_eq!(app.redis_stock(&sale).await, Some(40 - 31));
    app.stop().await;
}

#[tokio::test]
async fn unknown_kids_are_refused_and_fetch_the_set_once() {
    let key = TestKey::rsa_a();
    let idp = IdentityProvider::start(&[&key]).await;
    let app = spawn_with(TestApp::builder(), &idp).await;
    let sale = app.open_sale(10, 1).await;

    let fetches = idp.requests();
    let made_up: Vec<String> = (0..30)
        .map(|i| key.named(&format!("made-up-{i}")).token(&format!("u-{i}")))
        .collect();
    let answers = reserve_all(&app, &sale.sku, &made_up).await;
    for (status, body) in &answers {
        assert_eq!(*status, StatusCode::UNAUTHORIZED, "{body}");
        assert_eq!(body["code"], "unauthorized");
        assert_eq!(body["message"], "token key id (kid) is unknown");
    }
    assert_eq!(
        idp.requests(),
        fetches + 1,
        "a flood of unknown kids costs the provider one request"
    );
    assert_eq!(app.redis_stock(&sale).await, Some(10), "nothing reserved");
    app.stop().await;
}

#[tokio::test]
async fn a_token_whose_algorithm_is_not_its_keys_is_refused() {
    let (rsa, ec) = (TestKey::rsa_a(), TestKey::ec_a());
    let idp = IdentityProvider::start(&[&rsa, &ec]).await;
    let app = spawn_with(TestApp::builder(), &idp).await;
    let sale = app.open_sale(10, 1).await;
    let c = claims("mallory");

    // A header that lies about the algorithm of the key it names.
    let msg = refused(
        &app,
        &sale.sku,
        &rsa.sign_as(jsonwebtoken::Algorithm::ES256, Some("rsa-a"), &c),
        "ES256 under an RSA key",
    )
    .await;
    assert_eq!(msg, "token algorithm is not allowed for its key");
    refused(
        &app,
        &sale.sku,
        &ec.sign_as(jsonwebtoken::Algorithm::RS256, Some("ec-a"), &c),
        "RS256 under an EC key",
    )
    .await;
    // RS256 → HS256 confusion: an HMAC whose secret is the RSA public key, as
    // PEM or as the JWK's JSON, naming the key or not.
    for secret in [rsa.public_pem.to_owned(), rsa.jwk().to_string()] {
        for kid in [Some("rsa-a"), None] {
            refused(
                &app,
                &sale.sku,
                &sign_hs256(secret.as_bytes(), kid, &c),
                "HS256 with the public key as secret",
            )
            .await;
        }
    }
    // `alg: none`, unsigned.
    let none = unsigned(&json!({"alg": "none", "kid": "rsa-a", "typ": "JWT"}), &c);
    refused(&app, &sale.sku, &none, "alg none").await;

    assert_eq!(app.redis_stock(&sale).await, Some(10), "nothing reserved");
    let resp = app
        .reserve_as(&sale.sku, Caller::Token(&rsa.token("mallory")))
        .await;
    assert_eq!(resp.status(), StatusCode::ACCEPTED, "her real token works");
    app.stop().await;
}

#[tokio::test]
async fn issuer_and_audience_must_match() {
    let key = TestKey::ec_a();
    let idp = IdentityProvider::start(&[&key]).await;
    let app = spawn_with(TestApp::builder(), &idp).await;
    let sale = app.open_sale(10, 1).await;

    let mut cases = Vec::new();
    let mut c = claims("u1");
    c["iss"] = json!("https://other-idp.test/realms/shop");
    cases.push((c, "token issuer (iss) is not accepted"));
    let mut c = claims("u1");
    c.as_object_mut().expect("object").remove("iss");
    cases.push((c, "token has no issuer (iss)"));
    let mut c = claims("u1");
    c["aud"] = json!(["another-app"]);
    cases.push((c, "token audience (aud) is not accepted"));
    let mut c = claims("u1");
    c.as_object_mut().expect("object").remove("aud");
    cases.push((c, "token has no audience (aud)"));
    for (c, expected) in cases {
        assert_eq!(
            refused(&app, &sale.sku, &key.sign(&c), expected).await,
            expected
        );
    }
    assert_eq!(app.redis_stock(&sale).await, Some(10), "nothing reserved");
    // `aud` as a list holding ours is fine.
    let mut c = claims("u1");
    c["aud"] = json!(["another-app", testkit::identity::AUDIENCE]);
    let resp = app
        .reserve_as(&sale.sku, Caller::Token(&key.sign(&c)))
        .await;
    assert_eq!(resp.status(), StatusCode::ACCEPTED);
    app.stop().await;
}

#[tokio::test]
async fn the_keys_in_hand_keep_working_while_the_provider_is_down() {
    let key = TestKey::rsa_a();
    let idp = IdentityProvider::start(&[&key]).await;
    let builder = TestApp::builder().auth(|auth| {
        auth.jwks_refresh_secs = 1;
        auth.jwks_min_refresh_secs = 1;
    });
    let app = spawn_with(builder, &idp).await;
    let sale = app.open_sale(10, 1).await;
    app.reserve_as(&sale.sku, Caller::Token(&key.token("before")))
        .await
        .error_for_status()
        .expect("202 before the outage");

    // Each way of failing, answered at least twice to the refresher, then a
    // user never seen before (so verified with the kept key, not remembered).
    for (i, failure) in ["an error status", "garbage", "an empty key set"]
        .into_iter()
        .enumerate()
    {
        match i {
            0 => idp.answer(Answer::Status(500)),
            1 => idp.answer(Answer::Garbage),
            _ => {
                idp.publish(&[]);
                idp.answer(Answer::Keys);
            }
        }
        let seen = idp.requests();
        eventually(WAIT, failure, || async {
            (idp.requests() >= seen + 2).then_some(())
        })
        .await;
        let resp = app
            .reserve_as(&sale.sku, Caller::Token(&key.token(&format!("during-{i}"))))
            .await;
        assert_eq!(resp.status(), StatusCode::ACCEPTED, "after {failure}");
    }

    // Stopped altogether: a token naming a new key cannot be checked (401), and
    // the keys in hand still work.
    idp.stop().await;
    let msg = refused(
        &app,
        &sale.sku,
        &TestKey::rsa_b().token("newcomer"),
        "a kid the provider cannot be asked about",
    )
    .await;
    assert_eq!(msg, "token key id (kid) is unknown");
    let resp = app
        .reserve_as(&sale.sku, Caller::Token(&key.token("after")))
        .await;
    assert_eq!(
        resp.status(),
        StatusCode::ACCEPTED,
        "after the provider stopped"
    );
    assert_eq!(app.redis_stock(&sale).await, Some(10 - 5));

    let metrics = app.metrics_text().await;
    for outcome in ["unreachable", "invalid"] {
        assert!(
            metrics
                .lines()
                .any(|l| l.starts_with("flashsale_jwks_refreshes_total")
                    && l.contains(&format!("outcome=\"{outcome}\""))),
            "refreshes counted as {outcome}"
        );
    }
    app.stop().await;
}

#[tokio::test]
async fn a_withdrawn_key_stops_verifying_even_remembered_tokens() {
    let (old, new) = (TestKey::ec_a(), TestKey::ec_b());
    let idp = IdentityProvider::start(&[&old, &new]).await;
    let builder = TestApp::builder().auth(|auth| {
        auth.jwks_refresh_secs = 1;
        auth.jwks_min_refresh_secs = 1;
    });
    let app = spawn_with(builder, &idp).await;
    let sale = app.open_sale(10, 1).await;
    let token = old.token("leaver");
    let resp = app.reserve_as(&sale.sku, Caller::Token(&token)).await;
    assert_eq!(resp.status(), StatusCode::ACCEPTED);
    let status = app
        .send(app.api.reservation(&sale.sku, Caller::Token(&token)))
        .await
        .status();
    assert_eq!(status, StatusCode::OK, "remembered");

    idp.publish(&[&new]);
    // Fetches are one at a time: the third answer after the change was asked
    // for after the second was stored, and the second was read after the change.
    let seen = idp.requests();
    eventually(WAIT, "two refreshes after the withdrawal", || async {
        (idp.requests() >= seen + 3).then_some(())
    })
    .await;
    let resp = app
        .send(app.api.reservation(&sale.sku, Caller::Token(&token)))
        .await;
    assert_error(resp, StatusCode::UNAUTHORIZED, "unauthorized").await;
    let status = app
        .reserve_as(&sale.sku, Caller::Token(&new.token("stayer")))
        .await
        .status();
    assert_eq!(
        status,
        StatusCode::ACCEPTED,
        "the key still published works"
    );
    app.stop().await;
}

#[tokio::test]
async fn hs256_can_be_turned_off() {
    let key = TestKey::rsa_a();
    let idp = IdentityProvider::start(&[&key]).await;
    let app = spawn_with(TestApp::builder().auth(|auth| auth.hs256 = false), &idp).await;
    let sale = app.open_sale(10, 1).await;

    let own = flashsale::auth::Auth::new(
        app.settings.auth.admin_token.clone(),
        &app.settings.auth.user_token_secret,
    )
    .expect("signer")
    .issue("hs-user", 600)
    .expect("HS256 token");
    let msg = refused(&app, &sale.sku, &own, "HS256 is off").await;
    assert_eq!(msg, "HS256 tokens are not accepted");
    let resp = app
        .reserve_as(&sale.sku, Caller::Token(&key.token("rs-user")))
        .await;
    assert_eq!(resp.status(), StatusCode::ACCEPTED);
    app.stop().await;
}

#[tokio::test]
async fn public_keys_from_pem_files() {
    let (rsa, ec) = (TestKey::rsa_a(), TestKey::ec_a());
    let dir = tempfile::tempdir().expect("tempdir");
    let mut paths = Vec::new();
    for key in [&rsa, &ec] {
        // The file's stem is the kid tokens name it by.
        let path = dir.path().join(format!("{}.pem", key.kid));
        std::fs::write(&path, key.public_pem).expect("PEM written");
        paths.push(path);
    }
    let app = TestApp::builder()
        .auth(|auth| {
            auth.public_keys = paths;
            auth.issuer = Some(testkit::identity::ISSUER.into());
            auth.audience = Some(testkit::identity::AUDIENCE.into());
        })
        .spawn()
        .await;
    let sale = app.open_sale(10, 1).await;

    let accepted = [
        rsa.token("pem-rs"),
        ec.token("pem-es"),
        ec.sign_as(ec.alg, None, &claims("pem-es-no-kid")),
    ];
    for token in &accepted {
        let resp = app.reserve_as(&sale.sku, Caller::Token(token)).await;
        assert_eq!(resp.status(), StatusCode::ACCEPTED);
    }
    // A key that is in no file, named or not.
    let other = TestKey::rsa_b();
    refused(&app, &sale.sku, &other.token("stranger"), "unknown kid").await;
    let msg = refused(
        &app,
        &sale.sku,
        &other.sign_as(other.alg, None, &claims("stranger")),
        "no kid, no key",
    )
    .await;
    assert_eq!(msg, "token signature is invalid");
    assert_eq!(app.redis_stock(&sale).await, Some(10 - 3));
    app.stop().await;
}

#[tokio::test]
async fn verify_claims_gives_an_operator_token_its_role() {
    let key = TestKey::ec_a();
    let idp = IdentityProvider::start(&[&key]).await;
    let app = spawn_with(TestApp::builder(), &idp).await;

    let mut c = claims("ops-lead");
    c["role"] = json!("operator");
    let verified = app
        .state
        .auth
        .verify_claims(&key.sign(&c))
        .await
        .expect("an operator's token");
    assert_eq!(verified.sub, "ops-lead");
    assert_eq!(verified.role.as_deref(), Some("operator"));
    // The service's own HS256 tokens carry no role, whatever they say.
    let own = app.token("ops-lead");
    assert!(app.state.auth.verify_claims(&own).await.is_err());
    app.stop().await;
}

#[tokio::test]
async fn a_key_replaced_under_the_same_kid_stops_verifying_remembered_tokens() {
    let (old, replacement) = (TestKey::ec_a(), TestKey::ec_b().named("ec-a"));
    let idp = IdentityProvider::start(&[&old]).await;
    let builder = TestApp::builder().auth(|auth| {
        auth.jwks_refresh_secs = 1;
        auth.jwks_min_refresh_secs = 1;
    });
    let app = spawn_with(builder, &idp).await;
    let sale = app.open_sale(10, 1).await;
    let token = old.token("replaced");
    let resp = app.reserve_as(&sale.sku, Caller::Token(&token)).await;
    assert_eq!(resp.status(), StatusCode::ACCEPTED);

    // Same kid, other key material.
    idp.publish(&[&replacement]);
    let seen = idp.requests();
    eventually(WAIT, "two refreshes after the replacement", || async {
        (idp.requests() >= seen + 3).then_some(())
    })
    .await;
    let resp = app
        .send(app.api.reservation(&sale.sku, Caller::Token(&token)))
        .await;
    assert_error(resp, StatusCode::UNAUTHORIZED, "unauthorized").await;
    let status = app
        .reserve_as(&sale.sku, Caller::Token(&replacement.token("newcomer")))
        .await
        .status();
    assert_eq!(status, StatusCode::ACCEPTED, "the new key verifies");
    assert_eq!(app.redis_stock(&sale).await, Some(8));
    app.stop().await;
}

#[tokio::test]
async fn a_redirecting_provider_is_a_failed_fetch() {
    let key = TestKey::rsa_a();
    let idp = IdentityProvider::start(&[&key]).await;
    let elsewhere = IdentityProvider::start(&[&key, &TestKey::rsa_b()]).await;
    let app = spawn_with(TestApp::builder(), &idp).await;
    let sale = app.open_sale(10, 1).await;

    idp.answer(Answer::Redirect(elsewhere.jwks_url.clone()));
    let seen = idp.requests();
    let msg = refused(
        &app,
        &sale.sku,
        &TestKey::rsa_b().token("redirected"),
        "a key only the redirect's target holds",
    )
    .await;
    assert_eq!(msg, "token key id (kid) is unknown");
    assert_eq!(
        idp.requests(),
        seen + 1,
        "the unknown kid asked the provider"
    );
    assert_eq!(elsewhere.requests(), 0, "the redirect was not followed");
    // The keys in hand are kept.
    let resp = app
        .reserve_as(&sale.sku, Caller::Token(&key.token("kept")))
        .await;
    assert_eq!(resp.status(), StatusCode::ACCEPTED);
    app.stop().await;
}

/// User ids as identity providers issue them (API v4): each id is a user of its
/// own, compared byte for byte (`a`, `A`, `a ` and ` a`; `auth0|…` and
/// `auth0_…`), from the `202` through Redis, the broker and the consumer to the
/// order in MySQL and the reservation read back. Ids holding `|` followed by
/// digits look like the separators of Redis's reservation details and must not
/// be mistaken for them. Ids outside the rule are `401`, holding nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn providers_user_ids_are_users_byte_for_byte() {
    let key = TestKey::rsa_a();
    let idp = IdentityProvider::start(&[&key]).await;
    let app = spawn_with(TestApp::builder().workers(), &idp).await;
    let mut users: Vec<String> = [
        "auth0|5f7c8ec7c33c6c004bbafe82",
        "auth0_5f7c8ec7c33c6c004bbafe82",
        "google-oauth2|104117843231219472000",
        "ann@example.com",
        "9b2f6c1e-7d1a-4c8e-9a55-0f1d2c3b4a59",
        "a",
        "A",
        "a ",
        " a",
        "Zoë",
        "用户|7|p",
        "x|1|a",
        "x|1",
    ]
    .into_iter()
    .map(str::to_owned)
    .collect();
    users.push(format!("{}a", "é".repeat(127)));
    assert_eq!(users.last().map(String::len), Some(255));
    let sale = app.open_sale(users.len() as u32, 1).await;
    let tokens: Vec<String> = users.iter().map(|u| key.token(u)).collect();

    let first = reserve_all(&app, &sale.sku, &tokens).await;
    let mut answers = Vec::new();
    for (user, (status, body)) in users.iter().zip(&first) {
        assert_eq!(*status, StatusCode::ACCEPTED, "{user:?}: {body}");
        answers.push(testkit::invariants::Answer {
            status: Some(status.as_u16()),
            code: None,
            reservation_id: body["reservation_id"].as_str().map(str::to_owned),
        });
    }
    // Each holds its own reservation, and only that one.
    for ((user, token), (_, body)) in users.iter().zip(&tokens).zip(&first) {
        let again = app.reserve_as(&sale.sku, Caller::Token(token)).await;
        let again = assert_error(again, StatusCode::CONFLICT, "already_reserved").await;
        assert_eq!(again["reservation_id"], body["reservation_id"], "{user:?}");
        let resp = app
            .send(app.api.reservation(&sale.sku, Caller::Token(token)))
            .await;
        assert_eq!(resp.status(), StatusCode::OK, "{user:?}");
        let state: Value = resp.json().await.expect("JSON");
        assert_eq!(state["reservation_id"], body["reservation_id"], "{user:?}");
    }
    app.wait_for_orders(&sale.id, users.len() as i64).await;
    let mut ordered: Vec<String> =
        sqlx::query_scalar("SELECT CAST(user_id AS CHAR) FROM orders WHERE activity_id = ?")
            .bind(&sale.id)
            .fetch_all(&app.state.pool)
            .await
            .expect("orders");
    ordered.sort();
    users.sort();
    assert_eq!(ordered, users, "one order per id, each id as it was sent");
    let probe = app.probe(&sale);
    probe.wait_quiet(WAIT).await.expect("quiet");
    let figures = probe.check(&answers).await.expect("invariants hold");
    assert_eq!(figures.accepted, users.len(), "{figures:?}");

    // Outside the rule: empty, over 255 bytes, control and bidi characters.
    let other = app.open_sale(10, 1).await;
    for bad in [
        String::new(),
        "a".repeat(256),
        "é".repeat(128),
        "line\nforged".to_owned(),
        "nul\u{0}".to_owned(),
        "c1\u{85}".to_owned(),
        "del\u{7f}".to_owned(),
        "admin\u{202E}gpj.exe".to_owned(),
        "iso\u{2067}late".to_owned(),
    ] {
        let message = refused(&app, &other.sku, &key.token(&bad), &format!("{bad:?}")).await;
        assert!(message.contains("user id"), "{bad:?}: {message}");
    }
    assert_eq!(app.redis_stock(&other).await, Some(10), "nothing held");
    app.stop().await;
}

/// An instance that finds MySQL's user-id columns not widened yet (the release
/// rolled out, `flashsale migrate` not run) accepts only ids the narrow
/// columns hold: a provider's id is `401`, holding nothing, rather than a
/// `202` whose order MySQL could not write.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn providers_ids_wait_for_the_widened_columns() {
    let key = TestKey::rsa_a();
    let idp = IdentityProvider::start(&[&key]).await;
    let migrated = spawn_with(TestApp::builder(), &idp).await;
    let sale = migrated.open_sale(5, 1).await;
    // The columns as the release before left them.
    sqlx::query(
        "ALTER TABLE orders \
         MODIFY user_id VARCHAR(64) CHARACTER SET latin1 COLLATE latin1_general_cs NOT NULL, \
         MODIFY holder VARCHAR(64) CHARACTER SET latin1 COLLATE latin1_general_cs \
         AS (IF(status = 'failed', NULL, user_id)) STORED",
    )
    .execute(&migrated.state.pool)
    .await
    .expect("the columns narrowed");
    let narrow = spawn_with(TestApp::builder().database_of(&migrated), &idp).await;
    let message = refused(&narrow, &sale.sku, &key.token("auth0|abc"), "narrow").await;
    assert!(message.contains("user id"), "{message}");
    assert_eq!(
        narrow
            .reserve_as(&sale.sku, Caller::Token(&key.token("plain_id-1")))
            .await
            .status(),
        StatusCode::ACCEPTED,
        "an id of the narrow form"
    );
    // The instance started on the widened columns accepts it.
    assert_eq!(
        migrated
            .reserve_as(&sale.sku, Caller::Token(&key.token("auth0|abc")))
            .await
            .status(),
        StatusCode::ACCEPTED
    );
    narrow.stop().await;
    migrated.stop().await;
}
