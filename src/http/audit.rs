//! The audit trail on the HTTP side: the layer that records every admin request
//! that changes something, and `GET /admin/audit`, which reads the trail.
//!
//! Recorded: every admin request that is not a read (`GET`, `HEAD`), from an
//! identified operator, whatever its answer (`2xx`, and refusals: `404`, `409`,
//! `413`, `422`, `503`, `500`). Not recorded: reads, and requests refused `401`
//! (there is nobody to name). The entry is written after the action, with its
//! answer (`crate::audit` says why that order, and what a failed write means).
//!
//! The action and its entry run in a task of their own (`AppState::critical`,
//! which shutdown waits for): a caller who hangs up, or a request that outlives
//! `server.request_timeout_ms`, does not cut an operator's action in half, and
//! its entry records how it really ended.

use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::rejection::QueryRejection;
use axum::extract::{FromRequestParts, MatchedPath, Query, RawPathParams, Request, State};
use axum::http::{Method, Response};
use axum::middleware::Next;
use axum::response::IntoResponse;
use axum::Json;
use chrono::Utc;
use futures::StreamExt;
use serde_json::Value;

use super::middleware::ClientRequestId;
use crate::audit::{self, Entry, NewEntry};
use crate::error::{AppError, AppResult};
use crate::input::is_valid_id;
use crate::operators::Operator;
use crate::state::AppState;

/// What an admin route does, by its matched path (a route not named here is
/// recorded by its path).
fn action(route: &str) -> &str {
    match route {
        "/admin/activities" => "create",
        "/admin/activities/{id}/preload" => "preload",
        "/admin/activities/{id}/pause" => "pause",
        "/admin/activities/{id}/resume" => "resume",
        "/admin/activities/{id}/reconcile" => "reconcile",
        "/admin/activities/{id}/stock" => "top_up",
        other => other,
    }
}

/// Records the admin request it wraps, after `require_admin` named the operator.
pub async fn record(State(state): State<AppState>, req: Request, next: Next) -> Response<Body> {
    // Every admin change is a POST; anything else (reads, and methods a route
    // does not take, answered 405) changes nothing and is not recorded.
    if *req.method() != Method::POST {
        return next.run(req).await;
    }
    let Some(operator) = req.extensions().get::<Operator>().cloned() else {
        // `require_admin` runs first and always names one; without it there is
        // nothing to record, and nothing runs unrecorded.
        return AppError::Unauthorized("admin or operator token required").into_response();
    };
    let started = Instant::now();
    let (mut parts, body) = req.into_parts();
    let route = parts
        .extensions
        .get::<MatchedPath>()
        .map_or_else(|| parts.uri.path().to_owned(), |p| p.as_str().to_owned());
    let path_activity = RawPathParams::from_request_parts(&mut parts, &state)
        .await
        .ok()
        .and_then(|params| {
            params
                .iter()
                .find(|(name, _)| *name == "id")
                .map(|(_, id)| id.to_owned())
        })
        .filter(|id| is_valid_id(id));
    // The service's own id (`SetRequestIdLayer`), beside the client's, if any.
    let request_id = parts
        .headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let client_request_id = parts
        .extensions
        .get::<ClientRequestId>()
        .map(|ClientRequestId(id)| id.clone());
    let mut request_text = format!("{} {}", parts.method, parts.uri.path());

    let limit = state.settings.server.body_limit_bytes;
    let (bytes, refused) = match read_body(body, limit).await {
        Ok(bytes) => (bytes, None),
        Err(err) => (Bytes::new(), Some(err)),
    };
    if !bytes.is_empty() {
        request_text.push(' ');
        request_text.push_str(&String::from_utf8_lossy(&bytes));
    }
    // The body names the sale only on the create route: elsewhere a body's
    // `id` (under an invalid path id) would file the entry under another sale.
    let body_activity = (path_activity.is_none() && route == "/admin/activities")
        .then(|| serde_json::from_slice::<Value>(&bytes).ok())
        .flatten()
        .and_then(|v| v.get("id").and_then(Value::as_str).map(str::to_owned))
        .filter(|id| is_valid_id(id));
    let req = Request::from_parts(parts, Body::from(bytes));

    let task_state = state.clone();
    let task = state.critical.spawn(async move {
        let state = task_state;
        let response = match refused {
            Some(err) => err.into_response(),
            None => next.run(req).await,
        };
        let (parts, body) = response.into_parts();
        // The handlers build their answers in memory: reading one back costs a
        // copy of a few hundred bytes, and cannot fail.
        let answer = axum::body::to_bytes(body, usize::MAX)
            .await
            .unwrap_or_default();
        let status = parts.status.as_u16();
        let parsed = serde_json::from_slice::<Value>(&answer).ok();
        let (code, summary) = if parts.status.is_success() {
            (None, String::from_utf8_lossy(&answer).into_owned())
        } else {
            let field = |name: &str| {
                parsed
                    .as_ref()
                    .and_then(|v| v.get(name))
                    .and_then(Value::as_str)
                    .map(str::to_owned)
            };
            (field("code"), field("message").unwrap_or_default())
        };
        // A created activity is named by its answer (its id may be generated).
        let activity_id = path_activity
            .or_else(|| {
                parsed
                    .as_ref()
                    .filter(|_| parts.status.is_success())
                    .and_then(|v| v.get("id"))
                    .and_then(Value::as_str)
                    .map(str::to_owned)
                    .filter(|id| is_valid_id(id))
            })
            .or(body_activity);
        let entry = NewEntry {
            at: Utc::now(),
            operator: &operator,
            action: action(&route),
            activity_id: activity_id.as_deref(),
            request_id: request_id.as_deref(),
            client_request_id: client_request_id.as_deref(),
            request: &request_text,
            status,
            code: code.as_deref(),
            summary: &summary,
            elapsed_ms: u32::try_from(started.elapsed().as_millis()).unwrap_or(u32::MAX),
        };
        write(&state, &entry).await;
        Response::from_parts(parts, Body::from(answer))
    });
    match task.await {
        Ok(response) => response,
        Err(err) => {
            AppError::Internal(anyhow::anyhow!("admin action task failed: {err}")).into_response()
        }
    }
}

