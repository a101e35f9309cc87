//! The Stripe client (`payments::stripe::client`) against the test kit's fake
//! Stripe: one session per idempotency key, Stripe's refusals passed on as
//! they came, a Stripe that is down or silent tried again and then reported
//! unreachable, and the fake's signed events accepted by the service's own
//! signature check.

use std::time::{Duration, Instant};

use flashsale::payments::stripe::client::{Checkout, StripeClient, StripeError};
use flashsale::payments::stripe::signature;
use secrecy::SecretString;
use testkit::stripe::{FakeStripe, Mode};

const KEY: &str = "sk_test_fake_key";
const WEBHOOK: &str = "whsec_fake_secret";

fn client(stripe: &FakeStripe, key: &str, timeout_ms: u64, attempts: u32) -> StripeClient {
    StripeClient::new(
        stripe.base(),
        SecretString::from(key),
        Duration::from_millis(timeout_ms),
        attempts,
    )
    .expect("client")
}

fn checkout(order: &str, quantity: u32) -> Checkout {
    Checkout {
        order_id: order.into(),
        activity_id: "launch-1".into(),
        sku: "sku-1".into(),
        quantity,
        unit_amount: 1999,
        currency: "usd".into(),
        success_url: "https://shop.test/paid".into(),
        cancel_url: "https://shop.test/cancelled".into(),
    }
}

#[tokio::test]
async fn one_session_per_key_carrying_the_order() {
    let stripe = FakeStripe::start(KEY, WEBHOOK).await;
    let c = client(&stripe, KEY, 2000, 3);
    let first = c
        .create_session(&checkout("42", 2), "shop:42:1")
        .await
        .expect("created");
    assert_eq!(
        (first.status.as_str(), first.payment_status.as_str()),
        ("open", "unpaid")
    );
    assert!(first.url.is_some());
    let again = c
        .create_session(&checkout("42", 2), "shop:42:1")
        .await
        .expect("replayed");
    assert_eq!(again, first, "the same key, the same session");
    assert_eq!(stripe.sessions().len(), 1);
    let s = stripe.session(&first.id).expect("stored");
    assert_eq!(s["client_reference_id"], "42");
    assert_eq!(s["metadata"]["order_id"], "42");
    assert_eq!(s["metadata"]["activity_id"], "launch-1");
    assert_eq!(
        (s["currency"].as_str(), s["amount_total"].as_i64()),
        (Some("usd"), Some(3998))
    );
    // The key reused with other parameters: Stripe's 400, nothing made.
    match c.create_session(&checkout("42", 1), "shop:42:1").await {
        Err(StripeError::Refused {
            status: 400, kind, ..
        }) => assert_eq!(kind, "idempotency_error"),
        other => panic!("{other:?}"),
    }
    assert_eq!(stripe.sessions().len(), 1);
}

#[tokio::test]
async fn a_completed_session_cannot_be_expired_and_reads_paid() {
    let stripe = FakeStripe::start(KEY, WEBHOOK).await;
    let c = client(&stripe, KEY, 2000, 3);
    let open = c
        .create_session(&checkout("7", 1), "shop:7:1")
        .await
        .expect("created");
    let done = c
        .create_session(&checkout("8", 1), "shop:8:1")
        .await
        .expect("created");
    stripe.complete(&done.id, "paid");
    let expired = c
        .expire_session(&open.id)
        .await
        .expect("an open session expires");
    assert_eq!(expired.status, "expired");
    assert!(!expired.is_paid());
    match c.expire_session(&done.id).await {
        Err(StripeError::Refused {
            status: 400, kind, ..
        }) => assert_eq!(kind, "invalid_request_error"),
        other => panic!("{other:?}"),
    }
    let read = c.retrieve_session(&done.id).await.expect("retrieved");
    assert!(read.is_paid() && read.status == "complete", "{read:?}");
    assert!(matches!(
        c.retrieve_session("cs_unknown").await,
        Err(StripeError::Refused { status: 404, .. })
    ));
    assert!(matches!(
        client(&stripe, "sk_wrong", 2000, 3)
            .retrieve_session(&done.id)
            .await,
        Err(StripeError::Refused { status: 401, .. })
    ));
}

/// Stripe failing: tried again, then reported; a failure Stripe keeps under
/// a key is answered to that key for good, so only a new key succeeds.
#[tokio::test]
async fn stripe_failing_or_silent_is_tried_again_then_reported() {
    let stripe = FakeStripe::start(KEY, WEBHOOK).await;
    let c = client(&stripe, KEY, 300, 3);
    let create = "POST /v1/checkout/sessions";
    let retrieve = "GET /v1/checkout/sessions/{id}";
    stripe.mode(Mode::Fail(503));
    assert!(matches!(
        c.retrieve_session("cs_any").await,
        Err(StripeError::Unreachable(_))
    ));
    assert_eq!(stripe.requests(retrieve), 3, "tried three times");
    // A creation's failure is kept under its key: the next try is answered
    // the same, marked replayed, and not tried again.
    assert!(matches!(
        c.create_session(&checkout("9", 1), "shop:9:1").await,
        Err(StripeError::KeyUsedUp(503))
    ));
    assert_eq!(
        stripe.requests(create),
        2,
        "the first try, and one replayed"
    );
    // A refusal is not tried again.
    stripe.mode(Mode::Fail(402));
    assert!(matches!(
        c.retrieve_session("cs_any").await,
        Err(StripeError::Refused { status: 402, .. })
    ));
    assert_eq!(stripe.requests(retrieve), 4);
    // Silent: each of the three tries ends at the time limit.
    stripe.mode(Mode::Stall);
    let started = Instant::now();
    assert!(matches!(
        c.retrieve_session("cs_any").await,
        Err(StripeError::Unreachable(_))
    ));
    let took = started.elapsed();
    assert_eq!(stripe.requests(retrieve), 7);
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(5),
        "{took:?}"
    );
    // Back: the used-up key still answers its failure; a new key makes the
    // one session, however often it is tried.
    stripe.mode(Mode::Normal);
    assert!(matches!(
        c.create_session(&checkout("9", 1), "shop:9:1").await,
        Err(StripeError::KeyUsedUp(503))
    ));
    c.create_session(&checkout("9", 1), "shop:9:2")
        .await
        .expect("created");
    c.create_session(&checkout("9", 1), "shop:9:2")
        .await
        .expect("replayed");
    assert_eq!(stripe.sessions().len(), 1);
    // What is not a session id never reaches Stripe.
    assert!(matches!(
        c.retrieve_session("../customers").await,
        Err(StripeError::Refused { status: 400, .. })
    ));
    assert_eq!(stripe.requests(retrieve), 7);
}

#[tokio::test]
async fn the_fakes_events_pass_the_services_signature_check() {
    let stripe = FakeStripe::start(KEY, WEBHOOK).await;
    let c = client(&stripe, KEY, 2000, 1);
    let s = c
        .create_session(&checkout("5", 1), "shop:5:1")
        .await
        .expect("created");
    stripe.complete(&s.id, "paid");
    let now = chrono::Utc::now().timestamp();
    let (header, body) = stripe.event_at("checkout.session.completed", &s.id, now);
    assert_eq!(
        signature::verify(&header, &body, WEBHOOK.as_bytes(), now),
        Ok(())
    );
    assert_eq!(
        signature::verify(&header, &body, b"whsec_other", now),
        Err(signature::SignatureError::Mismatch)
    );
    let event: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
    assert_eq!(event["data"]["object"]["payment_status"], "paid");
}
