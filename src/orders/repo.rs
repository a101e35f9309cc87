//! MySQL access for orders.

use chrono::{DateTime, Utc};
use sqlx::MySqlPool;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OrderStatus {
    PendingPayment,
    Paid,
    Cancelled,
    Failed,
}

impl OrderStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            OrderStatus::PendingPayment => "pending_payment",
            OrderStatus::Paid => "paid",
            OrderStatus::Cancelled => "cancelled",
            OrderStatus::Failed => "failed",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "pending_payment" => OrderStatus::PendingPayment,
            "paid" => OrderStatus::Paid,
            "cancelled" => OrderStatus::Cancelled,
            "failed" => OrderStatus::Failed,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone)]
pub struct Order {
    pub id: u64,
    pub reservation_id: String,
    pub activity_id: String,
    pub user_id: String,
    pub quantity: u32,
    pub status: OrderStatus,
    pub created_at: DateTime<Utc>,
    pub expires_at: Option<DateTime<Utc>>,
    pub paid_at: Option<DateTime<Utc>>,
    pub cancelled_at: Option<DateTime<Utc>>,
}

type OrderRow = (
    u64,
    String,
    String,
    String,
    u32,
    String,
    DateTime<Utc>,
    Option<DateTime<Utc>>,
    Option<DateTime<Utc>>,
    Option<DateTime<Utc>>,
);

const COLUMNS: &str = "id, reservation_id, activity_id, user_id, quantity, CAST(status AS CHAR), \
                       created_at, expires_at, paid_at, cancelled_at";

fn from_row(r: OrderRow) -> Result<Order, sqlx::Error> {
    let status = OrderStatus::parse(&r.5)
        .ok_or_else(|| sqlx::Error::Decode(format!("unknown order status {:?}", r.5).into()))?;
    Ok(Order {
        id: r.0,
        reservation_id: r.1,
        activity_id: r.2,
        user_id: r.3,
        quantity: r.4,
        status,
        created_at: r.6,
        expires_at: r.7,
        paid_at: r.8,
        cancelled_at: r.9,
    })
}

#[derive(Clone)]
pub struct OrderRepo {
    pool: MySqlPool,
}

impl OrderRepo {
    pub fn new(pool: MySqlPool) -> Self {
        OrderRepo { pool }
    }

    /// The order of this user in this activity, if one reached MySQL.
    pub async fn by_user(
        &self,
        activity_id: &str,
        user_id: &str,
    ) -> Result<Option<Order>, sqlx::Error> {
        let row: Option<OrderRow> = sqlx::query_as(&format!(
            "SELECT {COLUMNS} FROM orders WHERE activity_id = ? AND user_id = ?"
        ))
        .bind(activity_id)
        .bind(user_id)
        .fetch_optional(&self.pool)
        .await?;
        row.map(from_row).transpose()
    }
}

/// One reservation as the consumer hands it to MySQL.
#[derive(Debug, Clone)]
pub struct Incoming {
    pub reservation_id: String,
    pub activity_id: String,
    pub user_id: String,
    pub quantity: u32,
}

/// What MySQL decided for one reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// A new order awaits payment; the units were taken from the DB count.
    Ordered,
    /// The reservation already had its row (a redelivery): nothing changed.
    Duplicate,
    /// Recorded as failed (no DB units left, unknown activity); its units must go
    /// back to Redis.
    Failed { reason: &'static str },
    /// The user already holds an order from another reservation: this one loses
    /// and its units must go back to Redis (no row is written for it).
    Superseded,
}

/// MySQL error codes worth retrying: deadlock, lock wait timeout, and the
/// connection-level failures sqlx reports as I/O or pool errors.
pub fn is_transient(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Protocol(_)
        | sqlx::Error::Tls(_) => true,
        // ER_LOCK_WAIT_TIMEOUT, ER_LOCK_DEADLOCK, ER_QUERY_INTERRUPTED,
        // ER_SERVER_SHUTDOWN, ER_CON_COUNT_ERROR, ER_CONNECTION_KILLED
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .is_some_and(|e| matches!(e.number(), 1205 | 1213 | 1317 | 1053 | 1040 | 1927)),
        _ => false,
    }
}