/// Writes the entry; a failure is logged with the whole entry and counted, and
/// the action's answer goes out as it is.
async fn write(state: &AppState, e: &NewEntry<'_>) {
    tracing::info!(
        operator = ?e.operator.name,
        via = e.operator.via.as_str(),
        action = e.action,
        activity_id = e.activity_id.unwrap_or("-"),
        status = e.status,
        "admin action"
    );
    if let Err(err) = state.audit.record(e).await {
        metrics::counter!("flashsale_audit_write_failures_total").increment(1);
        tracing::error!(
            error = %err,
            at = %e.at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            operator = ?e.operator.name,
            via = e.operator.via.as_str(),
            action = e.action,
            activity_id = e.activity_id.unwrap_or("-"),
            request_id = e.request_id.unwrap_or("-"),
            client_request_id = e.client_request_id.unwrap_or("-"),
            request = %audit::cut(e.request, 2000),
            status = e.status,
            code = e.code.unwrap_or("-"),
            summary = %audit::cut(e.summary, 1000),
            elapsed_ms = e.elapsed_ms,
            "AUDIT ENTRY NOT WRITTEN: the action stands; this line is its record"
        );
    }
}

/// The body, at most `limit` bytes (413 beyond), as the handlers' own reading
/// answers (422 when it cannot be read).
async fn read_body(body: Body, limit: usize) -> Result<Bytes, AppError> {
    let mut stream = body.into_data_stream();
    let mut out = Vec::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk
            .map_err(|e| AppError::invalid(format!("could not read the request body: {e}")))?;
        if out.len() + chunk.len() > limit {
            return Err(AppError::PayloadTooLarge { limit });
        }
        out.extend_from_slice(&chunk);
    }
    Ok(Bytes::from(out))
}

