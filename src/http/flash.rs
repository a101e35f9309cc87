//! The user-facing sale endpoints: status, reserve, reservation status.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use tracing::Instrument;

use super::body;
use crate::activity::{Activity, Admission, Window};
use crate::auth::User;
use crate::error::{redis_down, AppError, AppResult};
use crate::input::{is_valid_sku, whole_number};
use crate::orders::OrderStatus;
use crate::reservation::Outcome;
use crate::state::AppState;
use crate::stock::Polled;
use crate::waiting_room::{Joining, Place, Turn};

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
    /// `open` (first come, first served) or `waiting_room` (join
    /// `/flash/{sku}/queue` first).
    admission: Admission,
    /// With a waiting room: when users may start joining it.
    #[serde(skip_serializing_if = "Option::is_none")]
    queue_opens_at: Option<DateTime<Utc>>,
    /// What one unit costs, in the currency's minor units (a sale with a price).
    #[serde(skip_serializing_if = "Option::is_none")]
    price: Option<i64>,
    /// ISO 4217, lower case (a sale with a price).
    #[serde(skip_serializing_if = "Option::is_none")]
    currency: Option<String>,
    /// The service's clock when it answered: a client counts down to
    /// `starts_at` by this clock, not by its own.
    server_time: DateTime<Utc>,
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
    let now = state.stock.clock().now();
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
        admission: activity.admission,
        queue_opens_at: (activity.admission == Admission::WaitingRoom)
            .then(|| activity.joins_from()),
        price: activity.price,
        currency: activity.currency.clone(),
        server_time: now,
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
    let now = state.stock.clock().now();
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
        return Err(count(paused(&state, &activity, &user).await));
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
    // The task runs in the request's span: its log lines carry the request id,
    // and its trace is the request's.
    let task_state = state.clone();
    let task = async move {
        let outcome = task_state
            .reservations
            .reserve(&activity, &user.id, quantity, now)
            .await;
        if waiting_room {
            settle_turn(&task_state, &activity, &user, &outcome).await;
        }
        (outcome, activity)
    };
    let handle = state
        .critical
        .spawn(task.instrument(tracing::Span::current()));
    let (outcome, activity) = handle
        .await
        .map_err(|e| AppError::Internal(anyhow::Error::new(e).context("reserve task failed")))?;
    let reservation_id = accepted(outcome).map_err(count)?;
    metrics::counter!("flashsale_reservations_total", "outcome" => "reserved").increment(1);
    let reserved = Reserved {
        reservation_id,
        activity_id: activity.id.clone(),
        sku: activity.sku.clone(),
        quantity,
        status: "pending",
    };
    Ok((StatusCode::ACCEPTED, Json(reserved)))
}

/// A reservation's outcome as the API answers it: the id of a `202`, or the
/// refusal.
fn accepted(outcome: Outcome) -> AppResult<String> {
    match outcome {
        Outcome::Reserved { reservation_id } => Ok(reservation_id),
        Outcome::AlreadyReserved { reservation_id } => {
            Err(AppError::AlreadyReserved { reservation_id })
        }
        Outcome::SoldOut => Err(AppError::SoldOut),
        Outcome::Paused => Err(AppError::Paused),
        Outcome::Unavailable(why) => Err(AppError::Unavailable(why)),
    }
}

