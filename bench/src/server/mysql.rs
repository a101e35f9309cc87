//! Strategy a, the seed's "before": MySQL alone.
//!
//! Per request, one transaction: does the user have an order? → take a unit with
//! `UPDATE … SET num = num - 1 WHERE sku = ? AND num > 0` → insert the order →
//! commit. Every buyer of the SKU queues on that one row's lock, from the `UPDATE`
//! to the commit (which waits for the redo log to reach the disk), and holds a pool
//! connection all that time.
//!
//! There is deliberately no `UNIQUE (sku, user_id)`: the "before" had none, which is
//! how one user came to buy several units. The check is a plain (snapshot) read, so
//! two clicks of one user can both find no order, then queue on the row lock one
//! after the other and both insert one.

use flashsale::error::AppError;
use sqlx::MySqlPool;

use super::sale::Decided;

pub async fn create_tables(pool: &MySqlPool) -> anyhow::Result<()> {
    use anyhow::Context;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS bench_stock (
             sku VARCHAR(128) NOT NULL,
             num INT NOT NULL,
             PRIMARY KEY (sku)
         ) ENGINE = InnoDB",
    )
    .execute(pool)
    .await
    .context("failed to create bench_stock")?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS bench_orders (
             id             BIGINT UNSIGNED NOT NULL AUTO_INCREMENT,
             reservation_id VARCHAR(64)  NOT NULL,
             sku            VARCHAR(128) NOT NULL,
             user_id        VARCHAR(64)  NOT NULL,
             created_at     DATETIME(3)  NOT NULL DEFAULT CURRENT_TIMESTAMP(3),
             PRIMARY KEY (id),
             KEY idx_bench_orders_user (sku, user_id)
         ) ENGINE = InnoDB",
    )
    .execute(pool)
    .await
    .context("failed to create bench_orders")?;
    Ok(())
}

pub async fn open_sale(pool: &MySqlPool, sku: &str, stock: i64) -> Result<(), AppError> {
    let mut tx = pool.begin().await?;
    sqlx::query(
        "INSERT INTO bench_stock (sku, num) VALUES (?, ?) ON DUPLICATE KEY UPDATE num = VALUES(num)",
    )
    .bind(sku)
    .bind(stock)
    .execute(&mut *tx)
    .await?;
    sqlx::query("DELETE FROM bench_orders WHERE sku = ?")
        .bind(sku)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(())
}

pub async fn reserve(
    pool: &MySqlPool,
    sku: &str,
    user: &str,
    reservation_id: &str,
) -> Result<Decided, AppError> {
    // Dropping a transaction without commit rolls it back when its connection goes
    // back to the pool, so the early returns below leave nothing behind; the explicit
    // rollbacks only release the row lock one round trip sooner.
    let mut tx = pool.begin().await?;
    let existing: Option<String> = sqlx::query_scalar(
        "SELECT reservation_id FROM bench_orders WHERE sku = ? AND user_id = ? LIMIT 1",
    )
    .bind(sku)
    .bind(user)
    .fetch_optional(&mut *tx)
    .await?;
    if let Some(id) = existing {
        tx.rollback().await?;
        return Ok(Decided::AlreadyReserved(id));
    }
    let taken = sqlx::query("UPDATE bench_stock SET num = num - 1 WHERE sku = ? AND num > 0")
        .bind(sku)
        .execute(&mut *tx)
        .await?
        .rows_affected();
    if taken == 0 {
        tx.rollback().await?;
        return Ok(Decided::SoldOut);
    }
    sqlx::query("INSERT INTO bench_orders (reservation_id, sku, user_id) VALUES (?, ?, ?)")
        .bind(reservation_id)
        .bind(sku)
        .bind(user)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(Decided::Reserved)
}

/// (units left, orders, distinct buyers) of a sale.
pub async fn state(pool: &MySqlPool, sku: &str) -> Result<(i64, i64, i64), AppError> {
    let left: i64 = sqlx::query_scalar("SELECT CAST(num AS SIGNED) FROM bench_stock WHERE sku = ?")
        .bind(sku)
        .fetch_optional(pool)
        .await?
        .unwrap_or(0);
    let (orders, distinct): (i64, i64) =
        sqlx::query_as("SELECT COUNT(*), COUNT(DISTINCT user_id) FROM bench_orders WHERE sku = ?")
            .bind(sku)
            .fetch_one(pool)
            .await?;
    Ok((left, orders, distinct))
}