#[utoipa::path(
    get,
    path = "/admin/audit",
    operation_id = "list_audit",
    tag = "operators",
    security(("admin" = [])),
    params(
        ("activity_id" = Option<String>, Query, pattern = "^[A-Za-z0-9_-]{0,64}$", description = "Only this activity's entries (empty: all)"),
        ("limit" = Option<u32>, Query, minimum = 1, maximum = 1000, description = "Most entries returned, 1 to 1000 (default 100)"),
    ),
    responses(
        (status = 200, description = "The audit trail, newest first", body = Vec<Entry>),
        (status = 401, description = "unauthorized", body = crate::error::ErrorBody),
        (status = 422, description = "invalid_request: an unknown, repeated or bad parameter", body = crate::error::ErrorBody),
        (status = 503, description = "unavailable", body = crate::error::ErrorBody),
    )
)]
/// `GET /admin/audit?activity_id=&limit=`: what operators changed, newest first.
pub async fn list(
    State(state): State<AppState>,
    query: Result<Query<Vec<(String, String)>>, QueryRejection>,
) -> AppResult<Json<Vec<Entry>>> {
    let Query(pairs) =
        query.map_err(|e| AppError::invalid(format!("invalid query string: {e}")))?;
    let (activity_id, limit) = parse_query(&pairs)?;
    Ok(Json(state.audit.list(activity_id.as_deref(), limit).await?))
}

/// `activity_id` (a valid id; empty is all) and `limit` (1 to 1000; empty is
/// the default); anything else, or a parameter given twice, is refused.
fn parse_query(pairs: &[(String, String)]) -> Result<(Option<String>, u32), AppError> {
    let mut activity_id = None;
    let mut limit = None;
    for (key, value) in pairs {
        let slot = match key.as_str() {
            "activity_id" => &mut activity_id,
            "limit" => &mut limit,
            other => {
                return Err(AppError::invalid(format!(
                    "unknown parameter {other:?}: use activity_id and limit"
                )))
            }
        };
        if slot.replace(value.as_str()).is_some() {
            return Err(AppError::invalid(format!("{key} is given twice")));
        }
    }
    let activity_id = match activity_id.filter(|id| !id.is_empty()) {
        None => None,
        Some(id) if is_valid_id(id) => Some(id.to_owned()),
        Some(_) => {
            return Err(AppError::invalid(
                "activity_id must be 1 to 64 characters of A-Z, a-z, 0-9, '_' or '-'",
            ))
        }
    };
    let limit = match limit.filter(|l| !l.is_empty()) {
        None => audit::DEFAULT_LIMIT,
        Some(text) => text
            .parse::<u32>()
            .ok()
            .filter(|n| (1..=audit::MAX_LIMIT).contains(n))
            .ok_or_else(|| {
                AppError::invalid(format!(
                    "limit must be an integer from 1 to {}",
                    audit::MAX_LIMIT
                ))
            })?,
    };
    Ok((activity_id, limit))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(pairs: &[(&str, &str)]) -> Result<(Option<String>, u32), AppError> {
        let owned: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        parse_query(&owned)
    }

    #[test]
    fn the_query_is_read_strictly() {
        assert_eq!(q(&[]).expect("none"), (None, 100));
        assert_eq!(
            q(&[("activity_id", "a-1"), ("limit", "1000")]).expect("both"),
            (Some("a-1".into()), 1000)
        );
        assert_eq!(
            q(&[("activity_id", ""), ("limit", "")]).expect("empty"),
            (None, 100)
        );
        let long = "x".repeat(65);
        for bad in [
            &[("limit", "0")][..],
            &[("limit", "1001")],
            &[("limit", "-1")],
            &[("limit", "ten")],
            &[("limit", "1.5")],
            &[("activity_id", "a b")],
            &[("activity_id", long.as_str())],
            &[("activity", "a")],
            &[("limit", "1"), ("limit", "2")],
        ] {
            let err = q(bad).expect_err("refused");
            assert_eq!(err.code(), "invalid_request", "{bad:?}");
        }
    }

    #[test]
    fn actions_are_named_by_route() {
        assert_eq!(action("/admin/activities"), "create");
        assert_eq!(action("/admin/activities/{id}/stock"), "top_up");
        assert_eq!(action("/admin/other"), "/admin/other");
    }
}
