//! MySQL access for activities.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use chrono::{DateTime, Utc};
use sqlx::MySqlPool;

use super::definition::{Activity, Build, ValidActivity};

// Times are bound as DATETIME (`naive_utc`), the columns' type: bound as a
// TIMESTAMP, MariaDB turns anything past 2038-01-19 into NULL.

// `admission` is an ENUM column, read as text. `$price` reads the price and
// its currency: the columns, or NULLs while MySQL lacks them.
macro_rules! columns {
    ($price:literal) => {
        concat!(
            "id, sku, stock, available, per_user_limit, stock_shards, \
             CAST(admission AS CHAR) AS admission, \
             waiting_room_secs, starts_at, ends_at, payment_timeout_secs, ",
            $price,
            ", paused, auto_paused, redis_epoch, redis_built_epoch, redis_removing, \
             redis_removed_at, created_at"
        )
    };
}
const COLUMNS: &str = columns!("price, CAST(currency AS CHAR) AS currency");
/// Before the migration `20261212000001_activity_price`: no sale has a price.
const COLUMNS_UNPRICED: &str =
    columns!("CAST(NULL AS SIGNED) AS price, CAST(NULL AS CHAR) AS currency");

/// The columns an activity is read with, as MySQL has the price columns or not.
fn columns_for(priced: bool) -> &'static str {
    if priced {
        COLUMNS
    } else {
        COLUMNS_UNPRICED
    }
}

/// How often a repository that found no price columns looks again.
const PRICE_COLUMNS_EVERY: std::time::Duration = std::time::Duration::from_secs(30);

/// Whether MySQL has the activities' `price` and `currency` columns. A
/// release is rolled out before `flashsale migrate` runs (docs/operations.md,
/// "Upgrading"): until the columns exist, activities are read without a price
/// and a sale with one cannot be created yet.
#[derive(Clone, Default)]
struct PriceColumns {
    present: Arc<AtomicBool>,
    /// When they were last looked for and not found.
    missed_at: Arc<Mutex<Option<std::time::Instant>>>,
}

/// Why a top-up was refused.
#[derive(Debug, thiserror::Error)]
pub enum TopUpError {
    #[error("no activity {0}")]
    NotFound(String),
    #[error("stock would exceed {max}")]
    TooMuch { max: i64 },
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// A top-up's id, as Redis records it among the activity's returned units.
pub fn topup_key(id: &str) -> String {
    format!("topup-{id}")
}

#[derive(Debug, thiserror::Error)]
pub enum CreateError {
    #[error("an activity with id {0} already exists")]
    DuplicateId(String),
    #[error("sku {sku} already has activity {other} whose window overlaps")]
    Overlap { sku: String, other: String },
    #[error("MySQL has no price columns yet: run `flashsale migrate`")]
    NoPriceColumns,
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// A sale's build lock, MySQL's `GET_LOCK`: its name is server-wide, so the
/// database's name goes into it, hashed (a name holds at most 64 characters).
const BUILD_LOCK_NAME: &str = "SHA1(CONCAT(DATABASE(), '/build/', ?))";

/// One sale's build lock ([`ActivityRepo::build_lock`]), held on a connection
/// of its own: released by [`BuildLock::release`], or by closing that
/// connection (when this is dropped, or the instance dies), never returned to
/// the pool while held.
pub struct BuildLock {
    conn: Option<sqlx::pool::PoolConnection<sqlx::MySql>>,
    id: String,
}

impl BuildLock {
    pub async fn release(mut self) {
        if let Some(mut conn) = self.conn.take() {
            // Whatever this answers, the connection is closed when dropped.
            if let Err(err) = sqlx::query(&format!("SELECT RELEASE_LOCK({BUILD_LOCK_NAME})"))
                .bind(&self.id)
                .execute(&mut *conn)
                .await
            {
                tracing::debug!(error = %err, activity_id = %self.id, "releasing the build lock failed; closing its connection frees it");
            }
        }
    }
}

#[derive(Clone)]
pub struct ActivityRepo {
    pool: MySqlPool,
    prices: PriceColumns,
}

impl ActivityRepo {
    /// Takes the sale's build lock: one build of its Redis state at a time over
    /// every instance, and no resume in the middle of one. Waits up to `wait`
    /// (whole seconds; zero: not at all); `None` if another holds it still.
    pub async fn build_lock(
        &self,
        id: &str,
        wait: std::time::Duration,
    ) -> Result<Option<BuildLock>, sqlx::Error> {
        let mut conn = self.pool.acquire().await?;
        // Before the lock is asked for: a call cancelled half-way closes the
        // connection, which frees the lock, rather than pool a connection
        // holding it.
        conn.close_on_drop();
        let got: Option<i64> = sqlx::query_scalar(&format!(
            "SELECT CAST(GET_LOCK({BUILD_LOCK_NAME}, ?) AS SIGNED)"
        ))
        .bind(id)
        .bind(wait.as_secs())
        .fetch_one(&mut *conn)
        .await?;
        Ok((got == Some(1)).then(|| BuildLock {
            conn: Some(conn),
            id: id.to_owned(),
        }))
    }

