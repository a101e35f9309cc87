//! The user-facing sale endpoints: status, reserve, reservation status.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::body;
use crate::activity::{Activity, Admission, Window};
use crate::auth::User;
use crate::error::{redis_down, AppError, AppResult};
use crate::input::{is_valid_sku, whole_number};
use crate::kafka::ReservationMessage;
use crate::orders::{Decision, Incoming, OrderStatus, OrderWriter};
use crate::state::AppState;
use crate::stock::{FateChange, RefundMode, ReserveOutcome};
use crate::waiting_room::{Place, Turn};

fn activity_for(state: &AppState, sku: &str, now: DateTime<Utc>) -> AppResult<Arc<Activity>> {
    if !is_valid_sku(sku) {
        return Err(AppError::not_found("no sale for this sku"));
    }
    state
        .cache
        .for_sku(sku, now)
        .ok_or_else(|| AppError::not_found("no sale for this sku"))
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct SaleStatus {
    activity_id: String,
    sku: String,
    starts_at: DateTime<Utc>,
    ends_at: DateTime<Utc>,
    /// upcoming, open, sold_out, paused or ended.
    state: &'static str,
    stock_left: i64,
}

#[utoipa::path(
    get,
    path = "/flash/{sku}",
    tag = "users",
    params(("sku" = String, Path, description = "The SKU on sale")),
    responses(
        (status = 200, description = "The sale's state and units left", body = SaleStatus),
        (status = 404, description = "not_found: no sale for this SKU", body = crate::error::ErrorBody),
    )
)]
/// `GET /flash/{sku}`: public, answered from the cache and one Redis round trip.
pub async fn status(
    State(state): State<AppState>,
    Path(sku): Path<String>,
) -> AppResult<Json<SaleStatus>> {
    let now = Utc::now();
    let activity = activity_for(&state, &sku, now)?;
    // Redis holds the live figures; when it cannot answer (or lost the activity)
    // the database's count is the honest fallback.
    let live = state
        .stock
        .snapshot(&activity.id, activity.stock_shards)
        .await
        .ok();
    let stock_left = live
        .as_ref()
        .and_then(|s| s.stock)
        .unwrap_or(i64::from(activity.available))
        .max(0);
    let paused = activity.paused
        || live
            .as_ref()
            .and_then(|s| s.state.as_deref())
            .is_some_and(|s| s == "paused");
    let state_name = match activity.window(now) {
        Window::Upcoming => "upcoming",
        Window::Ended => "ended",
        Window::Open if paused => "paused",
        Window::Open if stock_left == 0 => "sold_out",
        Window::Open => "open",
    };
    Ok(Json(SaleStatus {
        activity_id: activity.id.clone(),
        sku: activity.sku.clone(),
        starts_at: activity.starts_at,
        ends_at: activity.ends_at,
        state: state_name,
        stock_left,
    }))
}