impl OrderRepo {
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    /// Applies a batch in one transaction. The activities involved are locked
    /// first, in id order, so concurrent consumers queue on them instead of
    /// deadlocking; each unit taken is guarded by `available >= q`, so MySQL never
    /// oversells whatever Redis said.
    ///
    /// Orders are inserted with `ON DUPLICATE KEY UPDATE`: on a duplicate key InnoDB
    /// then takes an exclusive lock at once, where a plain or `IGNORE` insert would
    /// take a shared lock first and two concurrent duplicates could deadlock on the
    /// upgrade. The update bumps `redeliveries`, so "affected rows" tells a new row
    /// (1) from a duplicate (2).
    pub async fn apply_batch(&self, batch: &[Incoming]) -> Result<Vec<Decision>, sqlx::Error> {
        let mut order: Vec<usize> = (0..batch.len()).collect();
        order.sort_by(|&a, &b| {
            (&batch[a].activity_id, &batch[a].user_id)
                .cmp(&(&batch[b].activity_id, &batch[b].user_id))
        });
        let mut ids: Vec<&str> = batch.iter().map(|m| m.activity_id.as_str()).collect();
        ids.sort_unstable();
        ids.dedup();

        let mut tx = self.pool.begin().await?;
        let placeholders = vec!["?"; ids.len()].join(",");
        let sql = format!(
            "SELECT id, payment_timeout_secs FROM activities WHERE id IN ({placeholders}) ORDER BY id FOR UPDATE"
        );
        let mut q = sqlx::query_as::<_, (String, u32)>(&sql);
        for id in &ids {
            q = q.bind(*id);
        }
        let timeouts: std::collections::HashMap<String, u32> =
            q.fetch_all(&mut *tx).await?.into_iter().collect();

        let mut decisions = vec![Decision::Duplicate; batch.len()];
        for i in order {
            let m = &batch[i];
            let decision = match timeouts.get(&m.activity_id) {
                None => insert_failed(&mut tx, m, "unknown activity").await?,
                Some(&timeout) => {
                    let inserted = sqlx::query(
                        "INSERT INTO orders \
                         (reservation_id, activity_id, user_id, quantity, status, created_at, expires_at) \
                         VALUES (?, ?, ?, ?, 'pending_payment', NOW(3), NOW(3) + INTERVAL ? SECOND) \
                         ON DUPLICATE KEY UPDATE redeliveries = redeliveries + 1",
                    )
                    .bind(&m.reservation_id)
                    .bind(&m.activity_id)
                    .bind(&m.user_id)
                    .bind(m.quantity)
                    .bind(timeout)
                    .execute(&mut *tx)
                    .await?
                    .rows_affected();
                    if inserted == 1 {
                        let taken = sqlx::query(
                            "UPDATE activities SET available = available - ? \
                             WHERE id = ? AND available >= ?",
                        )
                        .bind(m.quantity)
                        .bind(&m.activity_id)
                        .bind(m.quantity)
                        .execute(&mut *tx)
                        .await?
                        .rows_affected();
                        if taken == 1 {
                            Decision::Ordered
                        } else {
                            let reason = "no units left in the database";
                            sqlx::query(
                                "UPDATE orders SET status = 'failed', failure_reason = ?, expires_at = NULL \
                                 WHERE reservation_id = ?",
                            )
                            .bind(reason)
                            .bind(&m.reservation_id)
                            .execute(&mut *tx)
                            .await?;
                            Decision::Failed { reason }
                        }
                    } else {
                        duplicate_of(&mut tx, m).await?
                    }
                }
            };
            decisions[i] = decision;
        }
        tx.commit().await?;
        Ok(decisions)
    }

    /// Marks that a failed or cancelled order's units are back in Redis.
    pub async fn mark_units_returned(&self, reservation_ids: &[String]) -> Result<(), sqlx::Error> {
        if reservation_ids.is_empty() {
            return Ok(());
        }
        let placeholders = vec!["?"; reservation_ids.len()].join(",");
        let sql = format!(
            "UPDATE orders SET units_returned = TRUE WHERE reservation_id IN ({placeholders}) \
             AND status IN ('failed', 'cancelled')"
        );
        let mut q = sqlx::query(&sql);
        for id in reservation_ids {
            q = q.bind(id);
        }
        q.execute(&self.pool).await?;
        Ok(())
    }

    pub async fn by_id(&self, id: u64) -> Result<Option<Order>, sqlx::Error> {
        let row: Option<OrderRow> =
            sqlx::query_as(&format!("SELECT {COLUMNS} FROM orders WHERE id = ?"))
                .bind(id)
                .fetch_optional(&self.pool)
                .await?;
        row.map(from_row).transpose()
    }

