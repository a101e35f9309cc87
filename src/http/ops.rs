//! Operations endpoints: liveness, readiness, metrics.

use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::state::AppState;

const CHECK_TIMEOUT: Duration = Duration::from_secs(2);

pub async fn healthz() -> Json<serde_json::Value> {
    Json(json!({ "status": "ok" }))
}

async fn bounded<F, E>(check: F) -> Result<(), String>
where
    F: std::future::Future<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    match tokio::time::timeout(CHECK_TIMEOUT, check).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("timed out".to_owned()),
    }
}

/// `200` when Redis, MySQL and the broker all answer; otherwise `503` naming what
/// is down (the reason text stays in the log).
pub async fn readyz(State(state): State<AppState>) -> Response {
    let (redis, mysql, kafka) = tokio::join!(
        bounded(state.stock.ping()),
        bounded(async {
            sqlx::query("SELECT 1")
                .execute(&state.pool)
                .await
                .map(|_| ())
        }),
        bounded(async { state.publisher.check().await.map_err(|e| format!("{e:#}")) }),
    );
    let mut down = Vec::new();
    let mut checks = serde_json::Map::new();
    for (name, result) in [("redis", redis), ("mysql", mysql), ("kafka", kafka)] {
        match result {
            Ok(()) => {
                checks.insert(name.into(), json!("ok"));
            }
            Err(reason) => {
                tracing::warn!(dependency = name, %reason, "readiness check failed");
                checks.insert(name.into(), json!("down"));
                down.push(name);
            }
        }
    }
    if down.is_empty() {
        (
            StatusCode::OK,
            Json(json!({ "status": "ready", "checks": checks })),
        )
            .into_response()
    } else {
        let mut response = (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({
                "code": "unavailable",
                "message": format!("not ready: {} down", down.join(", ")),
                "checks": checks,
            })),
        )
            .into_response();
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from(1));
        response
    }
}

pub async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
}
