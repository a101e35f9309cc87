//! Operations endpoints: liveness, readiness, metrics.

use std::time::{Duration, Instant};

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::error::AppError;
use crate::readiness::{Dependency, Status, CHECK_TIMEOUT};
use crate::state::AppState;

/// Each activity's live figures are read from Redis at most once per this, by
/// one scrape at a time; the scrapes in between show those figures.
const FIGURES_MAX_AGE: Duration = Duration::from_secs(1);
/// How long after a start a scrape may wait for the reconciler's first pass (the
/// consumer lag and each activity's drift). Past it no scrape waits, even if
/// that pass never finishes.
const FIRST_PASS_WAIT: Duration = Duration::from_secs(5);

#[utoipa::path(
    get,
    path = "/healthz",
    tag = "operations",
    responses((status = 200, description = "The process runs", body = Object))
)]
pub async fn healthz() -> Json<serde_json::Value> {
    Json(json!({ "status": "ok" }))
}

#[derive(Debug, serde::Deserialize)]
pub struct ReadyQuery {
    role: Option<Role>,
}

/// What `/readyz?role=` asks readiness for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Taking reservations: Redis and Kafka (MySQL reported, not required).
    Api,
}

#[utoipa::path(
    get,
    path = "/readyz",
    tag = "operations",
    params(("role" = Option<Role>, Query, description = "`api`: what taking reservations needs (Redis and Kafka); MySQL is then reported, not required")),
    responses(
        (status = 200, description = "Ready; `checks` names each dependency's state at the last probe (`ok`, `down`, or `unknown`: no answer within the last second)", body = Object),
        (status = 422, description = "invalid_request: an unknown role", body = crate::error::ErrorBody),
        (status = 503, description = "unavailable: something is down, or the process is draining", body = crate::error::ErrorBody),
    )
)]
/// `200` when Redis, MySQL and the broker all answered the last probe; otherwise
/// `503` naming what is down (the reason text stays in the log). The answer comes
/// from the background prober (`crate::readiness`), which checks each dependency
/// every 500 ms: a probe costs no dependency any work, and an answer older than a
/// second, or none yet, counts as not ready (`unknown`). `?role=api` asks for what
/// taking reservations needs: Redis and the broker; MySQL is reported, not
/// required (reservations are decided in Redis and wait in the topic while MySQL
/// is down). While the process drains (SIGTERM) every role is `503`. What the
/// start found wrong but not fatal (a Redis whose `maxmemory-policy` can evict
/// a sale's keys) is listed under `warnings`.
pub async fn readyz(
    State(state): State<AppState>,
    query: Result<Query<ReadyQuery>, QueryRejection>,
) -> Response {
    let Ok(Query(query)) = query else {
        return AppError::invalid("role must be \"api\" or absent").into_response();
    };
    let optional: &[Dependency] = match query.role {
        None => &[],
        Some(Role::Api) => &[Dependency::Mysql],
    };
    if state.draining.is_cancelled() {
        return not_ready("draining: the process is stopping".into(), json!({}), &[]);
    }
    let mut missing = Vec::new();
    let mut checks = serde_json::Map::new();
    // A dependency the role does not need is reported as last probed: a stale
    // answer is not checked again inline (MySQL down must not slow an API
    // instance's readiness). Stale ones that are needed are checked again
    // together: the answer waits for the slowest check, not for their sum.
    let statuses = futures::future::join_all(Dependency::ALL.map(|dependency| {
        let readiness = &state.readiness;
        let optional = optional.contains(&dependency);
        async move {
            if optional {
                readiness.status(dependency, Instant::now())
            } else {
                readiness.current(dependency).await
            }
        }
    }))
    .await;
    for (dependency, status) in Dependency::ALL.into_iter().zip(statuses) {
        checks.insert(dependency.name().into(), json!(status.label()));
        if status != Status::Ok && !optional.contains(&dependency) {
            missing.push(format!("{} {}", dependency.name(), status.label()));
        }
    }
    let warnings = state.readiness.warnings();
    if missing.is_empty() {
        let mut body = json!({ "status": "ready", "checks": checks });
        if !warnings.is_empty() {
            body["warnings"] = json!(warnings);
        }
        (StatusCode::OK, Json(body)).into_response()
    } else {
        not_ready(
            format!("not ready: {}", missing.join(", ")),
            serde_json::Value::Object(checks),
            &warnings,
        )
    }
}