    /// Pays an order: a compare-and-set from `pending_payment` before its deadline,
    /// so a payment and the sweeper's cancellation never both win.
    pub async fn pay(&self, id: u64, user_id: &str) -> Result<PayOutcome, sqlx::Error> {
        let done = sqlx::query(
            "UPDATE orders SET status = 'paid', paid_at = NOW(3) \
             WHERE id = ? AND user_id = ? AND status = 'pending_payment' AND expires_at > NOW(3)",
        )
        .bind(id)
        .bind(user_id)
        .execute(&self.pool)
        .await?
        .rows_affected();
        let order = match self.by_id(id).await? {
            Some(o) if o.user_id == user_id => o,
            _ => return Ok(PayOutcome::NotFound),
        };
        Ok(match order.status {
            OrderStatus::Paid if done == 1 => PayOutcome::Paid(order),
            OrderStatus::Paid => PayOutcome::AlreadyPaid(order),
            OrderStatus::Cancelled | OrderStatus::PendingPayment => PayOutcome::Expired,
            OrderStatus::Failed => PayOutcome::NotFound,
        })
    }

    /// Cancels up to `limit` unpaid orders past their deadline. Each is its own
    /// compare-and-set from `pending_payment`, and the units go back to the DB count
    /// in the same transaction, so two sweepers (or a sweeper and a payment) never
    /// both win and the units come back once. Returns the cancelled orders.
    pub async fn cancel_expired(&self, limit: u32) -> Result<Vec<Order>, sqlx::Error> {
        let candidates: Vec<(u64,)> = sqlx::query_as(
            "SELECT id FROM orders WHERE status = 'pending_payment' AND expires_at <= NOW(3) \
             ORDER BY expires_at LIMIT ?",
        )
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        let mut cancelled = Vec::new();
        for (id,) in candidates {
            let mut tx = self.pool.begin().await?;
            let won = sqlx::query(
                "UPDATE orders SET status = 'cancelled', cancelled_at = NOW(3) \
                 WHERE id = ? AND status = 'pending_payment' AND expires_at <= NOW(3)",
            )
            .bind(id)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if won == 1 {
                let row: OrderRow =
                    sqlx::query_as(&format!("SELECT {COLUMNS} FROM orders WHERE id = ?"))
                        .bind(id)
                        .fetch_one(&mut *tx)
                        .await?;
                let order = from_row(row)?;
                sqlx::query("UPDATE activities SET available = available + ? WHERE id = ?")
                    .bind(order.quantity)
                    .bind(&order.activity_id)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                cancelled.push(order);
            } else {
                tx.rollback().await?;
            }
        }
        Ok(cancelled)
    }

    /// Failed and cancelled orders whose units are not yet back in Redis.
    pub async fn unreturned(&self, limit: u32) -> Result<Vec<Order>, sqlx::Error> {
        let rows: Vec<OrderRow> = sqlx::query_as(&format!(
            "SELECT {COLUMNS} FROM orders WHERE units_returned = FALSE \
             AND status IN ('failed', 'cancelled') LIMIT ?"
        ))
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter().map(from_row).collect()
    }
}

#[derive(Debug)]
pub enum PayOutcome {
    Paid(Order),
    AlreadyPaid(Order),
    Expired,
    NotFound,
}

async fn insert_failed(
    tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    m: &Incoming,
    reason: &'static str,
) -> Result<Decision, sqlx::Error> {
    let inserted = sqlx::query(
        "INSERT INTO orders (reservation_id, activity_id, user_id, quantity, status, failure_reason, created_at) \
         VALUES (?, ?, ?, ?, 'failed', ?, NOW(3)) \
         ON DUPLICATE KEY UPDATE redeliveries = redeliveries + 1",
    )
    .bind(&m.reservation_id)
    .bind(&m.activity_id)
    .bind(&m.user_id)
    .bind(m.quantity)
    .bind(reason)
    .execute(&mut **tx)
    .await?
    .rows_affected();
    if inserted == 1 {
        Ok(Decision::Failed { reason })
    } else {
        duplicate_of(tx, m).await
    }
}

/// The row that made the insert a duplicate: this very reservation (a redelivery),
/// or another reservation of the same user (this one loses).
async fn duplicate_of(
    tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    m: &Incoming,
) -> Result<Decision, sqlx::Error> {
    let same: Option<(u64,)> = sqlx::query_as("SELECT id FROM orders WHERE reservation_id = ?")
        .bind(&m.reservation_id)
        .fetch_optional(&mut **tx)
        .await?;
    Ok(if same.is_some() {
        Decision::Duplicate
    } else {
        Decision::Superseded
    })
}
