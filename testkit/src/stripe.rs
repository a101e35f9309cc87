//! A fake Stripe for tests, as the identity provider is a fake one: the
//! Checkout Sessions API on loopback port 0 with Stripe's own answers where
//! the service depends on them (a completed session cannot be expired: `400`;
//! an `Idempotency-Key` reused with other parameters: `400
//! idempotency_error`; the same key and parameters: the first answer again,
//! a failure too, marked `Idempotent-Replayed`; a
//! missing required parameter, or an `expires_at` under 30 minutes away:
//! `400`; a wrong secret key: `401`; an unknown session: `404`), a switch to
//! fail or stall, and signed events to deliver to a webhook.
//!
//! ```ignore
//! let stripe = FakeStripe::start("sk_test_fake", "whsec_fake").await;
//! // the service: payments.stripe.api_base = stripe.base()
//! stripe.complete(&session_id, "paid");
//! let (header, body) = stripe.event("checkout.session.completed", &session_id);
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Form, Router};
use serde_json::{json, Value};

/// What the fake answers besides its API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Normal,
    /// Every request answered this status (a `5xx`: Stripe is failing). A
    /// creation's failure is kept under its `Idempotency-Key`, as Stripe
    /// keeps it, and answered again to every try of that key.
    Fail(u16),
    /// Every request held without an answer (Stripe unreachable in time).
    Stall,
}

/// A key's first request: its parameters, and the answer's status and body.
type Kept = (Vec<(String, String)>, StatusCode, Value);

#[derive(Default)]
struct Inner {
    sessions: HashMap<String, Value>,
    /// Idempotency-Key → (the parameters, the answer's status and body): as
    /// Stripe does, a key's first answer is kept, failures included.
    keys: HashMap<String, Kept>,
    /// Requests seen, by "METHOD path-shape".
    seen: HashMap<String, usize>,
    mode: Option<Mode>,
    next: u64,
}

#[derive(Clone)]
struct Shared {
    inner: Arc<Mutex<Inner>>,
    secret_key: String,
}

pub struct FakeStripe {
    base: String,
    shared: Shared,
    webhook_secret: String,
    server: tokio::task::JoinHandle<()>,
}

fn error(status: StatusCode, kind: &str, message: &str) -> Response {
    (
        status,
        axum::Json(json!({ "error": { "type": kind, "message": message } })),
    )
        .into_response()
}

impl FakeStripe {
    pub async fn start(secret_key: &str, webhook_secret: &str) -> Self {
        let shared = Shared {
            inner: Arc::default(),
            secret_key: secret_key.to_owned(),
        };
        let app = Router::new()
            .route("/v1/checkout/sessions", post(create))
            .route("/v1/checkout/sessions/{id}", get(retrieve))
            .route("/v1/checkout/sessions/{id}/expire", post(expire))
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("fake Stripe listens");
        let base = format!("http://{}", listener.local_addr().expect("address"));
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        FakeStripe {
            base,
            shared,
            webhook_secret: webhook_secret.to_owned(),
            server,
        }
    }