/// Optional body of a reservation.
#[derive(Debug, Deserialize, utoipa::ToSchema)]
pub struct ReserveBody {
    /// Units to reserve, 1 to the activity's per-user limit (default 1).
    #[schema(value_type = Option<u32>, minimum = 1)]
    quantity: Option<serde_json::Value>,
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct Reserved {
    reservation_id: String,
    activity_id: String,
    sku: String,
    quantity: u32,
    status: &'static str,
}

fn parse_quantity(bytes: &[u8]) -> AppResult<u32> {
    let Some(body) = body::json::<ReserveBody>(bytes)? else {
        return Ok(1);
    };
    match body.quantity {
        None => Ok(1),
        Some(v) => whole_number(&v)
            .filter(|q| *q >= 1)
            .and_then(|q| u32::try_from(q).ok())
            .ok_or_else(|| AppError::invalid("quantity must be a positive integer")),
    }
}

#[utoipa::path(
    post,
    path = "/flash/{sku}/reserve",
    tag = "users",
    security(("user" = [])),
    params(("sku" = String, Path, description = "The SKU on sale")),
    request_body(content = Option<ReserveBody>, description = "Optional; quantity defaults to 1"),
    responses(
        (status = 202, description = "Stock is held and the order is being created: it will be an order", body = Reserved),
        (status = 401, description = "unauthorized: no valid user token", body = crate::error::ErrorBody),
        (status = 403, description = "not_started or ended: outside the activity's window; not_admitted: the sale has a waiting room and this user holds no turn", body = crate::error::ErrorBody),
        (status = 404, description = "not_found: no sale for this SKU", body = crate::error::ErrorBody),
        (status = 409, description = "already_reserved (with reservation_id) or sold_out", body = crate::error::ErrorBody),
        (status = 413, description = "payload_too_large", body = crate::error::ErrorBody),
        (status = 422, description = "invalid_request: a bad body or quantity", body = crate::error::ErrorBody),
        (status = 429, description = "rate_limited, with Retry-After", body = crate::error::ErrorBody),
        (status = 503, description = "paused or unavailable, with Retry-After: nothing is held", body = crate::error::ErrorBody),
    )
)]
/// `POST /flash/{sku}/reserve`: the hot path.
pub async fn reserve(
    State(state): State<AppState>,
    Path(sku): Path<String>,
    Extension(user): Extension<User>,
    raw: Result<Bytes, BytesRejection>,
) -> AppResult<(StatusCode, Json<Reserved>)> {
    let bytes = body::read(raw, state.settings.server.body_limit_bytes)?;
    let quantity = parse_quantity(&bytes)?;
    let now = Utc::now();
    let activity = activity_for(&state, &sku, now)?;
    match activity.window(now) {
        Window::Upcoming => return Err(count(AppError::NotStarted)),
        Window::Ended => return Err(count(AppError::Ended)),
        Window::Open => {}
    }
    if quantity > activity.per_user_limit {
        return Err(AppError::invalid(format!(
            "quantity must be between 1 and {}",
            activity.per_user_limit
        )));
    }
    if activity.paused {
        return Err(count(AppError::Paused));
    }
    let waiting_room = activity.admission == Admission::WaitingRoom;
    if waiting_room {
        // The room is asked first, and a user holding a turn goes past the
        // sold-out gate: the turn may come from units that came back before
        // this instance's gate has seen them.
        match state
            .waiting_room
            .turn(&activity, &user.id, now)
            .await
            .map_err(redis_down)?
        {
            Turn::Held => {}
            Turn::RanOut => return Err(count(ran_out(&state, &activity, &user).await?)),
            Turn::None => return Err(count(AppError::NotAdmitted)),
        }
    } else if state.stock.sold_out_from_memory(&activity.id, &user.id) {
        // The flood after the sell-out: answered here, before a task or an id
        // is made.
        return Err(count(AppError::SoldOut));
    }
    // From here on, stock may be held: run the rest as its own task so that a
    // client hanging up (or the request timeout) cannot stop it half-way between
    // Redis and Kafka, nor between the answer and the turn it settles. Shutdown
    // waits for these tasks.
    let task_state = state.clone();
    let handle = state.critical.spawn(async move {
        let result = reserve_and_publish(&task_state, &activity, &user, quantity, now).await;
        if waiting_room {
            settle_turn(&task_state, &activity, &user, &result).await;
        }
        result
    });
    let result = handle
        .await
        .map_err(|e| AppError::Internal(anyhow::Error::new(e).context("reserve task failed")))?;
    match result {
        Ok(reserved) => {
            metrics::counter!("flashsale_reservations_total", "outcome" => "reserved").increment(1);
            Ok((StatusCode::ACCEPTED, Json(reserved)))
        }
        Err(err) => Err(count(err)),
    }
}

/// Ends an admitted user's turn once their reservation was accepted (`202`):
/// the next user in line gets it. Any other answer leaves the turn running, to
/// be tried again within it: `sold_out` (units may come back within the turn,
/// and the answer may come from a moment's view of a sibling shard), a reserve
/// that failed (Redis or the broker unreachable, the reservation withdrawn),
/// and `already_reserved`, whose reservation may still be in flight on another
/// request and be withdrawn (the request that gets its `202` settles the turn).
async fn settle_turn(
    state: &AppState,
    activity: &Activity,
    user: &User,
    result: &AppResult<Reserved>,
) {
    if result.is_err() {
        return;
    }
    if let Err(err) = state.waiting_room.settle(activity, &user.id).await {
        tracing::warn!(error = %err, activity_id = %activity.id, "settling a turn failed; it runs out by itself");
    }
}

