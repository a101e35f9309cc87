//! Request bodies: read with the size limit, parsed as JSON, and every failure
//! turned into the API's error shape (413 or 422), never axum's plain-text rejection.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use serde::de::DeserializeOwned;

use crate::error::AppError;

/// Maps a failure to read the body: too large → 413, anything else → 422.
pub fn read(body: Result<Bytes, BytesRejection>, limit: usize) -> Result<Bytes, AppError> {
    body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            AppError::PayloadTooLarge { limit }
        } else {
            AppError::invalid(format!("could not read the request body: {rejection}"))
        }
    })
}

/// Parses a JSON body. An empty body, or JSON `null`, is `None`.
pub fn json<T: DeserializeOwned>(bytes: &[u8]) -> Result<Option<T>, AppError> {
    if bytes.iter().all(u8::is_ascii_whitespace) || bytes.trim_ascii() == b"null" {
        return Ok(None);
    }
    serde_json::from_slice(bytes)
        .map(Some)
        .map_err(|e| AppError::invalid(format!("invalid JSON body: {e}")))
}

/// Parses a JSON body that must be present.
pub fn required_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, AppError> {
    json(bytes)?.ok_or_else(|| AppError::invalid("a JSON body is required"))
}
