//! The HTTP API: routes and the layers in front of them.
//!
//! Outermost first: client address → request id (always the service's own; a
//! client's `X-Request-Id` is kept beside it) → trace span → metrics → load
//! shedding, global concurrency limit and timeout → per-IP rate limit → routes.
//! User routes add authentication and then the per-user rate limit; admin routes
//! name the operator (`operators`) and record every change in the audit trail
//! (`audit`).

mod admin;
mod audit;
mod body;
mod client_ip;
mod flash;
pub mod middleware;
mod openapi;
mod ops;
mod orders;
mod page;

use std::sync::Arc;
use std::time::Duration;

use axum::error_handling::HandleErrorLayer;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use axum::Router;
use tokio::sync::Semaphore;
use tower::limit::GlobalConcurrencyLimitLayer;
use tower::ServiceBuilder;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::TraceLayer;

use crate::config::ServerSettings;
use crate::error::AppError;
use crate::state::AppState;

pub use client_ip::ClientIp;

pub use middleware::RateLimiters;
pub use openapi::ApiDoc;
pub use ops::healthz;

pub fn router(state: AppState, limiters: &RateLimiters) -> Router {
    let settings = &state.settings.server;

    let mut user_routes = Router::new()
        .route("/flash/{sku}/reserve", post(flash::reserve))
        .route("/flash/{sku}/reservation", get(flash::reservation))
        .route(
            "/flash/{sku}/queue",
            post(flash::join_queue).get(flash::queue_status),
        )
        .route("/orders/{order_id}/pay", post(orders::pay));
    if let Some(per_user) = limiters.per_user_layer() {
        user_routes = user_routes.layer(per_user);
    }
    let user_routes = user_routes.layer(axum::middleware::from_fn_with_state(
        state.clone(),
        middleware::require_user,
    ));

    let admin_routes = Router::new()
        .route("/admin/activities", post(admin::create).get(admin::list))
        .route("/admin/activities/{id}", get(admin::get))
        .route("/admin/activities/{id}/preload", post(admin::preload))
        .route("/admin/activities/{id}/pause", post(admin::pause))
        .route("/admin/activities/{id}/resume", post(admin::resume))
        .route("/admin/activities/{id}/reconcile", post(admin::reconcile))
        .route("/admin/activities/{id}/stock", post(admin::top_up))
        .route("/admin/audit", get(audit::list))
        // Inner: every admin request that changes something is recorded, with
        // the operator the outer layer named.
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            audit::record,
        ))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            middleware::require_admin,
        ));

    let mut app = Router::new()
        .route("/flash/{sku}", get(flash::status))
        // The buyer's page is user traffic like the status it polls: behind the
        // per-IP limit and the load shedding, unlike the operators' page.
        .route("/buy/{sku}", get(page::buyer))
        .merge(user_routes)
        .merge(admin_routes)
        .fallback(|| async { AppError::not_found("no such endpoint") })
        .method_not_allowed_fallback(|| async { AppError::MethodNotAllowed });
    if let Some(per_ip) = limiters.per_ip_layer() {
        app = app.layer(per_ip);
    }

    let ops = probes()
        // Operations endpoints stay outside the load shedding and rate limits, so a
        // saturated instance can still be probed and scraped; `/readyz` and
        // `/metrics` answer from what the background work last read, so a flood
        // of them costs the dependencies nothing.
        .route("/admin/ui", get(admin::ui))
        .route("/openapi.json", get(openapi::openapi_json))
        .route("/docs", get(openapi::docs));
    observe(protect(app, settings).merge(ops), settings).with_state(state)
}

/// What orchestrators and Prometheus call: liveness, readiness, metrics.
fn probes() -> Router<AppState> {
    Router::new()
        .route("/healthz", get(ops::healthz))
        .route("/readyz", get(ops::readyz))
        .route("/metrics", get(ops::metrics))
}

/// Requests the operations listener serves at once; more are answered `503
/// overloaded` at once. Its callers are an orchestrator and a few scrapers, so
/// this is far above their need, and a flood at the port (a misconfigured
/// scraper, a scan) cannot pile up tasks, each holding a check's connection.
pub const OPS_MAX_IN_FLIGHT: usize = 32;

/// The listener of `server.ops_addr`: the probes and nothing else (no API, no
/// authenticated endpoint), for a port only the orchestrator and Prometheus reach.
/// Liveness stays outside the bound: it costs nothing, and an orchestrator
/// whose probe was shed would restart an instance that is alive.
pub fn ops_router(state: AppState) -> Router {
    let settings = &state.settings.server;
    let bounded = Router::new()
        .route("/readyz", get(ops::readyz))
        .route("/metrics", get(ops::metrics))
        .fallback(|| async { AppError::not_found("no such endpoint") })
        .method_not_allowed_fallback(|| async { AppError::MethodNotAllowed });
    let probes = limit(
        bounded,
        OPS_MAX_IN_FLIGHT,
        Duration::from_millis(settings.request_timeout_ms),
    )
    .route("/healthz", get(ops::healthz));
    observe(probes, settings).with_state(state)
}

/// Load shedding, a global concurrency limit and a timeout, answering in the API's
/// error shape. One semaphore for the whole router: `Router::layer` clones a layer
/// per route, and a plain ConcurrencyLimitLayer would then limit each route
/// separately.
pub fn protect<S>(router: Router<S>, settings: &ServerSettings) -> Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    limit(
        router,
        settings.max_concurrency,
        Duration::from_millis(settings.request_timeout_ms),
    )
}

/// At most `in_flight` requests at once over the whole router (more are shed,
/// `503 overloaded`), each within `timeout`.
fn limit<S>(router: Router<S>, in_flight: usize, timeout: Duration) -> Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    let in_flight = Arc::new(Semaphore::new(in_flight));
    router.layer(
        ServiceBuilder::new()
            .layer(HandleErrorLayer::new(middleware::overloaded))
            .load_shed()
            .layer(GlobalConcurrencyLimitLayer::with_semaphore(in_flight))
            .timeout(timeout),
    )
}

/// The outermost layers of every route: the body limit, request metrics, and a
/// request id of the service's own carried by the trace span and echoed in the
/// answer (a client's `X-Request-Id` is set aside first, so it never becomes
/// the request's id).
pub fn observe<S>(router: Router<S>, settings: &ServerSettings) -> Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    router
        .layer(DefaultBodyLimit::max(settings.body_limit_bytes))
        .layer(axum::middleware::from_fn(middleware::track_metrics))
        .layer(
            ServiceBuilder::new()
                .layer(SetRequestIdLayer::x_request_id(MakeRequestUuid))
                .layer(TraceLayer::new_for_http().make_span_with(middleware::make_span))
                .layer(PropagateRequestIdLayer::x_request_id()),
        )
        .layer(axum::middleware::from_fn(middleware::client_request_id))
        .layer(axum::middleware::from_fn_with_state(
            settings.trusted_proxies.clone(),
            client_ip::resolve,
        ))
}