/// The answer to a user whose turn ran out: `already_reserved` when they hold
/// a reservation all the same (made within the turn and answered after its end,
/// or whose answer was lost), which settles the turn; `not_admitted` otherwise.
async fn ran_out(state: &AppState, activity: &Activity, user: &User) -> AppResult<AppError> {
    let held = state
        .stock
        .reservation_of(&activity.id, activity.stock_shards, &user.id)
        .await
        .map_err(redis_down)?;
    let Some(reservation_id) = held else {
        return Ok(AppError::NotAdmitted);
    };
    if let Err(err) = state.waiting_room.settle(activity, &user.id).await {
        tracing::warn!(error = %err, activity_id = %activity.id, "settling a turn failed");
    }
    Ok(AppError::AlreadyReserved { reservation_id })
}

/// How long a user told `sold_out` by the waiting room waits before asking
/// again whether units came back (at most half a turn).
const SOLD_OUT_RETRY_SECS: u64 = 30;

/// A user's ticket and place in a sale's waiting room.
#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct QueuePlace {
    ticket: String,
    /// `waiting`, `admitted`, `sold_out` or `expired`.
    state: &'static str,
    /// Place in line, 1 first (once the draw has placed the user).
    #[serde(skip_serializing_if = "Option::is_none")]
    position: Option<u64>,
    /// Users in line before this one.
    #[serde(skip_serializing_if = "Option::is_none")]
    ahead: Option<u64>,
    /// Admitted: reserve before this time, or the turn goes to the next user.
    #[serde(skip_serializing_if = "Option::is_none")]
    admitted_until: Option<DateTime<Utc>>,
}

impl QueuePlace {
    fn of(place: Place) -> Option<QueuePlace> {
        let empty = |ticket: String, state| QueuePlace {
            ticket,
            state,
            position: None,
            ahead: None,
            admitted_until: None,
        };
        Some(match place {
            Place::None => return None,
            Place::Waiting { ticket, ahead } => QueuePlace {
                position: ahead.map(|a| a + 1),
                ahead,
                ..empty(ticket, "waiting")
            },
            Place::Admitted { ticket, until } => QueuePlace {
                admitted_until: until,
                ..empty(ticket, "admitted")
            },
            Place::SoldOut { ticket } => empty(ticket, "sold_out"),
            Place::Expired { ticket } => empty(ticket, "expired"),
        })
    }

    /// How long a waiting client should wait before asking again: until the
    /// start before the draw, then longer the further back it stands.
    fn retry_after(&self, activity: &Activity, now: DateTime<Utc>, turn_secs: u64) -> Option<u64> {
        let sold_out_retry = SOLD_OUT_RETRY_SECS.min(turn_secs / 2).max(1);
        match self.state {
            "waiting" => {}
            // Not final while the sale is open: units may come back. Slowly,
            // but often enough that a turn given on a reopening is not missed.
            "sold_out" if now < activity.ends_at => return Some(sold_out_retry),
            _ => return None,
        }
        Some(match self.ahead {
            None => (activity.starts_at - now).num_seconds().clamp(1, 30) as u64,
            Some(a) if a < 100 => 1,
            Some(a) if a < 1_000 => 2,
            Some(_) => 5,
        })
    }
}

/// The activity of a sale with a waiting room.
fn room_for(state: &AppState, sku: &str, now: DateTime<Utc>) -> AppResult<Arc<Activity>> {
    let activity = activity_for(state, sku, now)?;
    if activity.admission != Admission::WaitingRoom {
        return Err(AppError::not_found(
            "this sale has no waiting room: reserve directly",
        ));
    }
    Ok(activity)
}

fn with_retry_after(
    state: &AppState,
    status: StatusCode,
    place: QueuePlace,
    activity: &Activity,
    now: DateTime<Utc>,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let retry = place.retry_after(activity, now, state.settings.waiting_room.turn_secs);
    let mut response = (status, Json(place)).into_response();
    if let Some(secs) = retry {
        response.headers_mut().insert(
            axum::http::header::RETRY_AFTER,
            axum::http::HeaderValue::from(secs),
        );
    }
    response
}

