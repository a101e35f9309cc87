//! Request-level layers: identity, rate limits, metrics, tracing, overload.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderValue, Response};
use axum::middleware::Next;
use axum::response::IntoResponse;
use governor::middleware::NoOpMiddleware;
use tower::BoxError;
use tower_governor::governor::{GovernorConfig, GovernorConfigBuilder};
use tower_governor::key_extractor::KeyExtractor;

use super::client_ip::{ClientIp, ClientIpKeyExtractor};
use tower_governor::{GovernorError, GovernorLayer};
use tracing::Span;

use crate::auth::User;
use crate::config::RateLimitSettings;
use crate::error::AppError;
use crate::state::AppState;
use crate::telemetry;

/// Verifies the user's token and hands the user to the handlers (and to the
/// per-user rate limit, which runs after this).
pub async fn require_user(
    State(state): State<AppState>,
    mut req: Request,
    next: Next,
) -> Result<Response<Body>, AppError> {
    let user = state.auth.user(req.headers()).await?;
    Span::current().record("user_id", &*user.id);
    req.extensions_mut().insert(user);
    Ok(next.run(req).await)
}

/// Names the operator behind the admin credential (`operators`) and hands them
/// to the audit layer and the handlers.
pub async fn require_admin(
    State(state): State<AppState>,
    mut req: Request,
    next: Next,
) -> Result<Response<Body>, AppError> {
    let operator = state.operators.identify(&state.auth, req.headers()).await?;
    req.extensions_mut().insert(operator);
    Ok(next.run(req).await)
}

/// The `X-Request-Id` a client sent, kept beside the service's own request id
/// (the audit trail's `client_request_id`, the span's `client_request_id`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientRequestId(pub Arc<str>);

/// The longest client `X-Request-Id` kept.
pub const CLIENT_REQUEST_ID_CHARS: usize = 128;

/// Takes the client's `X-Request-Id` out of the request, so that
/// `SetRequestIdLayer`, next, always gives the request an id of the service's
/// own: a client cannot choose the id its request is logged, traced, answered
/// and audited under (nor make two requests share one). The client's value is
/// kept beside it as a `ClientRequestId` when it is 1 to 128 visible ASCII
/// characters; anything else is dropped.
pub async fn client_request_id(mut req: Request, next: Next) -> Response<Body> {
    let sent = req
        .headers_mut()
        .remove("x-request-id")
        .and_then(|v| client_id_of(&v));
    if let Some(id) = sent {
        req.extensions_mut().insert(ClientRequestId(id));
    }
    next.run(req).await
}

/// A client's request id worth keeping: 1 to `CLIENT_REQUEST_ID_CHARS`
/// visible ASCII characters (no space, no control character).
fn client_id_of(value: &HeaderValue) -> Option<Arc<str>> {
    let bytes = value.as_bytes();
    if !(1..=CLIENT_REQUEST_ID_CHARS).contains(&bytes.len())
        || !bytes.iter().all(u8::is_ascii_graphic)
    {
        return None;
    }
    // Visible ASCII is UTF-8, so `to_str` cannot refuse what passed.
    value.to_str().ok().map(Arc::from)
}

/// The span of one request: method, matched route and the service's request id
/// set by `SetRequestIdLayer`, so every log line of the request carries its id,
/// the client's own id when it sent one (`client_request_id`), and, while
/// traces are on, its trace's id (`trace_id`), the caller's trace continued
/// (see `telemetry::trace_request`).
pub fn make_span(req: &Request) -> Span {
    let request_id = req
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-");
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(MatchedPath::as_str)
        .unwrap_or_else(|| req.uri().path());
    let client_ip = req
        .extensions()
        .get::<ClientIp>()
        .map_or_else(|| "-".to_owned(), |c| c.0.to_string());
    let span = tracing::info_span!(
        "request",
        method = %req.method(),
        route,
        request_id,
        client_request_id = tracing::field::Empty,
        client_ip,
        user_id = tracing::field::Empty,
        trace_id = tracing::field::Empty,
        otel.name = tracing::field::Empty,
        otel.kind = tracing::field::Empty,
        http.response.status_code = tracing::field::Empty,
    );
    if let Some(ClientRequestId(id)) = req.extensions().get::<ClientRequestId>() {
        span.record("client_request_id", &**id);
    }
    telemetry::trace_request(&span, || format!("{} {route}", req.method()));
    span
}

