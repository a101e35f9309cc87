//! Operator endpoints under `/admin`, behind an operator's credential (`crate::operators`);
//! every change is recorded in the audit trail by the layer in front (`super::audit`).

use std::collections::BTreeMap;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use serde::Serialize;
use serde_json::{json, Value};

use super::body;
use crate::activity::{Activity, CreateError, NewActivity, TopUpError};
use crate::error::{redis_down, AppError, AppResult};
use crate::input::{is_valid_id, whole_number};
use crate::state::AppState;
use crate::stocking::{Preload, PreloadError};

#[utoipa::path(
    post,
    path = "/admin/activities",
    tag = "operators",
    security(("admin" = [])),
    request_body = NewActivity,
    responses(
        (status = 201, description = "The stored activity", body = Activity),
        (status = 401, description = "unauthorized", body = crate::error::ErrorBody),
        (status = 409, description = "conflict: the id exists, or the SKU has an overlapping window", body = crate::error::ErrorBody),
        (status = 413, description = "payload_too_large", body = crate::error::ErrorBody),
        (status = 422, description = "invalid_request", body = crate::error::ErrorBody),
        (status = 503, description = "unavailable", body = crate::error::ErrorBody),
    )
)]
/// `POST /admin/activities`
pub async fn create(
    State(state): State<AppState>,
    raw: Result<Bytes, BytesRejection>,
) -> AppResult<(StatusCode, Json<Activity>)> {
    let bytes = body::read(raw, state.settings.server.body_limit_bytes)?;
    let new: NewActivity = body::required_json(&bytes)?;
    let valid = new.validate()?;
    let activity = state.activities.create(&valid).await.map_err(|e| match e {
        CreateError::DuplicateId(_) | CreateError::Overlap { .. } => {
            AppError::Conflict(e.to_string())
        }
        CreateError::NoPriceColumns => {
            AppError::Unavailable("a price needs `flashsale migrate` first")
        }
        CreateError::Db(db) => AppError::from(db),
    })?;
    tracing::info!(activity_id = %activity.id, sku = %activity.sku, stock = activity.stock, "activity created");
    refresh_cache(&state).await;
    Ok((StatusCode::CREATED, Json(activity)))
}

async fn load(state: &AppState, id: &str) -> AppResult<Activity> {
    if !is_valid_id(id) {
        return Err(AppError::not_found("no such activity"));
    }
    state
        .activities
        .get(id)
        .await?
        .ok_or_else(|| AppError::not_found("no such activity"))
}