#[utoipa::path(
    post,
    path = "/flash/{sku}/queue",
    tag = "users",
    security(("user" = [])),
    params(("sku" = String, Path, description = "The SKU on sale")),
    responses(
        (status = 201, description = "Joined: waiting (with Retry-After)", body = QueuePlace),
        (status = 200, description = "Joined before: the same ticket, and the place now", body = QueuePlace),
        (status = 401, description = "unauthorized: no valid user token", body = crate::error::ErrorBody),
        (status = 403, description = "not_started: the room opens waiting_room_secs before the start; ended", body = crate::error::ErrorBody),
        (status = 404, description = "not_found: no sale for this SKU, or it has no waiting room", body = crate::error::ErrorBody),
        (status = 429, description = "rate_limited, with Retry-After", body = crate::error::ErrorBody),
        (status = 503, description = "unavailable, with Retry-After", body = crate::error::ErrorBody),
    )
)]
/// `POST /flash/{sku}/queue`: joins the sale's waiting room, once.
pub async fn join_queue(
    State(state): State<AppState>,
    Path(sku): Path<String>,
    Extension(user): Extension<User>,
) -> AppResult<axum::response::Response> {
    let now = Utc::now();
    let activity = room_for(&state, &sku, now)?;
    if now < activity.joins_from() {
        return Err(AppError::NotStarted);
    }
    if activity.window(now) == Window::Ended {
        return Err(AppError::Ended);
    }
    let (_, joined_now) = state
        .waiting_room
        .join(&activity, &user.id)
        .await
        .map_err(redis_down)?
        .ok_or(AppError::Unavailable(
            "the waiting room is being rebuilt; join again in a moment",
        ))?;
    if joined_now {
        metrics::counter!("flashsale_waiting_room_joins_total").increment(1);
    }
    let place = state
        .waiting_room
        .place(&activity, &user.id, now)
        .await
        .map_err(redis_down)?;
    let place =
        QueuePlace::of(place).ok_or(AppError::Unavailable("the waiting room lost the join"))?;
    let status = if joined_now {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok(with_retry_after(&state, status, place, &activity, now))
}

#[utoipa::path(
    get,
    path = "/flash/{sku}/queue",
    tag = "users",
    security(("user" = [])),
    params(("sku" = String, Path, description = "The SKU on sale")),
    responses(
        (status = 200, description = "The user's place: waiting (with Retry-After), admitted, sold_out or expired", body = QueuePlace),
        (status = 401, description = "unauthorized: no valid user token", body = crate::error::ErrorBody),
        (status = 404, description = "not_found: no such sale or waiting room, or the user never joined", body = crate::error::ErrorBody),
        (status = 429, description = "rate_limited, with Retry-After", body = crate::error::ErrorBody),
        (status = 503, description = "unavailable, with Retry-After", body = crate::error::ErrorBody),
    )
)]
/// `GET /flash/{sku}/queue`: the user's place, in one Redis round trip.
pub async fn queue_status(
    State(state): State<AppState>,
    Path(sku): Path<String>,
    Extension(user): Extension<User>,
) -> AppResult<axum::response::Response> {
    let now = Utc::now();
    let activity = room_for(&state, &sku, now)?;
    let place = state
        .waiting_room
        .place(&activity, &user.id, now)
        .await
        .map_err(redis_down)?;
    let place = QueuePlace::of(place)
        .ok_or_else(|| AppError::not_found("this user has not joined the waiting room"))?;
    Ok(with_retry_after(
        &state,
        StatusCode::OK,
        place,
        &activity,
        now,
    ))
}

/// Counts every refused reservation by its code.
fn count(err: AppError) -> AppError {
    metrics::counter!("flashsale_reservations_total", "outcome" => err.code()).increment(1);
    err
}