/// Ends an admitted user's turn once their reservation was accepted (`202`):
/// the next user in line gets it. Any other answer leaves the turn running, to
/// be tried again within it: `sold_out` (units may come back within the turn,
/// and the answer may come from a moment's view of a sibling shard), a reserve
/// that failed (Redis or the broker unreachable, the reservation withdrawn),
/// and `already_reserved`, whose reservation may still be in flight on another
/// request and be withdrawn (the request that gets its `202` settles the turn).
async fn settle_turn(state: &AppState, activity: &Activity, user: &User, outcome: &Outcome) {
    if !matches!(outcome, Outcome::Reserved { .. }) {
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

/// The answer to a user while the sale is paused: `already_reserved` when they
/// hold a reservation (a retry of a request whose answer was lost must learn
/// what it holds: `503` says nothing is held), `paused` otherwise, and when
/// Redis cannot say. Not asked during an automatic pause: Redis lost the sale
/// or holds an older build of it, whose buyers say nothing true.
async fn paused(state: &AppState, activity: &Activity, user: &User) -> AppError {
    if activity.auto_paused {
        return AppError::Paused;
    }
    match state
        .stock
        .reservation_of(&activity.id, activity.stock_shards, &user.id)
        .await
    {
        Ok(Some(reservation_id)) => AppError::AlreadyReserved { reservation_id },
        Ok(None) => AppError::Paused,
        Err(err) => {
            tracing::debug!(error = %err, "the paused sale's buyers could not be read");
            AppError::Paused
        }
    }
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
    /// start before the draw; while the draw is being written, a little longer
    /// the longer it has taken; then longer the further back it stands, since
    /// the users ahead are admitted first. Never more than half a turn (1 s when
    /// the turn is shorter than 2 s): a user admitted sooner than the pace
    /// foresaw (a large top-up admits many at once) still has half the turn to
    /// reserve, whatever this instance's clock says about the start.
    fn retry_after(&self, activity: &Activity, now: DateTime<Utc>, turn_secs: u64) -> Option<u64> {
        let most = SOLD_OUT_RETRY_SECS.min(turn_secs / 2).max(1);
        match self.state {
            "waiting" => {}
            // Not final while the sale is open: units may come back. Slowly,
            // but often enough that a turn given on a reopening is not missed.
            "sold_out" if now < activity.ends_at => return Some(most),
            _ => return None,
        }
        let secs = match self.ahead {
            None if now < activity.starts_at => {
                (activity.starts_at - now).num_seconds().max(1) as u64
            }
            None => 1 + (now - activity.starts_at).num_seconds().max(0) as u64 / 4,
            Some(a) => waiting_pace(a),
        };
        Some(secs.clamp(1, most))
    }
}

/// Seconds between two polls of a user with `ahead` users before them: 1 near
/// the front, one more second for every 2,000 users ahead past the first
/// 10,000 (a million users in line, with turns of 60 s, ask about 37,000 times a
/// second, not 200,000 as at a flat 5 s).
fn waiting_pace(ahead: u64) -> u64 {
    match ahead {
        0..100 => 1,
        100..1_000 => 2,
        1_000..10_000 => 5,
        _ => 5 + (ahead - 10_000) / 2_000,
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
        (status = 503, description = "unavailable, with Retry-After: the room is being rebuilt, or the join is not recorded in the database yet (joining again keeps the arrival number)", body = crate::error::ErrorBody),
    )
)]
/// `POST /flash/{sku}/queue`: joins the sale's waiting room, once.
pub async fn join_queue(
    State(state): State<AppState>,
    Path(sku): Path<String>,
    Extension(user): Extension<User>,
) -> AppResult<axum::response::Response> {
    let now = state.stock.clock().now();
    let activity = room_for(&state, &sku, now)?;
    if now < activity.joins_from() {
        return Err(AppError::NotStarted);
    }
    if activity.window(now) == Window::Ended {
        return Err(AppError::Ended);
    }
    let (place, joined_now) = match state
        .waiting_room
        .join(&activity, &user.id, now)
        .await
        .map_err(redis_down)?
    {
        Joining::Joined { place, now } => (place, now),
        Joining::Rebuilding => {
            return Err(AppError::Unavailable(
                "the waiting room is being rebuilt; join again in a moment",
            ))
        }
        Joining::NotRecorded => return Err(AppError::Unavailable(
            "the join could not be recorded; join again in a moment (the arrival number is kept)",
        )),
    };
    if joined_now {
        metrics::counter!("flashsale_waiting_room_joins_total").increment(1);
    }
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
/// `GET /flash/{sku}/queue`: the user's place, in one Redis round trip (none
/// before the start for a user this instance saw join, nor after the draw
/// while the line has not moved); after the end, once Redis no longer holds
/// the room (the sale's state removed), from MySQL's journal, once per user
/// and instance.
pub async fn queue_status(
    State(state): State<AppState>,
    Path(sku): Path<String>,
    Extension(user): Extension<User>,
) -> AppResult<axum::response::Response> {
    let now = state.stock.clock().now();
    let activity = room_for(&state, &sku, now)?;
    let place = match activity.redis_removing {
        true => None,
        false => state
            .waiting_room
            .place(&activity, &user.id, now)
            .await
            .map_err(redis_down)?,
    };
    let place = match place {
        Some(place) => place,
        None => state
            .waiting_room
            .place_from_journal(&activity, &user.id)
            .await
            .map_err(|err| {
                tracing::warn!(error = %format!("{err:#}"), activity_id = %activity.id, "reading an ended room's journal failed");
                AppError::Unavailable("the waiting room's record cannot be read")
            })?,
    };
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
/// `GET /flash/{sku}/reservation`: a reservation still pending is answered from
/// Redis; an order from the copy of its view a poll cached in Redis, while the
/// order has not changed since (`stock::views`); else from MySQL, whose answer is
/// then cached for the next poll, on whichever instance it lands.
pub async fn reservation(
    State(state): State<AppState>,
    Path(sku): Path<String>,
    Extension(user): Extension<User>,
) -> AppResult<Json<ReservationView>> {
    let activity = activity_for(&state, &sku, state.stock.clock().now())?;
    let polled = state
        .stock
        .poll_view(&activity.id, activity.stock_shards, &user.id)
        .await;
    let answered = |by: &'static str| {
        metrics::counter!("flashsale_reservation_polls_total", "answered_from" => by).increment(1);
    };
    let (held, token) = match polled {
        Ok(Polled::Pending { reservation_id }) => {
            answered("redis");
            return Ok(Json(ReservationView::pending(reservation_id)));
        }
        Ok(Polled::Cached { view, token }) => {
            if let Some(view) = ReservationView::from_cache(&view, state.stock.clock().now()) {
                answered("redis");
                return Ok(Json(view));
            }
            (Ok(None), Some(token))
        }
        Ok(Polled::Miss {
            reservation_id,
            token,
        }) => (Ok(reservation_id), token),
        Err(err) => (Err(err), None),
    };
    answered("mysql");
    if let Some(order) = state.orders.by_user(&activity.id, &user.id).await? {
        let view = ReservationView::of_order(order);
        if let (Some(token), Some(cached)) = (token, view.to_cache()) {
            if let Err(err) = state
                .stock
                .fill_view(
                    &activity.id,
                    activity.stock_shards,
                    &user.id,
                    &token,
                    &cached,
                )
                .await
            {
                tracing::debug!(error = %err, "reservation view not cached");
            }
        }
        return Ok(Json(view));
    }
    match held {
        Ok(Some(reservation_id)) => Ok(Json(ReservationView::pending(reservation_id))),
        Ok(None) => Err(AppError::not_found("you hold no reservation for this sale")),
        Err(err) => {
            tracing::warn!(error = %err, "reservation lookup failed");
            Err(AppError::Unavailable("stock store unreachable"))
        }
    }
}

/// A cached view of an order awaiting payment is served only until this long
/// before its deadline: the sweeper cancels it at the deadline, and a poll near
/// it asks MySQL (whose clock decides), whether or not the cancellation's own
/// change reached the cache.
const CACHED_UNTIL_BEFORE_DEADLINE: chrono::Duration = chrono::Duration::seconds(5);

impl ReservationView {
    fn pending(reservation_id: String) -> Self {
        ReservationView {
            reservation_id,
            status: "pending",
            order_id: None,
            expires_at: None,
        }
    }

    fn of_order(order: crate::orders::Order) -> Self {
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
        ReservationView {
            reservation_id: order.reservation_id,
            status,
            order_id: live.then(|| order.id.to_string()),
            expires_at: order
                .expires_at
                .filter(|_| order.status == OrderStatus::PendingPayment),
        }
    }

    /// The copy to cache: orders awaiting payment, paid or cancelled (a failed
    /// one is an incident, rare, and left to MySQL).
    fn to_cache(&self) -> Option<String> {
        if !matches!(self.status, "ordered" | "paid" | "cancelled") {
            return None;
        }
        serde_json::to_string(self).ok()
    }

    /// A cached copy, if it may still be served at `now`.
    fn from_cache(cached: &str, now: DateTime<Utc>) -> Option<Self> {
        #[derive(Deserialize)]
        struct Cached {
            reservation_id: String,
            status: String,
            order_id: Option<String>,
            expires_at: Option<DateTime<Utc>>,
        }
        let c: Cached = serde_json::from_str(cached).ok()?;
        let status = match c.status.as_str() {
            "ordered" => "ordered",
            "paid" => "paid",
            "cancelled" => "cancelled",
            _ => return None,
        };
        if status == "ordered" && c.expires_at? - CACHED_UNTIL_BEFORE_DEADLINE <= now {
            return None;
        }
        Some(ReservationView {
            reservation_id: c.reservation_id,
            status,
            order_id: c.order_id,
            expires_at: c.expires_at,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn room(started: chrono::Duration) -> Activity {
        Activity::room_for_tests(Utc::now() - started)
    }

    fn waiting(ahead: Option<u64>) -> QueuePlace {
        QueuePlace {
            ticket: "t".into(),
            state: "waiting",
            position: ahead.map(|a| a + 1),
            ahead,
            admitted_until: None,
        }
    }

    #[test]
    fn a_waiting_user_asks_again_within_half_a_turn() {
        // (turn, the longest pace): half the turn, at least 1 s, at most 30 s.
        for (turn, most) in [(1, 1), (2, 1), (7, 3), (60, 30), (600, 30)] {
            // Before the start (100 s ahead), while the draw is written (1 s
            // and 400 s after the start), and after it.
            for started in [-100, 1, 400, 4_000] {
                let a = room(chrono::Duration::seconds(started));
                let now = Utc::now();
                for ahead in [None, Some(0), Some(500), Some(50_000), Some(5_000_000)] {
                    let secs = waiting(ahead).retry_after(&a, now, turn);
                    assert!(
                        secs.is_some_and(|s| (1..=most).contains(&s)),
                        "turn {turn}, started {started} s ago, ahead {ahead:?}: {secs:?}"
                    );
                }
            }
        }
        // Far back with a long turn: the longest pace; near the front: 1 s; the
        // draw just begun: 1 s.
        let a = room(chrono::Duration::seconds(1));
        let now = Utc::now();
        assert_eq!(waiting(Some(5_000_000)).retry_after(&a, now, 60), Some(30));
        assert_eq!(waiting(Some(0)).retry_after(&a, now, 60), Some(1));
        assert_eq!(waiting(None).retry_after(&a, now, 60), Some(1));
        // 100 s before the start: at the start, but at most 30 s.
        let a = room(chrono::Duration::seconds(-100));
        assert_eq!(waiting(None).retry_after(&a, Utc::now(), 600), Some(30));
        assert_eq!(waiting(None).retry_after(&a, Utc::now(), 2), Some(1));
    }

    #[test]
    fn the_pace_of_polls_slows_with_the_place_and_never_speeds_up() {
        assert_eq!(waiting_pace(0), 1);
        assert_eq!(waiting_pace(99), 1);
        assert_eq!(waiting_pace(100), 2);
        assert_eq!(waiting_pace(9_999), 5);
        assert_eq!(waiting_pace(12_000), 6);
        assert_eq!(waiting_pace(1_000_000), 500);
        let paces: Vec<u64> = (0..200_000).step_by(97).map(waiting_pace).collect();
        assert!(paces.windows(2).all(|w| w[0] <= w[1]));
    }
}
