//! The one error type of the HTTP API. Each variant's doc names its status and code;
//! every non-2xx answer is `{"code": "...", "message": "..."}` (plus extra fields for
//! some codes). Internal details are logged, never sent.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    /// 422 `invalid_request`: a field is missing, malformed or out of range.
    #[error("{0}")]
    InvalidRequest(String),
    /// 413 `payload_too_large`.
    #[error("request body is larger than {limit} bytes")]
    PayloadTooLarge { limit: usize },
    /// 401 `unauthorized`: no credentials, bad signature, expired or malformed token.
    #[error("{0}")]
    Unauthorized(&'static str),
    /// 404 `not_found`.
    #[error("{0}")]
    NotFound(String),
    /// 405 `method_not_allowed`.
    #[error("method not allowed")]
    MethodNotAllowed,
    /// 409 `conflict`: the request clashes with the current state.
    #[error("{0}")]
    Conflict(String),
    /// 409 `already_reserved`: the user holds a reservation for this activity.
    #[error("you already hold a reservation for this sale")]
    AlreadyReserved { reservation_id: String },
    /// 409 `sold_out`.
    #[error("sold out")]
    SoldOut,
    /// 409 `expired`: the order was cancelled for non-payment.
    #[error("the order expired before it was paid")]
    Expired,
    /// 403 `not_started`: the activity's window has not opened.
    #[error("the sale has not started")]
    NotStarted,
    /// 403 `ended`: the activity's window has closed.
    #[error("the sale has ended")]
    Ended,
    /// 403 `not_admitted`: the sale has a waiting room and this user holds no turn.
    #[error("not admitted: join the waiting room (POST /flash/{{sku}}/queue) and reserve when your turn comes")]
    NotAdmitted,
    /// 429 `rate_limited` with `Retry-After`.
    #[error("too many requests, retry in {retry_after_secs} s")]
    RateLimited { retry_after_secs: u64 },
    /// 503 `paused` with `Retry-After`: an operator paused the activity.
    #[error("the sale is paused")]
    Paused,
    /// 503 `unavailable` with `Retry-After`: a dependency cannot be reached or the
    /// service is overloaded. No stock is held when this is answered.
    #[error("temporarily unavailable: {0}")]
    Unavailable(&'static str),
    /// 500 `internal`: logged with its cause chain; the body says nothing more.
    #[error(transparent)]
    Internal(#[from] anyhow::Error),
}

impl AppError {
    pub fn status(&self) -> StatusCode {
        match self {
            AppError::InvalidRequest(_) => StatusCode::UNPROCESSABLE_ENTITY,
            AppError::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            AppError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            AppError::NotFound(_) => StatusCode::NOT_FOUND,
            AppError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            AppError::Conflict(_)
            | AppError::AlreadyReserved { .. }
            | AppError::SoldOut
            | AppError::Expired => StatusCode::CONFLICT,
            AppError::NotStarted | AppError::Ended | AppError::NotAdmitted => StatusCode::FORBIDDEN,
            AppError::RateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
            AppError::Paused | AppError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            AppError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    pub fn code(&self) -> &'static str {
        match self {
            AppError::InvalidRequest(_) => "invalid_request",
            AppError::PayloadTooLarge { .. } => "payload_too_large",
            AppError::Unauthorized(_) => "unauthorized",
            AppError::NotFound(_) => "not_found",
            AppError::MethodNotAllowed => "method_not_allowed",
            AppError::Conflict(_) => "conflict",
            AppError::AlreadyReserved { .. } => "already_reserved",
            AppError::SoldOut => "sold_out",
            AppError::Expired => "expired",
            AppError::NotStarted => "not_started",
            AppError::Ended => "ended",
            AppError::NotAdmitted => "not_admitted",
            AppError::RateLimited { .. } => "rate_limited",
            AppError::Paused => "paused",
            AppError::Unavailable(_) => "unavailable",
            AppError::Internal(_) => "internal",
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        AppError::InvalidRequest(message.into())
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        AppError::NotFound(message.into())
    }
}

/// A database error is a client's business only when the database cannot be
/// reached (503); anything else is a bug or a broken schema (500).
impl From<sqlx::Error> for AppError {
    fn from(err: sqlx::Error) -> Self {
        match err {
            sqlx::Error::PoolTimedOut | sqlx::Error::Io(_) | sqlx::Error::PoolClosed => {
                tracing::warn!(error = %err, "database unavailable");
                AppError::Unavailable("database")
            }
            other => AppError::Internal(anyhow::Error::new(other).context("database query failed")),
        }
    }
}

/// Redis could not be reached: `503`, logged, nothing held.
pub fn redis_down(err: redis::RedisError) -> AppError {
    tracing::warn!(error = %err, "redis call failed");
    AppError::Unavailable("stock store unreachable")
}

// The OpenAPI document's name for the shape that `AppError` answers with (`Wire`
// writes it); its doc comment below is what clients read.
/// Every error answer: `{"code", "message"}`, and for `already_reserved` the
/// existing `reservation_id`.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct ErrorBody {
    /// A fixed snake_case code (docs/API.md).
    pub code: String,
    /// Human text.
    pub message: String,
    /// `already_reserved` only: the reservation the user holds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reservation_id: Option<String>,
}

/// The documented error shape, serialized as is: no map is built per answer.
#[derive(serde::Serialize)]
struct Wire<'a> {
    code: &'static str,
    message: std::borrow::Cow<'a, str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reservation_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    limit: Option<usize>,
}

impl IntoResponse for AppError {
    fn into_response(self) -> Response {
        let status = self.status();
        let message = match &self {
            AppError::Internal(err) => {
                tracing::error!(error = ?err, "internal error");
                "internal error".into()
            }
            other => other.to_string().into(),
        };
        let mut body = Wire {
            code: self.code(),
            message,
            reservation_id: None,
            limit: None,
        };
        let mut retry_after = None;
        match &self {
            AppError::AlreadyReserved { reservation_id } => {
                body.reservation_id = Some(reservation_id);
            }
            AppError::RateLimited { retry_after_secs } => {
                retry_after = Some((*retry_after_secs).max(1));
            }
            AppError::Paused | AppError::Unavailable(_) => retry_after = Some(1),
            AppError::PayloadTooLarge { limit } => body.limit = Some(*limit),
            _ => {}
        }
        let mut response = (status, Json(body)).into_response();
        if let Some(secs) = retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

pub type AppResult<T> = Result<T, AppError>;