async fn reserve_and_publish(
    state: &AppState,
    activity: &Activity,
    user: &User,
    quantity: u32,
    now: DateTime<Utc>,
) -> AppResult<Reserved> {
    let new_id = crate::stock::new_reservation_id(&user.id, activity.stock_shards);
    // The sold-out gate was asked before this task was spawned (an open sale),
    // or is passed by design (a user holding a waiting-room turn).
    let reserved = state
        .stock
        .reserve_past_gate(
            &activity.id,
            &user.id,
            quantity,
            &new_id,
            now.timestamp_millis(),
        )
        .await;
    let outcome = match reserved {
        Ok(outcome) => outcome,
        Err(err) => {
            tracing::warn!(error = %err, activity_id = %activity.id, "reserve script failed");
            // The script may have run with its answer lost; returning the units of a
            // reservation that does not exist is a no-op, so try once.
            let lost = Incoming {
                reservation_id: new_id,
                activity_id: activity.id.clone(),
                user_id: user.id.to_string(),
                quantity,
            };
            undo(state, &lost).await;
            return Err(AppError::Unavailable("stock store unreachable"));
        }
    };
    let reservation_id = match outcome {
        ReserveOutcome::Reserved { reservation_id } => reservation_id,
        // The client sent the script again after a lost answer (a failover) and
        // the first run had reserved: the reservation is this request's own.
        ReserveOutcome::AlreadyReserved { reservation_id } if reservation_id == new_id => {
            reservation_id
        }
        ReserveOutcome::AlreadyReserved { reservation_id } => {
            return Err(AppError::AlreadyReserved { reservation_id })
        }
        ReserveOutcome::SoldOut => return Err(AppError::SoldOut),
        ReserveOutcome::Paused => return Err(AppError::Paused),
        ReserveOutcome::NotLoaded => {
            tracing::warn!(activity_id = %activity.id, "activity is not loaded in Redis");
            state.reconcile_now.notify_one();
            return Err(AppError::Unavailable("the sale is not loaded"));
        }
    };
    let reserved = Reserved {
        reservation_id: reservation_id.clone(),
        activity_id: activity.id.clone(),
        sku: activity.sku.clone(),
        quantity,
        status: "pending",
    };
    let incoming = Incoming {
        reservation_id: reservation_id.clone(),
        activity_id: activity.id.clone(),
        user_id: user.id.to_string(),
        quantity,
    };
    // Replicas first hold the reservation itself: until it is published,
    // withdrawing it is a Redis matter alone, and the client holds nothing.
    if let Err(err) = replicated(state, &incoming).await {
        undo(state, &incoming).await;
        return Err(err);
    }
    let message = ReservationMessage {
        reservation_id: reservation_id.clone(),
        activity_id: activity.id.clone(),
        sku: activity.sku.clone(),
        user_id: user.id.to_string(),
        quantity,
        reserved_at: now,
    };
    match state.publisher.publish(&message).await {
        Ok(()) => {}
        Err(err) if err.never_sent() => {
            tracing::error!(error = %err, %reservation_id, "publish failed before sending; returning the units");
            metrics::counter!("flashsale_kafka_publish_failures_total", "sent" => "no")
                .increment(1);
            undo(state, &incoming).await;
            return Err(AppError::Unavailable("order queue unreachable"));
        }
        Err(err) => {
            // The message may still land: let MySQL decide, once, between its order
            // and its withdrawal.
            tracing::error!(error = %err, %reservation_id, "publish outcome unknown; withdrawing the reservation");
            metrics::counter!("flashsale_kafka_publish_failures_total", "sent" => "unknown")
                .increment(1);
            return withdraw(state, incoming, reserved).await;
        }
    }
    // The message is in the queue. The 202 is a promise, so first make it one in
    // Redis: once acknowledged, nobody may withdraw the reservation any more.
    match state
        .stock
        .set_fate(&activity.id, &reservation_id, true)
        .await
    {
        Ok(FateChange::Done) => {
            replicated(state, &incoming).await?;
            Ok(reserved)
        }
        Ok(change) => {
            // The reconciler withdrew it (a publish slower than the pending
            // deadline), or Redis lost it. Its message may make it an order; MySQL
            // says which.
            tracing::warn!(?change, %reservation_id, "reservation no longer acknowledgeable; asking MySQL");
            withdraw(state, incoming, reserved).await
        }
        Err(err) => {
            tracing::warn!(error = %err, %reservation_id, "could not acknowledge the reservation; withdrawing it");
            withdraw(state, incoming, reserved).await
        }
    }
}

/// With replicas configured (`redis.min_replicas_acked`), a reservation waits until
/// they hold it twice: before its message is published (a failure then withdraws
/// it, in Redis alone), and once acknowledged, before the `202` (so a failover to
/// a replica cannot forget the promise). If they fail at that second point, which
/// takes a replica failing within a millisecond, the client gets `503`; the
/// reservation stays acknowledged on the primary and its message makes it an
/// order, which the user's reservation status shows.
async fn replicated(state: &AppState, incoming: &Incoming) -> AppResult<()> {
    let reservation_id = &incoming.reservation_id;
    match state
        .stock
        .replicated(&incoming.activity_id, &incoming.user_id, reservation_id)
        .await
    {
        Ok(true) => Ok(()),
        other => {
            tracing::warn!(?other, %reservation_id, "replicas did not acknowledge the reservation in time");
            metrics::counter!("flashsale_redis_replica_ack_failures_total").increment(1);
            Err(AppError::Unavailable("stock store replicas unreachable"))
        }
    }
}