/// The other instances pick changes up on their next refresh; this one at once.
async fn refresh_cache(state: &AppState) {
    if let Err(err) = state.cache.refresh().await {
        tracing::warn!(error = %err, "activity cache refresh failed");
    }
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Preloaded {
    stock: i64,
    buyers: usize,
}

#[utoipa::path(
    post,
    path = "/admin/activities/{id}/preload",
    tag = "operators",
    security(("admin" = [])),
    params(("id" = String, Path, description = "The activity's id")),
    responses(
        (status = 200, description = "Redis rebuilt from MySQL", body = Preloaded),
        (status = 401, description = "unauthorized", body = crate::error::ErrorBody),
        (status = 404, description = "not_found", body = crate::error::ErrorBody),
        (status = 409, description = "conflict: loaded, open and not paused; or ended longer ago than its retention (its Redis state was removed)", body = crate::error::ErrorBody),
        (status = 503, description = "unavailable: the sale's messages still in the topic could not be written as orders yet, or Redis or MySQL is unreachable", body = crate::error::ErrorBody),
    )
)]
/// `POST /admin/activities/{id}/preload`: (re)builds the Redis state from MySQL,
/// as safely as the automatic rebuild (`Reconciler::rebuild`), after the same wait
/// for publishes in flight when Redis lost an activity loaded before (up to the
/// publish timeout and half a second). An activity that is not loaded is loaded whatever its
/// window; a loaded one is refused while it is open and not paused, since
/// reservations keep arriving.
pub async fn preload(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> AppResult<Json<Preloaded>> {
    let activity = load(&state, &id).await?;
    let preloaded = state
        .stocking
        .preload(&activity)
        .await
        .map_err(|e| match e {
            PreloadError::Redis(redis) => redis_down(redis),
            PreloadError::Rebuild(e) => reconcile_error(e),
        })?;
    let build = match preloaded {
        Preload::Built(build) => build,
        Preload::Open => {
            return Err(AppError::Conflict(
                "the sale is open: pause it before preloading".into(),
            ))
        }
        Preload::Draining(_) => {
            return Err(AppError::Unavailable(
                "the sale's messages still in the topic are not all orders yet (the broker or MySQL did not answer); retry shortly",
            ));
        }
        Preload::Removed => {
            return Err(AppError::Conflict(
                "the sale ended longer ago than its retention (redis.retain_after_end_secs): its Redis state was removed and is never loaded again".into(),
            ))
        }
        Preload::Reopened => {
            return Err(AppError::Conflict(
                "the sale reopened while it was being preloaded: pause it and retry".into(),
            ))
        }
        Preload::Busy => {
            return Err(AppError::Unavailable(
                "another rebuild of the sale is under way; retry shortly",
            ))
        }
    };
    refresh_cache(&state).await;
    Ok(Json(Preloaded {
        stock: build.available,
        buyers: build.buyers.len(),
    }))
}

/// MySQL first (a preload reads the flag from there), then the live switch.
/// Whether Redis holds the sale.
async fn switch(state: &AppState, id: &str, shards: u8, paused: bool) -> AppResult<bool> {
    state.activities.set_paused(id, paused).await?;
    state
        .stock
        .set_paused(id, shards, paused)
        .await
        .map_err(redis_down)
}

/// A reconciler failure: Redis unreachable is a 503, anything else a 500.
fn reconcile_error(e: anyhow::Error) -> AppError {
    if let Some(redis) = e.downcast_ref::<redis::RedisError>() {
        tracing::warn!(error = %redis, "reconcile could not reach Redis");
        AppError::Unavailable("stock store unreachable")
    } else if let Some(db) = e.downcast_ref::<sqlx::Error>() {
        tracing::warn!(error = %db, "reconcile could not reach MySQL");
        AppError::Unavailable("database unreachable")
    } else {
        AppError::Internal(e.context("reconcile pass failed"))
    }
}

/// How long a resume waits for a build of the sale under way.
const RESUME_WAITS_FOR_BUILD: std::time::Duration = std::time::Duration::from_secs(3);

async fn set_paused(state: &AppState, id: &str, paused: bool) -> AppResult<Json<Activity>> {
    let activity = load(state, id).await?;
    // A resume waits for a build of the sale under way (on any instance):
    // reopened in the middle of a forced build, the shards it has not reached
    // yet would be left alone, and the sale split between two states. A pause
    // never waits: a build ends by setting the switch as MySQL then says.
    let lock = if paused {
        None
    } else {
        match state
            .activities
            .build_lock(id, RESUME_WAITS_FOR_BUILD)
            .await?
        {
            Some(lock) => Some(lock),
            None => {
                return Err(AppError::Unavailable(
                    "a rebuild of the sale is under way; retry shortly",
                ))
            }
        }
    };
    let switched = switch(state, id, activity.stock_shards, paused).await;
    if let Some(lock) = lock {
        lock.release().await;
    }
    let loaded = switched?;
    if !loaded {
        tracing::warn!(activity_id = %id, "activity is not loaded in Redis; only MySQL was updated");
    }
    tracing::info!(activity_id = %id, paused, "activity switched");
    refresh_cache(state).await;
    Ok(Json(load(state, id).await?))
}

#[utoipa::path(
    post,
    path = "/admin/activities/{id}/pause",
    tag = "operators",
    security(("admin" = [])),
    params(("id" = String, Path, description = "The activity's id")),
    responses(
        (status = 200, description = "The activity, paused", body = Activity),
        (status = 401, description = "unauthorized", body = crate::error::ErrorBody),
        (status = 404, description = "not_found", body = crate::error::ErrorBody),
        (status = 503, description = "unavailable", body = crate::error::ErrorBody),
    )
)]
/// `POST /admin/activities/{id}/pause`
pub async fn pause(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> AppResult<Json<Activity>> {
    set_paused(&state, &id, true).await
}

#[utoipa::path(
    post,
    path = "/admin/activities/{id}/resume",
    tag = "operators",
    security(("admin" = [])),
    params(("id" = String, Path, description = "The activity's id")),
    responses(
        (status = 200, description = "The activity, resumed", body = Activity),
        (status = 401, description = "unauthorized", body = crate::error::ErrorBody),
        (status = 404, description = "not_found", body = crate::error::ErrorBody),
        (status = 503, description = "unavailable", body = crate::error::ErrorBody),
    )
)]
/// `POST /admin/activities/{id}/resume`
pub async fn resume(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> AppResult<Json<Activity>> {
    set_paused(&state, &id, false).await
}

#[utoipa::path(
    get,
    path = "/admin/activities/{id}",
    tag = "operators",
    security(("admin" = [])),
    params(("id" = String, Path, description = "The activity's id")),
    responses(
        (status = 200, description = "The activity with `live` (Redis's figures, the reconciler's last report) and `orders_by_status`", body = Object),
        (status = 401, description = "unauthorized", body = crate::error::ErrorBody),
        (status = 404, description = "not_found", body = crate::error::ErrorBody),
        (status = 503, description = "unavailable", body = crate::error::ErrorBody),
    )
)]
/// `GET /admin/activities/{id}`: the row plus live figures from Redis and MySQL.
pub async fn get(State(state): State<AppState>, Path(id): Path<String>) -> AppResult<Json<Value>> {
    let activity = load(&state, &id).await?;
    Ok(Json(describe(&state, &activity).await?))
}

