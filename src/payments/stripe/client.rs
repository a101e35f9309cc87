//! Stripe's Checkout Sessions API, as the provider uses it: create a session
//! for an order, retrieve it, expire it. Every call has a time limit; a
//! network error, a time-out, a `429` or a `5xx` is tried again with
//! backoff, a creation with the same `Idempotency-Key` (Stripe then answers
//! the first creation's session, never a second one); any other answer is the
//! provider's refusal, returned as it came. The secret key goes in the
//! `Authorization` header only and is never logged or shown.

use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;

/// One order's checkout: what the session sells.
#[derive(Debug, Clone)]
pub struct Checkout {
    pub order_id: String,
    pub activity_id: String,
    /// The product's name on Stripe's page.
    pub sku: String,
    pub quantity: u32,
    /// The unit's price in the currency's minor units.
    pub unit_amount: i64,
    /// ISO 4217, lower case.
    pub currency: String,
    pub success_url: String,
    pub cancel_url: String,
}

/// A Checkout Session as Stripe describes it (the fields the service reads).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Session {
    pub id: String,
    /// `open`, `complete` or `expired`.
    pub status: String,
    /// `paid`, `unpaid` or `no_payment_required`.
    pub payment_status: String,
    /// Where the buyer pays (while the session is open).
    pub url: Option<String>,
    pub client_reference_id: Option<String>,
    /// Unix seconds.
    pub expires_at: i64,
}

impl Session {
    /// Whether the buyer's money is in: `paid`, or nothing to pay.
    pub fn is_paid(&self) -> bool {
        matches!(self.payment_status.as_str(), "paid" | "no_payment_required")
    }
}

/// Why a call did not give its answer.
#[derive(Debug, thiserror::Error)]
pub enum StripeError {
    /// Not reached, no answer in time, or only `429`/`5xx` answers: whether a
    /// creation or an expiry took effect is unknown (try again later).
    #[error("Stripe could not be reached: {0}")]
    Unreachable(String),
    /// Stripe answered and refused (`4xx`): nothing changed.
    #[error("Stripe refused ({status}): {message}")]
    Refused {
        status: u16,
        /// Stripe's `error.type` (`invalid_request_error`, `idempotency_error`…).
        kind: String,
        /// Stripe's `error.code`, when it gives one.
        code: Option<String>,
        message: String,
    },
}

/// How a client reaches Stripe.
#[derive(Clone)]
pub struct StripeClient {
    http: reqwest::Client,
    /// `https://api.stripe.com`, or a test double's address.
    base: String,
    secret_key: SecretString,
    attempts: u32,
    first_backoff: Duration,
}

impl std::fmt::Debug for StripeClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StripeClient")
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

#[derive(Deserialize)]
struct ErrorBody {
    error: ErrorDetail,
}

#[derive(Deserialize)]
struct ErrorDetail {
    #[serde(rename = "type", default)]
    kind: String,
    code: Option<String>,
    #[serde(default)]
    message: String,
}

impl StripeClient {
    /// `timeout` bounds each request; a call makes up to `attempts` of them.
    pub fn new(
        base: &str,
        secret_key: SecretString,
        timeout: Duration,
        attempts: u32,
    ) -> anyhow::Result<Self> {
        let http = reqwest::Client::builder()
            .connect_timeout(timeout)
            .timeout(timeout)
            .build()
            .map_err(|e| anyhow::anyhow!("the Stripe HTTP client: {e}"))?;
        Ok(StripeClient {
            http,
            base: base.trim_end_matches('/').to_owned(),
            secret_key,
            attempts: attempts.max(1),
            first_backoff: Duration::from_millis(100),
        })
    }

    /// Creates the order's session (`POST /v1/checkout/sessions`) under
    /// `idempotency_key`: the same key gives the same session, however often
    /// it is tried.
    pub async fn create_session(
        &self,
        c: &Checkout,
        idempotency_key: &str,
    ) -> Result<Session, StripeError> {
        let form: Vec<(&str, String)> = vec![
            ("mode", "payment".into()),
            ("line_items[0][price_data][currency]", c.currency.clone()),
            (
                "line_items[0][price_data][unit_amount]",
                c.unit_amount.to_string(),
            ),
            (
                "line_items[0][price_data][product_data][name]",
                c.sku.clone(),
            ),
            ("line_items[0][quantity]", c.quantity.to_string()),
            ("client_reference_id", c.order_id.clone()),
            ("metadata[order_id]", c.order_id.clone()),
            ("metadata[activity_id]", c.activity_id.clone()),
            ("success_url", c.success_url.clone()),
            ("cancel_url", c.cancel_url.clone()),
        ];
        let url = format!("{}/v1/checkout/sessions", self.base);
        self.call(|| {
            self.http
                .post(&url)
                .header("Idempotency-Key", idempotency_key)
                .form(&form)
        })
        .await
    }

    /// `GET /v1/checkout/sessions/{id}`.
    pub async fn retrieve_session(&self, id: &str) -> Result<Session, StripeError> {
        let url = format!("{}/v1/checkout/sessions/{id}", self.base);
        self.call(|| self.http.get(&url)).await
    }

    /// `POST /v1/checkout/sessions/{id}/expire`: refused (`400`) once the
    /// session is no longer open (completed, or expired already).
    pub async fn expire_session(&self, id: &str) -> Result<Session, StripeError> {
        let url = format!("{}/v1/checkout/sessions/{id}/expire", self.base);
        self.call(|| self.http.post(&url)).await
    }

    async fn call(
        &self,
        request: impl Fn() -> reqwest::RequestBuilder,
    ) -> Result<Session, StripeError> {
        let mut backoff = self.first_backoff;
        let mut last = String::new();
        for attempt in 1..=self.attempts {
            if attempt > 1 {
                // Up to half again, so that many callers do not retry in step.
                let jitter =
                    backoff.mul_f64(f64::from(uuid::Uuid::new_v4().as_u128() as u16) / 131_070.0);
                tokio::time::sleep(backoff + jitter).await;
                backoff *= 2;
            }
            let sent = request()
                .bearer_auth(self.secret_key.expose_secret())
                .send()
                .await;
            let answer = match sent {
                Ok(answer) => answer,
                Err(err) => {
                    // reqwest's error names the URL, never the headers.
                    last = err.to_string();
                    continue;
                }
            };
            let status = answer.status();
            let body = match answer.bytes().await {
                Ok(body) => body,
                Err(err) => {
                    last = err.to_string();
                    continue;
                }
            };
            if status.is_success() {
                return serde_json::from_slice(&body).map_err(|e| {
                    StripeError::Unreachable(format!("an answer that is not a session: {e}"))
                });
            }
            if status.as_u16() == 429 || status.is_server_error() {
                last = format!("{status}");
                continue;
            }
            let detail = serde_json::from_slice::<ErrorBody>(&body)
                .ok()
                .map(|b| b.error);
            return Err(StripeError::Refused {
                status: status.as_u16(),
                kind: detail.as_ref().map(|d| d.kind.clone()).unwrap_or_default(),
                code: detail.as_ref().and_then(|d| d.code.clone()),
                message: detail
                    .map(|d| d.message)
                    .unwrap_or_else(|| format!("{status}")),
            });
        }
        Err(StripeError::Unreachable(format!(
            "{} attempts, the last: {last}",
            self.attempts
        )))
    }
}
