//! Stripe's Checkout Sessions API, as the provider uses it: create a session
//! for an order, retrieve it, expire it. Every request has a time limit.
//! What is tried again, with backoff (capped, with jitter, after the
//! `Retry-After` Stripe asks for; a longer wait ends the call): a network
//! error or time-out, `409` (the same
//! `Idempotency-Key` still being served), `429`, and a `5xx`; but never what
//! Stripe's `Stripe-Should-Retry: false` says not to, and never a `5xx` that
//! Stripe replays from an earlier try of the same key (`Idempotent-Replayed`:
//! Stripe keeps a key's first answer, failures included, so only a new key
//! can succeed: [`StripeError::KeyUsedUp`]). A creation is tried again under
//! the same key, so Stripe answers the first creation's session, never a
//! second one. Any other answer is Stripe's refusal, returned as it came. The
//! secret key goes in the `Authorization` header only and is never shown.

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
    /// Stripe keeps a failure under this `Idempotency-Key` and answers it to
    /// every try: a new key is needed.
    #[error("Stripe keeps a failure ({0}) under this Idempotency-Key")]
    KeyUsedUp(u16),
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

/// The most requests one call makes.
pub const MAX_ATTEMPTS: u32 = 10;
/// The longest wait between two of them.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

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
        if attempts > MAX_ATTEMPTS {
            anyhow::bail!("at most {MAX_ATTEMPTS} attempts per call to Stripe, not {attempts}");
        }
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
        let url = format!("{}/v1/checkout/sessions/{}", self.base, session_id(id)?);
        self.call(|| self.http.get(&url)).await
    }

    /// `POST /v1/checkout/sessions/{id}/expire`: refused (`400`) once the
    /// session is no longer open (completed, or expired already).
    pub async fn expire_session(&self, id: &str) -> Result<Session, StripeError> {
        let url = format!(
            "{}/v1/checkout/sessions/{}/expire",
            self.base,
            session_id(id)?
        );
        self.call(|| self.http.post(&url)).await
    }

    async fn call(
        &self,
        request: impl Fn() -> reqwest::RequestBuilder,
    ) -> Result<Session, StripeError> {
        let mut backoff = self.first_backoff;
        let mut asked: Option<Duration> = None;
        let mut last = String::new();
        for attempt in 1..=self.attempts {
            if attempt > 1 {
                // Up to half again, so that many callers do not retry in step;
                // never less than Stripe asked for, never more than the cap.
                let jitter =
                    backoff.mul_f64(f64::from(uuid::Uuid::new_v4().as_u128() as u16) / 131_070.0);
                let wait = asked.take().unwrap_or_default().max(backoff + jitter);
                tokio::time::sleep(wait.min(MAX_BACKOFF)).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
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
            let header = |name: &str| {
                answer
                    .headers()
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned)
            };
            let should_retry = header("stripe-should-retry");
            let replayed = header("idempotent-replayed").as_deref() == Some("true");
            asked = header("retry-after")
                .and_then(|s| s.parse::<u64>().ok())
                .map(Duration::from_secs);
            // A wait longer than this call may take: asking again sooner would
            // only land inside it.
            if asked.is_some_and(|wait| wait > MAX_BACKOFF) {
                return Err(StripeError::Unreachable(format!(
                    "{status}, asked to wait {}s",
                    asked.unwrap_or_default().as_secs()
                )));
            }
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
            if status.is_server_error() && replayed {
                return Err(StripeError::KeyUsedUp(status.as_u16()));
            }
            let again = match should_retry.as_deref() {
                Some("true") => true,
                Some("false") => false,
                _ => matches!(status.as_u16(), 409 | 429) || status.is_server_error(),
            };
            if again {
                last = format!("{status}");
                continue;
            }
            if status.is_server_error() {
                return Err(StripeError::Unreachable(format!(
                    "{status}, not to be tried again"
                )));
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

/// A session id as Stripe makes them (`cs_…`), safe in a URL's path.
fn session_id(id: &str) -> Result<&str, StripeError> {
    let fine = !id.is_empty()
        && id.len() <= 255
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    if fine {
        Ok(id)
    } else {
        Err(StripeError::Refused {
            status: 400,
            kind: "invalid_request_error".into(),
            code: None,
            message: "not a Checkout Session id".into(),
        })
    }
}