/// Most activities `GET /admin/activities` lists.
const LIST_LIMIT: u32 = 100;

#[utoipa::path(
    get,
    path = "/admin/activities",
    tag = "operators",
    security(("admin" = [])),
    responses(
        (status = 200, description = "The newest 100 activities, each as GET /admin/activities/{id} shows it", body = Vec<Object>),
        (status = 401, description = "unauthorized", body = crate::error::ErrorBody),
        (status = 503, description = "unavailable", body = crate::error::ErrorBody),
    )
)]
/// `GET /admin/activities`: the newest activities first (at most 100), each as
/// `GET /admin/activities/{id}` shows it.
pub async fn list(State(state): State<AppState>) -> AppResult<Json<Vec<Value>>> {
    let mut out = Vec::new();
    for activity in state.activities.list(LIST_LIMIT).await? {
        out.push(describe(&state, &activity).await?);
    }
    Ok(Json(out))
}

/// An activity with its live figures: Redis's (units left, pending reservations
/// and the oldest's age), MySQL's (orders by status), and what this instance's
/// reconciler and consumer last saw (drift, consumer lag, dead letters).
async fn describe(state: &AppState, activity: &Activity) -> AppResult<Value> {
    let id = &activity.id;
    let orders: BTreeMap<String, i64> = state
        .activities
        .order_counts(id)
        .await?
        .into_iter()
        .collect();
    let now_ms = state.stock.clock().now_ms();
    let mut live = match state.stock.snapshot(id, activity.stock_shards).await {
        Ok(s) => json!({
            "loaded": s.loaded(),
            "redis_stock": s.stock,
            "redis_stock_by_shard": s.shard_stock,
            "redis_state": s.state,
            "reservations_pending": s.pending,
            "oldest_pending_age_ms": s.oldest_pending_ms.map(|ms| (now_ms - ms).max(0)),
            "buyers": s.buyers,
        }),
        Err(err) => {
            tracing::warn!(error = %err, "redis snapshot failed");
            json!({ "loaded": Value::Null, "error": "stock store unreachable" })
        }
    };
    if let Value::Object(map) = &mut live {
        let last = state.reconciler.last_report(id);
        map.insert(
            "reconciler".into(),
            last.map_or(Value::Null, |r| {
                json!({
                    "checked_at": r.checked_at,
                    "drift": r.drift,
                    "repaired": r.repaired,
                    "consumer_lag": r.consumer_lag,
                    "notes": r.refused,
                })
            }),
        );
        map.insert(
            "dead_letters_seen".into(),
            json!(crate::orders::dead_letters_seen()),
        );
        if activity.admission == crate::activity::Admission::WaitingRoom {
            let room = match state.waiting_room.figures(activity).await {
                Ok(f) => json!(f),
                Err(err) => {
                    tracing::warn!(error = %err, "waiting room figures failed");
                    json!({ "error": "stock store unreachable" })
                }
            };
            map.insert("waiting_room".into(), room);
        }
    }
    let mut out = serde_json::to_value(activity)
        .map_err(|e| AppError::Internal(anyhow::Error::new(e).context("serialising activity")))?;
    if let Value::Object(map) = &mut out {
        map.insert("live".into(), live);
        map.insert("redis_removed_at".into(), json!(activity.redis_removed_at));
        map.insert("orders_by_status".into(), json!(orders));
    }
    Ok(out)
}

