//! MySQL access for activities.

use chrono::{DateTime, Utc};
use sqlx::MySqlPool;

use super::{Activity, ValidActivity};
use crate::stock::Build;

const COLUMNS: &str = "id, sku, stock, available, per_user_limit, stock_shards, starts_at, \
                       ends_at, payment_timeout_secs, paused, auto_paused, redis_epoch, created_at";

#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    #[error("an activity with id {0} already exists")]
    DuplicateId(String),
    #[error("sku {sku} already has activity {other} whose window overlaps")]
    Overlap { sku: String, other: String },
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

#[derive(Clone)]
pub struct ActivityRepo {
    pool: MySqlPool,
}

impl ActivityRepo {
    pub fn new(pool: MySqlPool) -> Self {
        ActivityRepo { pool }
    }

    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    /// Inserts an activity unless its SKU has another whose window overlaps.
    /// The SKU's row in `sku_locks` is locked for the transaction, so two concurrent
    /// creations for one SKU are checked one after the other.
    pub async fn create(&self, a: &ValidActivity) -> Result<Activity, CreateError> {
        // The lock row is created outside the transaction (autocommit): two
        // transactions inserting the same new row would deadlock on it.
        sqlx::query("INSERT IGNORE INTO sku_locks (sku) VALUES (?)")
            .bind(&a.sku)
            .execute(&self.pool)
            .await?;
        let mut tx = self.pool.begin().await?;
        sqlx::query("SELECT sku FROM sku_locks WHERE sku = ? FOR UPDATE")
            .bind(&a.sku)
            .execute(&mut *tx)
            .await?;
        let overlapping: Option<(String,)> = sqlx::query_as(
            "SELECT id FROM activities WHERE sku = ? AND starts_at < ? AND ends_at > ? LIMIT 1",
        )
        .bind(&a.sku)
        .bind(a.ends_at)
        .bind(a.starts_at)
        .fetch_optional(&mut *tx)
        .await?;
        if let Some((other,)) = overlapping {
            return Err(CreateError::Overlap {
                sku: a.sku.clone(),
                other,
            });
        }
        let inserted = sqlx::query(
            "INSERT INTO activities \
             (id, sku, stock, available, per_user_limit, stock_shards, starts_at, ends_at, \
              payment_timeout_secs) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(&a.id)
        .bind(&a.sku)
        .bind(a.stock)
        .bind(a.stock)
        .bind(a.per_user_limit)
        .bind(a.stock_shards)
        .bind(a.starts_at)
        .bind(a.ends_at)
        .bind(a.payment_timeout_secs)
        .execute(&mut *tx)
        .await;
        match inserted {
            Ok(_) => {}
            Err(sqlx::Error::Database(e)) if e.is_unique_violation() => {
                return Err(CreateError::DuplicateId(a.id.clone()))
            }
            Err(e) => return Err(e.into()),
        }
        let activity = fetch(&mut *tx, &a.id)
            .await?
            .ok_or(sqlx::Error::RowNotFound)?;
        tx.commit().await?;
        Ok(activity)
    }

    pub async fn get(&self, id: &str) -> Result<Option<Activity>, sqlx::Error> {
        fetch(&self.pool, id).await
    }

    /// Activities the cache keeps: every one that has not ended, and those that
    /// ended in the last `ended_within` (so `GET /flash/{sku}` can say "ended").
    pub async fn list_recent(&self, since: DateTime<Utc>) -> Result<Vec<Activity>, sqlx::Error> {
        sqlx::query_as(&format!(
            "SELECT {COLUMNS} FROM activities WHERE ends_at >= ? ORDER BY starts_at"
        ))
        .bind(since)
        .fetch_all(&self.pool)
        .await
    }

    /// The operator's switch; it also clears an automatic pause.
    pub async fn set_paused(&self, id: &str, paused: bool) -> Result<bool, sqlx::Error> {
        let done =
            sqlx::query("UPDATE activities SET paused = ?, auto_paused = FALSE WHERE id = ?")
                .bind(paused)
                .bind(id)
                .execute(&self.pool)
                .await?;
        // rows_affected is 0 when the value did not change too, so look it up.
        if done.rows_affected() > 0 {
            return Ok(true);
        }
        Ok(self.get(id).await?.is_some())
    }

    /// Pauses an activity whose Redis state was lost, unless an operator paused it.
    pub async fn auto_pause(&self, id: &str) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(
            "UPDATE activities SET paused = TRUE, auto_paused = TRUE WHERE id = ? AND paused = FALSE",
        )
        .bind(id)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Undoes an automatic pause (an operator's pause stays).
    pub async fn auto_resume(&self, id: &str) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(
            "UPDATE activities SET paused = FALSE, auto_paused = FALSE WHERE id = ? AND auto_paused = TRUE",
        )
        .bind(id)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    /// What a (re)build of the activity's Redis state needs, read in one
    /// transaction under the activity's row lock (so no order is written half-way
    /// through), which also counts the build (`redis_epoch`) and marks every failed
    /// or cancelled order's units as back: `available` holds them already.
    /// `None` if there is no such activity.
    pub async fn build_snapshot(&self, id: &str) -> Result<Option<Build>, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        let row: Option<(i32, bool, bool, u32)> = sqlx::query_as(
            "SELECT available, paused, auto_paused, redis_epoch FROM activities WHERE id = ? FOR UPDATE",
        )
        .bind(id)
        .fetch_optional(&mut *tx)
        .await?;
        let Some((available, paused, auto_paused, epoch)) = row else {
            return Ok(None);
        };
        sqlx::query("UPDATE activities SET redis_epoch = redis_epoch + 1 WHERE id = ?")
            .bind(id)
            .execute(&mut *tx)
            .await?;
        // A lapsed order keeps the purchase right spent; a failed one does not.
        let buyers: Vec<(String, String)> = sqlx::query_as(
            "SELECT user_id, reservation_id FROM orders WHERE activity_id = ? AND status <> 'failed'",
        )
        .bind(id)
        .fetch_all(&mut *tx)
        .await?;
        let returned: Vec<(String,)> = sqlx::query_as(
            "SELECT reservation_id FROM orders WHERE activity_id = ? AND status IN ('failed', 'cancelled')",
        )
        .bind(id)
        .fetch_all(&mut *tx)
        .await?;
        sqlx::query(
            "UPDATE orders SET units_returned = TRUE WHERE activity_id = ? \
             AND units_returned = FALSE AND status IN ('failed', 'cancelled')",
        )
        .bind(id)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(Some(Build {
            available: i64::from(available),
            // An automatic pause is undone by the rebuild itself.
            paused: paused && !auto_paused,
            epoch: epoch + 1,
            buyers,
            returned: returned.into_iter().map(|(r,)| r).collect(),
        }))
    }

    /// Order counts by status.
    pub async fn order_counts(&self, id: &str) -> Result<Vec<(String, i64)>, sqlx::Error> {
        sqlx::query_as(
            "SELECT CAST(status AS CHAR), COUNT(*) FROM orders WHERE activity_id = ? GROUP BY status",
        )
        .bind(id)
        .fetch_all(&self.pool)
        .await
    }
}

async fn fetch<'e, E>(executor: E, id: &str) -> Result<Option<Activity>, sqlx::Error>
where
    E: sqlx::Executor<'e, Database = sqlx::MySql>,
{
    sqlx::query_as(&format!("SELECT {COLUMNS} FROM activities WHERE id = ?"))
        .bind(id)
        .fetch_optional(executor)
        .await
}