/// Withdraws a reservation whose message may or may not be in the queue, through
/// the one decision step (`OrderWriter::withdraw`): a `202` if MySQL already holds
/// its order, a `503` otherwise. If MySQL cannot be reached it stays marked
/// withdrawing in Redis, and the reconciler decides it.
async fn withdraw(state: &AppState, incoming: Incoming, reserved: Reserved) -> AppResult<Reserved> {
    match writer(state)
        .withdraw(
            std::slice::from_ref(&incoming),
            "its publish failed or timed out",
        )
        .await
    {
        Ok(decided) => {
            if decided
                .iter()
                .any(|(_, d)| matches!(d, Decision::Ordered | Decision::Duplicate))
            {
                tracing::info!(reservation_id = %incoming.reservation_id, "its message arrived first: an order");
                return Ok(reserved);
            }
            if decided.is_empty() {
                // Acknowledged already (its acknowledgement's answer was lost): a
                // promise, kept once the replicas hold it.
                replicated(state, &incoming).await?;
                return Ok(reserved);
            }
        }
        Err(err) => {
            tracing::warn!(error = %err, reservation_id = %incoming.reservation_id, "withdrawal not recorded; the reconciler finishes it");
        }
    }
    Err(AppError::Unavailable("order queue unreachable"))
}

/// Returns a reservation that never reached the queue, and the user's right to try
/// again. If this fails too, the reservation stays pending in Redis, where the
/// reconciler finds it (and withdraws it, since it was never acknowledged).
async fn undo(state: &AppState, m: &Incoming) {
    writer(state).give_back(m, RefundMode::Undo, "undone").await;
}

/// The one decision step, over this instance's MySQL pool and Redis handle.
fn writer(state: &AppState) -> OrderWriter {
    OrderWriter {
        repo: state.orders.clone(),
        stock: state.stock.clone(),
    }
}

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct ReservationView {
    reservation_id: String,
    status: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    order_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    expires_at: Option<DateTime<Utc>>,
}

#[utoipa::path(
    get,
    path = "/flash/{sku}/reservation",
    tag = "users",
    security(("user" = [])),
    params(("sku" = String, Path, description = "The SKU on sale")),
    responses(
        (status = 200, description = "The user's reservation: pending, ordered, paid, cancelled or failed", body = ReservationView),
        (status = 401, description = "unauthorized", body = crate::error::ErrorBody),
        (status = 404, description = "not_found: no such sale, or the user holds no reservation", body = crate::error::ErrorBody),
        (status = 429, description = "rate_limited", body = crate::error::ErrorBody),
        (status = 503, description = "unavailable", body = crate::error::ErrorBody),
    )
)]
/// `GET /flash/{sku}/reservation`: MySQL's order when there is one, else Redis's
/// pending reservation.
pub async fn reservation(
    State(state): State<AppState>,
    Path(sku): Path<String>,
    Extension(user): Extension<User>,
) -> AppResult<Json<ReservationView>> {
    let activity = activity_for(&state, &sku, Utc::now())?;
    if let Some(order) = state.orders.by_user(&activity.id, &user.id).await? {
        let status = match order.status {
            OrderStatus::PendingPayment => "ordered",
            OrderStatus::Paid => "paid",
            OrderStatus::Cancelled => "cancelled",
            OrderStatus::Failed => "failed",
        };
        let live = matches!(
            order.status,
            OrderStatus::PendingPayment | OrderStatus::Paid | OrderStatus::Cancelled
        );
        return Ok(Json(ReservationView {
            reservation_id: order.reservation_id,
            status,
            order_id: live.then(|| order.id.to_string()),
            expires_at: order
                .expires_at
                .filter(|_| order.status == OrderStatus::PendingPayment),
        }));
    }
    let pending = state
        .stock
        .reservation_of(&activity.id, activity.stock_shards, &user.id)
        .await
        .map_err(|e| {
            tracing::warn!(error = %e, "reservation lookup failed");
            AppError::Unavailable("stock store unreachable")
        })?;
    match pending {
        Some(reservation_id) => Ok(Json(ReservationView {
            reservation_id,
            status: "pending",
            order_id: None,
            expires_at: None,
        })),
        None => Err(AppError::not_found("you hold no reservation for this sale")),
    }
}