/// Counts requests by route and status and records their latency.
pub async fn track_metrics(req: Request, next: Next) -> Response<Body> {
    let started = Instant::now();
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| "unmatched".to_owned());
    let method = req.method().as_str().to_owned();
    let response = next.run(req).await;
    if telemetry::traces_enabled() {
        Span::current().record("http.response.status_code", response.status().as_u16());
    }
    let status = response.status().as_u16().to_string();
    metrics::counter!("flashsale_http_requests_total", "method" => method.clone(), "route" => route.clone(), "status" => status)
        .increment(1);
    metrics::histogram!("flashsale_http_request_duration_seconds", "method" => method, "route" => route)
        .record(started.elapsed().as_secs_f64());
    response
}

/// Load shedding and timeouts end here, in the documented error shape.
pub async fn overloaded(err: BoxError) -> AppError {
    if err.is::<tower::timeout::error::Elapsed>() {
        AppError::Unavailable("the request took too long")
    } else if err.is::<tower::load_shed::error::Overloaded>() {
        metrics::counter!("flashsale_http_requests_shed_total").increment(1);
        AppError::Unavailable("the service is overloaded")
    } else {
        AppError::Internal(anyhow::anyhow!("unhandled middleware error: {err}"))
    }
}

/// Keys the per-user bucket by the authenticated user id.
#[derive(Debug, Clone, Copy)]
pub struct UserKeyExtractor;

impl KeyExtractor for UserKeyExtractor {
    type Key = Arc<str>;

    fn extract<T>(&self, req: &axum::http::Request<T>) -> Result<Self::Key, GovernorError> {
        req.extensions()
            .get::<User>()
            .map(|u| u.id.clone())
            .ok_or(GovernorError::UnableToExtractKey)
    }
}

fn rate_limited(err: GovernorError) -> Response<Body> {
    match err {
        GovernorError::TooManyRequests { wait_time, .. } => {
            metrics::counter!("flashsale_rate_limited_total").increment(1);
            AppError::RateLimited {
                retry_after_secs: wait_time.max(1),
            }
            .into_response()
        }
        other => {
            AppError::Internal(anyhow::anyhow!("rate limiter failed: {other}")).into_response()
        }
    }
}

/// The token buckets, built once so their state is shared by every route and can be
/// pruned in the background.
#[derive(Clone, Default)]
pub struct RateLimiters {
    per_ip: Option<Arc<GovernorConfig<ClientIpKeyExtractor, NoOpMiddleware>>>,
    per_user: Option<Arc<GovernorConfig<UserKeyExtractor, NoOpMiddleware>>>,
    /// The shorter time an empty bucket of either takes to fill up again.
    refill: Option<Duration>,
}

/// One token every `1 / per_sec` seconds.
fn period(per_sec: u32) -> Duration {
    Duration::from_nanos(1_000_000_000 / u64::from(per_sec.max(1)))
}

impl RateLimiters {
    pub fn new(settings: &RateLimitSettings) -> Self {
        let per_ip = (settings.per_ip_per_sec > 0)
            .then(|| {
                GovernorConfigBuilder::default()
                    .key_extractor(ClientIpKeyExtractor)
                    .period(period(settings.per_ip_per_sec))
                    .burst_size(settings.per_ip_burst)
                    .finish()
            })
            .flatten()
            .map(Arc::new);
        let per_user = (settings.per_user_per_sec > 0)
            .then(|| {
                GovernorConfigBuilder::default()
                    .key_extractor(UserKeyExtractor)
                    .period(period(settings.per_user_per_sec))
                    .burst_size(settings.per_user_burst)
                    .finish()
            })
            .flatten()
            .map(Arc::new);
        let refill = |per_sec: u32, burst: u32| period(per_sec) * burst;
        let refill = [
            per_ip
                .as_ref()
                .map(|_| refill(settings.per_ip_per_sec, settings.per_ip_burst)),
            per_user
                .as_ref()
                .map(|_| refill(settings.per_user_per_sec, settings.per_user_burst)),
        ]
        .into_iter()
        .flatten()
        .min();
        RateLimiters {
            per_ip,
            per_user,
            refill,
        }
    }

    pub fn per_ip_layer(
        &self,
    ) -> Option<GovernorLayer<ClientIpKeyExtractor, NoOpMiddleware, Body>> {
        self.per_ip
            .clone()
            .map(|c| GovernorLayer::new(c).error_handler(rate_limited))
    }

    pub fn per_user_layer(&self) -> Option<GovernorLayer<UserKeyExtractor, NoOpMiddleware, Body>> {
        self.per_user
            .clone()
            .map(|c| GovernorLayer::new(c).error_handler(rate_limited))
    }

