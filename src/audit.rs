//! The operators' audit trail in MySQL (`admin_audit`): who changed what, when,
//! and what they were answered.
//!
//! The HTTP layer (`http::audit`) writes one entry per admin request that
//! changes something, after the action, with its answer. The order is chosen:
//! an action's own writes span Redis and MySQL, so no transaction can hold it
//! and its entry together; writing the entry first would record actions that
//! then never ran, or ran differently. Written after, an entry says what
//! happened. If that write fails, the action still stands (it is done, and
//! undoing it would be a second change nobody asked for): the entry is logged in
//! full at error level and `flashsale_audit_write_failures_total` counts it, so
//! the trail can be completed from the logs.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::MySqlPool;

use crate::operators::Operator;

/// Most entries one `GET /admin/audit` returns.
pub const MAX_LIMIT: u32 = 1000;
/// Entries `GET /admin/audit` returns when no limit is given.
pub const DEFAULT_LIMIT: u32 = 100;

/// Longest request text kept (method, path and body).
const REQUEST_CHARS: usize = 2000;
/// Longest answer summary kept.
const SUMMARY_CHARS: usize = 1000;

/// One recorded admin action.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct Entry {
    /// Increasing with every entry.
    pub id: u64,
    /// When the answer was known (UTC, milliseconds).
    pub at: DateTime<Utc>,
    /// The operator's name; `admin_token` for the shared token.
    pub operator: String,
    /// How the operator was identified: `shared`, `named` or `jwt`.
    pub via: String,
    /// `create`, `preload`, `pause`, `resume`, `reconcile` or `top_up`.
    pub action: String,
    /// The activity acted on, when the request named a valid id.
    pub activity_id: Option<String>,
    /// The request's id, the service's own, as in the logs and the answer's
    /// `x-request-id`.
    pub request_id: Option<String>,
    /// The `X-Request-Id` the client sent, if any (1 to 128 visible ASCII
    /// characters; anything else is not kept).
    pub client_request_id: Option<String>,
    /// Method, path and body as sent (cut at 2,000 characters).
    pub request: String,
    /// The answer's HTTP status.
    pub status: u16,
    /// The error code of a refused action; absent when it succeeded.
    pub code: Option<String>,
    /// The error message, or the answer's body (cut at 1,000 characters).
    pub summary: String,
    /// How long the action took.
    pub elapsed_ms: u32,
}

/// An entry to write.
#[derive(Debug, Clone)]
pub struct NewEntry<'a> {
    pub at: DateTime<Utc>,
    pub operator: &'a Operator,
    pub action: &'a str,
    pub activity_id: Option<&'a str>,
    pub request_id: Option<&'a str>,
    pub client_request_id: Option<&'a str>,
    pub request: &'a str,
    pub status: u16,
    pub code: Option<&'a str>,
    pub summary: &'a str,
    pub elapsed_ms: u32,
}

#[derive(Clone)]
pub struct AuditRepo {
    pool: MySqlPool,
}

impl AuditRepo {
    pub fn new(pool: MySqlPool) -> Self {
        AuditRepo { pool }
    }

    /// Writes one entry; its id.
    pub async fn record(&self, e: &NewEntry<'_>) -> Result<u64, sqlx::Error> {
        let done = sqlx::query(
            "INSERT INTO admin_audit \
             (at, operator, via, action, activity_id, request_id, client_request_id, request, \
              status, code, summary, elapsed_ms) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(e.at.naive_utc())
        .bind(&*e.operator.name)
        .bind(e.operator.via.as_str())
        .bind(e.action)
        .bind(e.activity_id)
        .bind(e.request_id.map(|id| cut(id, 128)))
        .bind(e.client_request_id.map(|id| cut(id, 128)))
        .bind(cut(e.request, REQUEST_CHARS))
        .bind(e.status)
        .bind(e.code)
        .bind(cut(e.summary, SUMMARY_CHARS))
        .bind(e.elapsed_ms)
        .execute(&self.pool)
        .await?;
        Ok(done.last_insert_id())
    }

    /// The newest `limit` entries, of one activity or of all, newest first.
    pub async fn list(
        &self,
        activity_id: Option<&str>,
        limit: u32,
    ) -> Result<Vec<Entry>, sqlx::Error> {
        const COLUMNS: &str = "id, at, CAST(operator AS CHAR) AS operator, CAST(via AS CHAR) AS via, action, activity_id, \
                               request_id, client_request_id, request, status, code, summary, \
                               elapsed_ms";
        // Two statements, so that one activity's entries are read through
        // `admin_audit_by_activity` rather than by walking every entry.
        match activity_id {
            Some(id) => {
                let sql = format!(
                    "SELECT {COLUMNS} FROM admin_audit WHERE activity_id = ? \
                     ORDER BY id DESC LIMIT ?"
                );
                let query = sqlx::query_as(&sql).bind(id).bind(limit);
                query.fetch_all(&self.pool).await
            }
            None => {
                let sql = format!("SELECT {COLUMNS} FROM admin_audit ORDER BY id DESC LIMIT ?");
                let query = sqlx::query_as(&sql).bind(limit);
                query.fetch_all(&self.pool).await
            }
        }
    }
}

/// At most `max` characters of `text`, `…` marking a cut.
pub fn cut(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_owned();
    }
    let mut out: String = text.chars().take(max.saturating_sub(1)).collect();
    out.push('…');
    out
}

#[cfg(test)]
mod tests {
    use super::cut;

    #[test]
    fn cuts_at_characters_not_bytes() {
        assert_eq!(cut("abc", 3), "abc");
        assert_eq!(cut("abcd", 3), "ab…");
        assert_eq!(cut("ééééé", 4), "ééé…");
        assert_eq!(cut("", 1), "");
    }
}