    /// `payments.stripe.api_base`.
    pub fn base(&self) -> &str {
        &self.base
    }

    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.shared.inner.lock().expect("fake Stripe state")
    }

    /// How it answers from now on.
    pub fn mode(&self, mode: Mode) {
        self.inner().mode = Some(mode);
    }

    /// Requests seen of one kind: `"POST /v1/checkout/sessions"`,
    /// `"GET /v1/checkout/sessions/{id}"`, `"POST /v1/checkout/sessions/{id}/expire"`.
    pub fn requests(&self, kind: &str) -> usize {
        self.inner().seen.get(kind).copied().unwrap_or(0)
    }

    pub fn session(&self, id: &str) -> Option<Value> {
        self.inner().sessions.get(id).cloned()
    }

    /// Every session made, as Stripe would list them.
    pub fn sessions(&self) -> Vec<Value> {
        self.inner().sessions.values().cloned().collect()
    }

    /// The buyer paid (or paid nothing): the session completes with this
    /// `payment_status` (`paid`, `unpaid` for a delayed method, `no_payment_required`).
    pub fn complete(&self, id: &str, payment_status: &str) {
        let mut inner = self.inner();
        let s = inner.sessions.get_mut(id).expect("a session of the fake");
        s["status"] = json!("complete");
        s["payment_status"] = json!(payment_status);
        s["url"] = Value::Null;
    }

    /// The session ran out unpaid (Stripe's own expiry).
    pub fn lapse(&self, id: &str) {
        let mut inner = self.inner();
        let s = inner.sessions.get_mut(id).expect("a session of the fake");
        s["status"] = json!("expired");
        s["url"] = Value::Null;
    }

    /// A signed event about a session as it stands now: the value of the
    /// `Stripe-Signature` header and the body, signed at `t` (unix seconds).
    pub fn event_at(&self, kind: &str, session_id: &str, t: i64) -> (String, Vec<u8>) {
        let object = self.session(session_id).expect("a session of the fake");
        let id = {
            let mut inner = self.inner();
            inner.next += 1;
            format!("evt_fake{}", inner.next)
        };
        let body = serde_json::to_vec(&json!({
            "id": id,
            "object": "event",
            "type": kind,
            "created": t,
            "data": { "object": object },
        }))
        .expect("event JSON");
        (sign(&self.webhook_secret, t, &body), body)
    }

    /// [`FakeStripe::event_at`] now.
    pub fn event(&self, kind: &str, session_id: &str) -> (String, Vec<u8>) {
        self.event_at(kind, session_id, chrono::Utc::now().timestamp())
    }

    pub fn stop(&self) {
        self.server.abort();
    }
}

impl Drop for FakeStripe {
    fn drop(&mut self) {
        self.server.abort();
    }
}

/// `Stripe-Signature` for `body` at `t`, as Stripe computes it.
pub fn sign(secret: &str, t: i64, body: &[u8]) -> String {
    use hmac::{Hmac, KeyInit, Mac};
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(secret.as_bytes()).expect("any key");
    mac.update(format!("{t}.").as_bytes());
    mac.update(body);
    let hex: String = mac
        .finalize()
        .into_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("t={t},v1={hex}")
}

fn failure(status: u16) -> (StatusCode, Value) {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (
        status,
        json!({ "error": { "type": "api_error", "message": "the fake is failing" } }),
    )
}

/// Counts the request, holds it while stalled, and checks the secret key.
/// `Ok` with the mode (a handler answers a failure itself), or the answer.
async fn gate(shared: &Shared, kind: &str, headers: &HeaderMap) -> Result<Mode, Response> {
    let mode = {
        let mut inner = shared.inner.lock().expect("fake Stripe state");
        *inner.seen.entry(kind.to_owned()).or_insert(0) += 1;
        inner.mode.unwrap_or(Mode::Normal)
    };
    if mode == Mode::Stall {
        std::future::pending::<()>().await;
    }
    let expected = format!("Bearer {}", shared.secret_key);
    if headers.get("authorization").and_then(|v| v.to_str().ok()) != Some(expected.as_str()) {
        return Err(error(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "Invalid API Key provided",
        ));
    }
    Ok(mode)
}

/// [`gate`] for a request that keeps nothing: a failure answered at once.
async fn gate_plain(shared: &Shared, kind: &str, headers: &HeaderMap) -> Option<Response> {
    match gate(shared, kind, headers).await {
        Err(answer) => Some(answer),
        Ok(Mode::Fail(status)) => {
            let (status, body) = failure(status);
            Some((status, axum::Json(body)).into_response())
        }
        Ok(_) => None,
    }
}