#[utoipa::path(
    get,
    path = "/admin/ui",
    tag = "operations",
    responses((status = 200, description = "The operators' page (HTML; it asks for the admin token)", content_type = "text/html"))
)]
/// `GET /admin/ui`: the operators' live-sale page. It holds no data: it asks for
/// the admin token and then calls the admin API from the browser.
pub async fn ui() -> impl axum::response::IntoResponse {
    super::page::own_page(include_str!("ui.html"))
}

#[utoipa::path(
    post,
    path = "/admin/activities/{id}/reconcile",
    tag = "operators",
    security(("admin" = [])),
    params(("id" = String, Path, description = "The activity's id")),
    responses(
        (status = 200, description = "What differed between Redis and MySQL, and what was done", body = crate::reconcile::Report),
        (status = 401, description = "unauthorized", body = crate::error::ErrorBody),
        (status = 404, description = "not_found", body = crate::error::ErrorBody),
        (status = 503, description = "unavailable", body = crate::error::ErrorBody),
    )
)]
/// `POST /admin/activities/{id}/reconcile`: one reconciler pass, and its report.
pub async fn reconcile(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> AppResult<Json<crate::reconcile::Report>> {
    let activity = load(&state, &id).await?;
    let report = state
        .reconciler
        .reconcile_activity(&activity)
        .await
        .map_err(reconcile_error)?;
    refresh_cache(&state).await;
    Ok(Json(report))
}

/// Body of `POST /admin/activities/{id}/stock`.
#[derive(Debug, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TopUp {
    /// Units to add, 1 to 1,000,000.
    #[schema(value_type = u32, minimum = 1, maximum = 1_000_000)]
    add: serde_json::Value,
}

/// Most units one top-up may add.
const MAX_TOP_UP: u64 = 1_000_000;

#[utoipa::path(
    post,
    path = "/admin/activities/{id}/stock",
    tag = "operators",
    security(("admin" = [])),
    params(("id" = String, Path, description = "The activity's id")),
    request_body = TopUp,
    responses(
        (status = 200, description = "The activity with N more units, in MySQL and in Redis", body = Activity),
        (status = 401, description = "unauthorized", body = crate::error::ErrorBody),
        (status = 404, description = "not_found", body = crate::error::ErrorBody),
        (status = 413, description = "payload_too_large", body = crate::error::ErrorBody),
        (status = 422, description = "invalid_request", body = crate::error::ErrorBody),
        (status = 503, description = "unavailable", body = crate::error::ErrorBody),
    )
)]
/// `POST /admin/activities/{id}/stock`: N more units, during a sale too. MySQL
/// first (stock, available and the top-up's record in one transaction), then
/// Redis once (`StockStore::top_up`); if Redis cannot take it now, the reconciler
/// adds it on its next pass, and a rebuild counts it from MySQL. A retry of this
/// call adds N again: it is a new top-up.
pub async fn top_up(
    State(state): State<AppState>,
    Path(id): Path<String>,
    raw: Result<Bytes, BytesRejection>,
) -> AppResult<Json<Activity>> {
    let bytes = body::read(raw, state.settings.server.body_limit_bytes)?;
    let body: TopUp = body::required_json(&bytes)?;
    let units = whole_number(&body.add)
        .filter(|n| (1..=MAX_TOP_UP).contains(n))
        .and_then(|n| u32::try_from(n).ok())
        .ok_or_else(|| {
            AppError::invalid(format!("add must be an integer from 1 to {MAX_TOP_UP}"))
        })?;
    load(&state, &id).await?;
    let activity = state
        .stocking
        .top_up(&id, units)
        .await
        .map_err(|e| match e {
            TopUpError::NotFound(_) => AppError::not_found("no such activity"),
            TopUpError::TooMuch { .. } => AppError::invalid(e.to_string()),
            TopUpError::Db(db) => AppError::from(db),
        })?;
    refresh_cache(&state).await;
    Ok(Json(activity))
}