fn not_ready(message: String, checks: serde_json::Value, warnings: &[String]) -> Response {
    let mut body = json!({
        "code": "unavailable",
        "message": message,
        "checks": checks,
    });
    if !warnings.is_empty() {
        body["warnings"] = json!(warnings);
    }
    let mut response = (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response();
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, header::HeaderValue::from(1));
    response
}

#[utoipa::path(
    get,
    path = "/metrics",
    tag = "operations",
    responses((status = 200, description = "Prometheus text format", content_type = "text/plain"))
)]
/// `/metrics`: the process's figures and each current activity's live figures
/// from Redis, read by at most one scrape a second (the others wait for that read
/// and show its figures), bounded: a Redis that does not answer within the check
/// timeout leaves them as last seen and sets `redis_up` to 0. In the first
/// seconds after a start, a scrape waits for the reconciler's first pass, so the
/// consumer lag and each activity's drift are there from the first scrape.
pub async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    if state.settings.reconcile.enabled {
        let until = tokio::time::Instant::from_std(state.live_figures.started + FIRST_PASS_WAIT);
        // Past `until` this returns at once, with or without the pass.
        let _ = tokio::time::timeout_at(until, state.reconciler.first_pass.wait()).await;
    }
    {
        let mut read_at = state.live_figures.read_at.lock().await;
        if read_at.is_none_or(|at| at.elapsed() >= FIGURES_MAX_AGE) {
            let up = tokio::time::timeout(CHECK_TIMEOUT, record_activities(&state))
                .await
                .is_ok_and(|r| r.is_ok());
            metrics::gauge!("flashsale_redis_up").set(if up { 1.0 } else { 0.0 });
            *read_at = Some(Instant::now());
        }
    }
    crate::telemetry::prometheus_text(&state.metrics)
}

async fn record_activities(state: &AppState) -> redis::RedisResult<()> {
    let now_ms = state.stock.clock().now_ms();
    for a in state.cache.current_activities(state.stock.clock().now()) {
        let snap = state.stock.snapshot(&a.id, a.stock_shards).await?;
        let id = a.id.clone();
        metrics::gauge!("flashsale_activity_units_left", "activity_id" => id.clone())
            .set(snap.stock.unwrap_or(0) as f64);
        metrics::gauge!("flashsale_activity_available_mysql", "activity_id" => id.clone())
            .set(f64::from(a.available));
        metrics::gauge!("flashsale_activity_reservations_pending", "activity_id" => id.clone())
            .set(snap.pending as f64);
        metrics::gauge!("flashsale_activity_oldest_pending_age_seconds", "activity_id" => id.clone())
            .set(
                snap.oldest_pending_ms
                    .map_or(0.0, |ms| (now_ms - ms).max(0) as f64 / 1000.0),
            );
        metrics::gauge!("flashsale_activity_paused", "activity_id" => id).set(
            if snap.state.as_deref() == Some("paused") {
                1.0
            } else {
                0.0
            },
        );
    }
    for a in state.cache.waiting_rooms(state.stock.clock().now()) {
        let f = state.waiting_room.figures(&a).await?;
        let id = a.id.clone();
        for (name, value) in [
            ("flashsale_waiting_room_joined", f.joined),
            ("flashsale_waiting_room_waiting", f.waiting),
            ("flashsale_waiting_room_admitted", f.admitted),
            ("flashsale_waiting_room_turns_given", f.admitted_total),
            ("flashsale_waiting_room_turns_expired", f.expired_total),
        ] {
            metrics::gauge!(name, "activity_id" => id.clone()).set(value as f64);
        }
        metrics::gauge!("flashsale_waiting_room_draw_seed", "activity_id" => id.clone())
            .set(f.seed.map_or(-1.0, |s| s as f64));
        metrics::gauge!("flashsale_waiting_room_closed", "activity_id" => id).set(if f.closed {
            1.0
        } else {
            0.0
        });
    }
    Ok(())
}