    pub fn new(pool: MySqlPool) -> Self {
        ActivityRepo {
            pool,
            prices: PriceColumns::default(),
        }
    }

    /// Whether MySQL has the price columns: once found, for good; while not,
    /// looked for again at most every [`PRICE_COLUMNS_EVERY`]. A lookup that
    /// fails is an error, never "no columns": a sale is never read without the
    /// price MySQL holds for it.
    pub async fn priced(&self) -> Result<bool, sqlx::Error> {
        if self.prices.present.load(Ordering::Relaxed) {
            return Ok(true);
        }
        {
            let missed = self
                .prices
                .missed_at
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            if missed.is_some_and(|at| at.elapsed() < PRICE_COLUMNS_EVERY) {
                return Ok(false);
            }
        }
        let found: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.COLUMNS \
             WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'activities' \
             AND COLUMN_NAME IN ('price', 'currency')",
        )
        .fetch_one(&self.pool)
        .await?;
        if found == 2 {
            self.prices.present.store(true, Ordering::Relaxed);
            return Ok(true);
        }
        tracing::warn!("MySQL has no price columns yet (run `flashsale migrate` once every instance runs this release): sales are read without a price, and one with a price cannot be created until then");
        *self
            .prices
            .missed_at
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(std::time::Instant::now());
        Ok(false)
    }

    /// The columns an activity is read with.
    async fn columns(&self) -> Result<&'static str, sqlx::Error> {
        Ok(columns_for(self.priced().await?))
    }

    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    /// Inserts an activity unless its SKU has another whose window overlaps.
    /// The SKU's row in `sku_locks` is locked for the transaction, so two concurrent
    /// creations for one SKU are checked one after the other.
    pub async fn create(&self, a: &ValidActivity) -> Result<Activity, CreateError> {
        // Looked up before any lock is held: the lookup takes a connection of
        // its own.
        let priced = self.priced().await?;
        let columns = columns_for(priced);
        if !priced && a.price.is_some() {
            return Err(CreateError::NoPriceColumns);
        }
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
        .bind(a.ends_at.naive_utc())
        .bind(a.starts_at.naive_utc())
        .fetch_optional(&mut *tx)
        .await?;
        if let Some((other,)) = overlapping {
            return Err(CreateError::Overlap {
                sku: a.sku.clone(),
                other,
            });
        }
        let insert = if priced {
            "INSERT INTO activities \
             (id, sku, stock, available, per_user_limit, stock_shards, admission, \
              waiting_room_secs, starts_at, ends_at, payment_timeout_secs, price, currency) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
        } else {
            "INSERT INTO activities \
             (id, sku, stock, available, per_user_limit, stock_shards, admission, \
              waiting_room_secs, starts_at, ends_at, payment_timeout_secs) \
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
        };
        let mut query = sqlx::query(insert)
            .bind(&a.id)
            .bind(&a.sku)
            .bind(a.stock)
            .bind(a.stock)
            .bind(a.per_user_limit)
            .bind(a.stock_shards)
            .bind(a.admission.as_str())
            .bind(a.waiting_room_secs)
            .bind(a.starts_at.naive_utc())
            .bind(a.ends_at.naive_utc())
            .bind(a.payment_timeout_secs);
        if priced {
            query = query.bind(a.price).bind(&a.currency);
        }
        let inserted = query.execute(&mut *tx).await;
        match inserted {
            Ok(_) => {}
            Err(sqlx::Error::Database(e)) if e.is_unique_violation() => {
                return Err(CreateError::DuplicateId(a.id.clone()))
            }
            Err(e) => return Err(e.into()),
        }
        let activity = fetch(&mut *tx, columns, &a.id)
            .await?
            .ok_or(sqlx::Error::RowNotFound)?;
        tx.commit().await?;
        Ok(activity)
    }

