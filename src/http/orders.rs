//! Payment: `POST /orders/{order_id}/pay`.

use axum::extract::{Path, State};
use axum::{Extension, Json};
use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::auth::User;
use crate::error::{redis_down, AppError, AppResult};
use crate::orders::{Order, OrderStatus, PayOutcome};
use crate::state::AppState;
use crate::stock::ViewChange;

#[derive(Debug, Serialize, utoipa::ToSchema)]
pub struct OrderView {
    order_id: String,
    reservation_id: String,
    activity_id: String,
    quantity: u32,
    status: &'static str,
    created_at: DateTime<Utc>,
    #[serde(skip_serializing_if = "Option::is_none")]
    expires_at: Option<DateTime<Utc>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    paid_at: Option<DateTime<Utc>>,
}

impl From<Order> for OrderView {
    fn from(o: Order) -> Self {
        OrderView {
            order_id: o.id.to_string(),
            reservation_id: o.reservation_id,
            activity_id: o.activity_id,
            quantity: o.quantity,
            status: o.status.as_str(),
            created_at: o.created_at,
            expires_at: o.expires_at,
            paid_at: o.paid_at,
        }
    }
}

#[utoipa::path(
    post,
    path = "/orders/{order_id}/pay",
    tag = "users",
    security(("user" = [])),
    params(("order_id" = String, Path, description = "The order's id")),
    responses(
        (status = 200, description = "The paid order (paying twice is 200 again)", body = OrderView),
        (status = 401, description = "unauthorized", body = crate::error::ErrorBody),
        (status = 404, description = "not_found: no such order of this user", body = crate::error::ErrorBody),
        (status = 409, description = "expired: cancelled for non-payment", body = crate::error::ErrorBody),
        (status = 429, description = "rate_limited", body = crate::error::ErrorBody),
        (status = 503, description = "unavailable", body = crate::error::ErrorBody),
    )
)]
/// Pays the caller's order. Anyone else's order is 404 (its existence is not
/// revealed); paying twice answers 200 again; a lapsed order is `409 expired`.
pub async fn pay(
    State(state): State<AppState>,
    Path(order_id): Path<String>,
    Extension(user): Extension<User>,
) -> AppResult<Json<OrderView>> {
    let id: u64 = order_id
        .parse()
        .map_err(|_| AppError::not_found("no such order"))?;
    let order = state
        .orders
        .by_id(id)
        .await?
        .filter(|o| *o.user_id == *user.id)
        .ok_or_else(|| AppError::not_found("no such order"))?;
    // The reservation-status view a poll cached is dropped before MySQL changes
    // the order and none is cached until the change is committed (see
    // `stock::views`); without Redis the payment waits (503, nothing changed).
    let changing = order.status == OrderStatus::PendingPayment;
    if changing
        && !state
            .stock
            .view_change(
                &order.activity_id,
                &order.reservation_id,
                &user.id,
                ViewChange::Begin,
            )
            .await
            .map_err(redis_down)?
    {
        // Paid all the same (refusing would let the order lapse meanwhile):
        // only a failover in this very window could bring back a view from
        // before, and the end mark below moves the version past it again.
        tracing::warn!(
            order_id = id,
            "the payment's begin mark was not replicated in time"
        );
    }
    let paid = state.orders.pay(id, &user.id).await;
    if changing {
        if let Err(err) = state
            .stock
            .view_change(
                &order.activity_id,
                &order.reservation_id,
                &user.id,
                ViewChange::End,
            )
            .await
        {
            // The version stays odd: this user's polls ask MySQL from now on.
            tracing::warn!(error = %err, order_id = id, "the payment's end was not marked for the reservation view");
        }
    }
    match paid? {
        PayOutcome::Paid(order) => {
            metrics::counter!("flashsale_orders_paid_total").increment(1);
            tracing::info!(order_id = id, "order paid");
            Ok(Json(order.into()))
        }
        PayOutcome::AlreadyPaid(order) => Ok(Json(order.into())),
        PayOutcome::Expired => Err(AppError::Expired),
        PayOutcome::NotFound => Err(AppError::not_found("no such order")),
    }
}