    /// How often to [`prune`](Self::prune): the shorter time a bucket takes to
    /// fill up again from empty (burst × period), within 1 s and 60 s. A key
    /// pruned is one whose bucket is full again (below), so after each pruning
    /// a limiter keeps only the clients allowed a request within about one
    /// refill time, and between prunings adds those seen since: at most the
    /// clients active within about two refill times (5 s for users, 4 s for
    /// IPs with the defaults), whatever the number of clients ever seen.
    pub fn prune_every(&self) -> Duration {
        self.refill
            .unwrap_or(Duration::from_secs(60))
            .clamp(Duration::from_secs(1), Duration::from_secs(60))
    }

    /// Forgets buckets that are full again, so memory follows the active clients,
    /// not every client ever seen. Lossless: governor's `retain_recent` drops a
    /// key only when its theoretical arrival time is at least one period in the
    /// past, and a bucket in that state admits exactly what a fresh one does (a
    /// full burst), so a client over their limit is never forgotten while it
    /// still limits them.
    pub fn prune(&self) {
        if let Some(c) = &self.per_ip {
            c.limiter().retain_recent();
            c.limiter().shrink_to_fit();
        }
        if let Some(c) = &self.per_user {
            c.limiter().retain_recent();
            c.limiter().shrink_to_fit();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limiters(per_user_per_sec: u32, per_user_burst: u32) -> RateLimiters {
        RateLimiters::new(&RateLimitSettings {
            per_ip_per_sec: 0,
            per_ip_burst: 0,
            per_user_per_sec,
            per_user_burst,
        })
    }

    fn allowed(l: &RateLimiters, user: &str) -> bool {
        let c = l.per_user.as_ref().expect("a per-user limiter");
        c.limiter().check_key(&Arc::from(user)).is_ok()
    }

    fn users(l: &RateLimiters) -> usize {
        l.per_user.as_ref().map_or(0, |c| c.limiter().len())
    }

    /// A user at their limit is still limited right after a pruning: their
    /// bucket is not full, so it is kept.
    #[test]
    fn pruning_never_lets_a_limited_user_through() {
        let l = limiters(1, 3);
        for _ in 0..3 {
            assert!(allowed(&l, "greedy"));
        }
        assert!(!allowed(&l, "greedy"), "the burst is spent");
        l.prune();
        assert_eq!(users(&l), 1, "a bucket that is not full is kept");
        assert!(!allowed(&l, "greedy"), "still limited after the pruning");
        assert!(allowed(&l, "another"), "another user has their own bucket");
    }

    /// Buckets full again are forgotten: memory follows the active users.
    #[test]
    fn pruning_forgets_full_buckets_only() {
        // One token every 5 ms, a burst of 2: full again 15 ms after the last
        // request at most.
        let l = limiters(200, 2);
        for i in 0..1_000 {
            assert!(allowed(&l, &format!("user-{i}")));
        }
        assert!(allowed(&l, "active"));
        assert!(allowed(&l, "active"));
        assert!(!allowed(&l, "active"));
        assert_eq!(users(&l), 1_001);
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while users(&l) > 0 {
            assert!(std::time::Instant::now() < deadline, "{} kept", users(&l));
            std::thread::sleep(Duration::from_millis(5));
            l.prune();
        }
        // Forgotten means fresh: a full burst again, as for a new user.
        assert!(allowed(&l, "active"));
        assert!(allowed(&l, "active"));
        assert!(!allowed(&l, "active"));
    }

    #[test]
    fn a_client_request_id_is_kept_only_when_short_and_visible() {
        let kept = |text: &str| {
            let value = HeaderValue::from_str(text).expect("a header value");
            client_id_of(&value).map(|id| id.to_string())
        };
        assert_eq!(kept("req-123").as_deref(), Some("req-123"));
        let longest = "a".repeat(CLIENT_REQUEST_ID_CHARS);
        assert_eq!(kept(&longest), Some(longest.clone()));
        assert_eq!(kept(&format!("{longest}b")), None, "too long");
        assert_eq!(kept(""), None);
        assert_eq!(kept("two words"), None);
        assert_eq!(kept("tab\there"), None);
        let opaque = HeaderValue::from_bytes(b"caf\xc3\xa9").expect("a header value");
        assert_eq!(client_id_of(&opaque), None, "not ASCII");
    }

    #[test]
    fn pruning_follows_the_refill_time() {
        assert_eq!(limiters(2, 5).prune_every(), Duration::from_millis(2_500));
        assert_eq!(limiters(1_000, 1).prune_every(), Duration::from_secs(1));
        assert_eq!(limiters(1, 600).prune_every(), Duration::from_secs(60));
        assert_eq!(limiters(0, 0).prune_every(), Duration::from_secs(60));
    }
}