    pub async fn get(&self, id: &str) -> Result<Option<Activity>, sqlx::Error> {
        fetch(&self.pool, self.columns().await?, id).await
    }

    /// Activities the cache keeps: every one that has not ended, and those that
    /// ended in the last `ended_within` (so `GET /flash/{sku}` can say "ended").
    pub async fn list_recent(&self, since: DateTime<Utc>) -> Result<Vec<Activity>, sqlx::Error> {
        let columns = self.columns().await?;
        sqlx::query_as(&format!(
            "SELECT {columns} FROM activities WHERE ends_at >= ? ORDER BY starts_at"
        ))
        .bind(since.naive_utc())
        .fetch_all(&self.pool)
        .await
    }

    /// Removals begun and not done (first), then activities that ended before
    /// `ended_before` and whose removal has not begun, the longest ended first;
    /// at most `limit` of each. Reads only those rows
    /// (`idx_activities_retention`), however many sales were ever held.
    pub async fn due_for_removal(
        &self,
        ended_before: DateTime<Utc>,
        limit: u32,
    ) -> Result<Vec<Activity>, sqlx::Error> {
        let columns = self.columns().await?;
        sqlx::query_as(&format!(
            "(SELECT {columns} FROM activities \
              WHERE redis_removing = TRUE AND redis_removed_at IS NULL LIMIT ?) \
             UNION ALL \
             (SELECT {columns} FROM activities \
              WHERE redis_removing = FALSE AND redis_removed_at IS NULL AND ends_at < ? \
              ORDER BY ends_at LIMIT ?)"
        ))
        .bind(limit)
        .bind(ended_before.naive_utc())
        .bind(limit)
        .fetch_all(&self.pool)
        .await
    }

