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

/// A whole number as JSON Schema counts them: `5` and `5.0` alike.
pub fn whole_number(v: &serde_json::Value) -> Option<u64> {
    v.as_u64().or_else(|| {
        v.as_f64()
            .filter(|f| f.fract() == 0.0 && *f >= 0.0 && *f <= 9_007_199_254_740_992.0)
            .map(|f| f as u64)
    })
}

/// Serde: an `i64` field that also takes whole numbers written as `5.0`.
pub fn whole_i64<'de, D: serde::Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
    use serde::Deserialize;
    let v = serde_json::Value::deserialize(d)?;
    v.as_i64()
        .or_else(|| {
            v.as_f64()
                .filter(|f| f.fract() == 0.0 && f.abs() <= 9_007_199_254_740_992.0)
                .map(|f| f as i64)
        })
        .ok_or_else(|| serde::de::Error::custom(format!("expected a whole number, got {v}")))
}

/// Parses a JSON body that must be present.
pub fn required_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, AppError> {
    json(bytes)?.ok_or_else(|| AppError::invalid("a JSON body is required"))
}