async fn create(
    State(shared): State<Shared>,
    headers: HeaderMap,
    Form(params): Form<Vec<(String, String)>>,
) -> Response {
    let mode = match gate(&shared, "POST /v1/checkout/sessions", &headers).await {
        Ok(mode) => mode,
        Err(answer) => return answer,
    };
    let param = |name: &str| {
        params
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let mut inner = shared.inner.lock().expect("fake Stripe state");
    if let Some(key) = &key {
        if let Some((first, status, answer)) = inner.keys.get(key) {
            let (mut a, mut b) = (first.clone(), params.clone());
            a.sort();
            b.sort();
            if a != b {
                return error(
                    StatusCode::BAD_REQUEST,
                    "idempotency_error",
                    "Keys for idempotent requests can only be used with the same parameters they were first used with.",
                );
            }
            return (
                *status,
                [("idempotent-replayed", "true")],
                axum::Json(answer.clone()),
            )
                .into_response();
        }
    }
    if let Mode::Fail(status) = mode {
        let (status, body) = failure(status);
        // Stripe keeps what the endpoint answered (a 5xx, a card's 402),
        // never a rate limit or a conflict met before it ran.
        let kept = status.is_server_error() || status == StatusCode::PAYMENT_REQUIRED;
        if let Some(key) = key.filter(|_| kept) {
            inner.keys.insert(key, (params, status, body.clone()));
        }
        return (status, axum::Json(body)).into_response();
    }
    for required in [
        "mode",
        "success_url",
        "line_items[0][quantity]",
        "line_items[0][price_data][currency]",
        "line_items[0][price_data][unit_amount]",
        "line_items[0][price_data][product_data][name]",
    ] {
        if param(required).is_none() {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                &format!("Missing required param: {required}."),
            );
        }
    }
    let now = chrono::Utc::now().timestamp();
    let expires_at = match param("expires_at").map(|v| v.parse::<i64>()) {
        None => now + 24 * 3600,
        Some(Ok(at)) if at >= now + 30 * 60 && at <= now + 24 * 3600 => at,
        Some(_) => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "The `expires_at` timestamp must be between 30 minutes and 24 hours from Checkout Session creation.",
            )
        }
    };
    inner.next += 1;
    let id = format!("cs_test_fake{}", inner.next);
    let session = json!({
        "id": id,
        "object": "checkout.session",
        "mode": "payment",
        "status": "open",
        "payment_status": "unpaid",
        "url": format!("https://checkout.stripe.test/c/pay/{id}"),
        "client_reference_id": param("client_reference_id"),
        "metadata": {
            "order_id": param("metadata[order_id]"),
            "activity_id": param("metadata[activity_id]"),
        },
        "currency": param("line_items[0][price_data][currency]"),
        "amount_total": param("line_items[0][price_data][unit_amount]")
            .and_then(|a| a.parse::<i64>().ok())
            .zip(param("line_items[0][quantity]").and_then(|q| q.parse::<i64>().ok()))
            .map(|(a, q)| a * q),
        "success_url": param("success_url"),
        "cancel_url": param("cancel_url"),
        "expires_at": expires_at,
        "created": now,
    });
    inner.sessions.insert(id, session.clone());
    if let Some(key) = key {
        inner
            .keys
            .insert(key, (params, StatusCode::OK, session.clone()));
    }
    axum::Json(session).into_response()
}

async fn retrieve(
    State(shared): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    if let Some(answer) = gate_plain(&shared, "GET /v1/checkout/sessions/{id}", &headers).await {
        return answer;
    }
    match shared
        .inner
        .lock()
        .expect("fake Stripe state")
        .sessions
        .get(&id)
    {
        Some(s) => axum::Json(s.clone()).into_response(),
        None => error(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            &format!("No such checkout.session: '{id}'"),
        ),
    }
}

async fn expire(
    State(shared): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    if let Some(answer) =
        gate_plain(&shared, "POST /v1/checkout/sessions/{id}/expire", &headers).await
    {
        return answer;
    }
    let mut inner = shared.inner.lock().expect("fake Stripe state");
    let Some(s) = inner.sessions.get_mut(&id) else {
        return error(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            &format!("No such checkout.session: '{id}'"),
        );
    };
    if s["status"] != "open" {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "Only Checkout Sessions with a status in [\"open\"] can be expired.",
        );
    }
    s["status"] = json!("expired");
    s["url"] = Value::Null;
    axum::Json(s.clone()).into_response()
}