    /// The first step of a removal: from now on no build writes the activity's
    /// Redis state again (`Reconciler::past_retention`).
    pub async fn mark_removing(&self, id: &str) -> Result<(), sqlx::Error> {
        sqlx::query("UPDATE activities SET redis_removing = TRUE WHERE id = ?")
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// The last step: the keys are gone and their marker is in place.
    pub async fn mark_removed(&self, id: &str) -> Result<(), sqlx::Error> {
        sqlx::query(
            "UPDATE activities SET redis_removed_at = NOW(3) WHERE id = ? AND redis_removed_at IS NULL",
        )
        .bind(id)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// The newest activities first, at most `limit`.
    pub async fn list(&self, limit: u32) -> Result<Vec<Activity>, sqlx::Error> {
        let columns = self.columns().await?;
        sqlx::query_as(&format!(
            "SELECT {columns} FROM activities ORDER BY created_at DESC, id LIMIT ?"
        ))
        .bind(limit)
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
    ///
    /// Only while the last build written is still `built_epoch`, the one the
    /// caller saw before it found Redis lost: an instance that found the loss
    /// late does not pause a sale another instance has already rebuilt.
    pub async fn auto_pause(&self, id: &str, built_epoch: u32) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(
            "UPDATE activities SET paused = TRUE, auto_paused = TRUE \
             WHERE id = ? AND paused = FALSE AND redis_built_epoch = ?",
        )
        .bind(id)
        .bind(built_epoch)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    /// Records that build `epoch` was written whole into Redis.
    pub async fn record_build(&self, id: &str, epoch: u32) -> Result<(), sqlx::Error> {
        sqlx::query(
            "UPDATE activities SET redis_built_epoch = GREATEST(redis_built_epoch, ?) WHERE id = ?",
        )
        .bind(epoch)
        .bind(id)
        .execute(&self.pool)
        .await?;
        Ok(())
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

    /// Adds `units` to the activity's stock and available count, and records the
    /// top-up, in one transaction under the activity's row lock (every order write
    /// takes it too). Returns the activity and the top-up's Redis key; Redis gets
    /// the units from the caller (`StockStore::top_up`), or from the reconciler.
    pub async fn top_up(&self, id: &str, units: u32) -> Result<(Activity, String), TopUpError> {
        // Before the row lock: the lookup takes a connection of its own.
        let columns = self.columns().await?;
        let mut tx = self.pool.begin().await?;
        let row: Option<(i64,)> =
            sqlx::query_as("SELECT CAST(stock AS SIGNED) FROM activities WHERE id = ? FOR UPDATE")
                .bind(id)
                .fetch_optional(&mut *tx)
                .await?;
        let Some((stock,)) = row else {
            return Err(TopUpError::NotFound(id.to_owned()));
        };
        if stock + i64::from(units) > super::definition::MAX_STOCK {
            return Err(TopUpError::TooMuch {
                max: super::definition::MAX_STOCK,
            });
        }
        sqlx::query(
            "UPDATE activities SET stock = stock + ?, available = available + ? WHERE id = ?",
        )
        .bind(units)
        .bind(units)
        .bind(id)
        .execute(&mut *tx)
        .await?;
        let topup = uuid::Uuid::now_v7().simple().to_string();
        sqlx::query("INSERT INTO stock_topups (id, activity_id, units) VALUES (?, ?, ?)")
            .bind(&topup)
            .bind(id)
            .bind(units)
            .execute(&mut *tx)
            .await?;
        let activity = fetch(&mut *tx, columns, id)
            .await?
            .ok_or(sqlx::Error::RowNotFound)?;
        tx.commit().await?;
        Ok((activity, topup_key(&topup)))
    }

    /// Top-ups Redis may not hold yet: (Redis key, units).
    pub async fn unapplied_topups(&self, id: &str) -> Result<Vec<(String, u32)>, sqlx::Error> {
        let rows: Vec<(String, u32)> = sqlx::query_as(
            "SELECT id, units FROM stock_topups WHERE activity_id = ? AND applied = FALSE",
        )
        .bind(id)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.into_iter().map(|(t, u)| (topup_key(&t), u)).collect())
    }

    /// Redis holds this top-up (given by its Redis key).
    pub async fn topup_applied(&self, key: &str) -> Result<(), sqlx::Error> {
        let id = key.strip_prefix("topup-").unwrap_or(key);
        sqlx::query("UPDATE stock_topups SET applied = TRUE WHERE id = ?")
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
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
            "SELECT CAST(user_id AS CHAR), reservation_id FROM orders WHERE activity_id = ? AND status <> 'failed'",
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
        // Top-ups are in `available` too: recorded as held, so a late one is a no-op.
        let topups: Vec<(String,)> =
            sqlx::query_as("SELECT id FROM stock_topups WHERE activity_id = ?")
                .bind(id)
                .fetch_all(&mut *tx)
                .await?;
        sqlx::query("UPDATE stock_topups SET applied = TRUE WHERE activity_id = ?")
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
            returned: returned
                .into_iter()
                .map(|(r,)| r)
                .chain(topups.into_iter().map(|(t,)| topup_key(&t)))
                .collect(),
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

async fn fetch<'e, E>(executor: E, columns: &str, id: &str) -> Result<Option<Activity>, sqlx::Error>
where
    E: sqlx::Executor<'e, Database = sqlx::MySql>,
{
    sqlx::query_as(&format!("SELECT {columns} FROM activities WHERE id = ?"))
        .bind(id)
        .fetch_optional(executor)
        .await
}
