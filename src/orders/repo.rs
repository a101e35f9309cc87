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

/// What a reservation MySQL does not hold yet becomes.
#[derive(Debug, Clone, Copy)]
enum NewRows {
    /// An order awaiting payment, taking its units (the consumer).
    Order,
    /// A failed reservation with this reason (the reconciler).
    Fail(&'static str),
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

    /// Applies a batch in one transaction, in a handful of statements whatever its
    /// size:
    ///
    /// 1. the batch's activities are locked (`FOR UPDATE`, in id order). Every path
    ///    that creates orders takes this lock first, so while it is held nobody else
    ///    inserts orders for these activities, and concurrent consumers queue here
    ///    instead of deadlocking on the orders' unique indexes (an insert that hits
    ///    a duplicate key takes a shared lock, and two such inserts can deadlock on
    ///    the upgrade; here no insert is ever a duplicate);
    /// 2. the orders that already exist for the batch's reservations and users are
    ///    read, and each message is decided in memory, in arrival order: a known
    ///    reservation is a redelivery, a user with another order is superseded, and
    ///    a new one takes units only while the locked `available` covers them;
    /// 3. one multi-row insert writes the new orders (and the failed ones), one
    ///    guarded update per activity takes the units (`available >= taken`, which
    ///    holds under the lock; MySQL's check constraint backs it), and one update
    ///    counts the redeliveries.
    pub async fn apply_batch(&self, batch: &[Incoming]) -> Result<Vec<Decision>, sqlx::Error> {
        self.apply(batch, NewRows::Order).await
    }

    /// The reconciler's side of the arbitration: under the same lock and the same
    /// unique keys as the consumer, records every reservation of `batch` that MySQL
    /// does not hold yet as failed. Whichever of the consumer and the reconciler
    /// comes first decides; the other sees the row and does nothing.
    pub async fn fail_absent(
        &self,
        batch: &[Incoming],
        reason: &'static str,
    ) -> Result<Vec<Decision>, sqlx::Error> {
        self.apply(batch, NewRows::Fail(reason)).await
    }

    async fn apply(
        &self,
        batch: &[Incoming],
        new_rows: NewRows,
    ) -> Result<Vec<Decision>, sqlx::Error> {
        use std::collections::{HashMap, HashSet};

        if batch.is_empty() {
            return Ok(Vec::new());
        }
        let mut ids: Vec<&str> = batch.iter().map(|m| m.activity_id.as_str()).collect();
        ids.sort_unstable();
        ids.dedup();

        let mut tx = self.pool.begin().await?;
        let sql = format!(
            "SELECT id, payment_timeout_secs, available FROM activities WHERE id IN ({}) ORDER BY id FOR UPDATE",
            placeholders(ids.len())
        );
        let mut q = sqlx::query_as::<_, (String, u32, i32)>(&sql);
        for id in &ids {
            q = q.bind(*id);
        }
        let mut activities: HashMap<String, (u32, i64)> = q
            .fetch_all(&mut *tx)
            .await?
            .into_iter()
            .map(|(id, timeout, available)| (id, (timeout, i64::from(available))))
            .collect();

        // What already exists, for these reservations or these users.
        let mut sql = format!(
            "SELECT reservation_id, activity_id, user_id FROM orders WHERE reservation_id IN ({})",
            placeholders(batch.len())
        );
        let mut users_by_activity: HashMap<&str, Vec<&str>> = HashMap::new();
        for m in batch {
            users_by_activity
                .entry(m.activity_id.as_str())
                .or_default()
                .push(m.user_id.as_str());
        }
        for users in users_by_activity.values() {
            sql.push_str(&format!(
                " OR (activity_id = ? AND user_id IN ({}))",
                placeholders(users.len())
            ));
        }
        let mut q = sqlx::query_as::<_, (String, String, String)>(&sql);
        for m in batch {
            q = q.bind(&m.reservation_id);
        }
        for (activity, users) in &users_by_activity {
            q = q.bind(*activity);
            for u in users {
                q = q.bind(*u);
            }
        }
        let existing = q.fetch_all(&mut *tx).await?;
        let mut known_reservations: HashSet<String> = HashSet::new();
        let mut known_users: HashSet<(String, String)> = HashSet::new();
        for (reservation, activity, user) in existing {
            known_reservations.insert(reservation);
            known_users.insert((activity, user));
        }

        let mut decisions = Vec::with_capacity(batch.len());
        let mut rows: Vec<(&Incoming, &'static str, Option<&'static str>, Option<u32>)> =
            Vec::new();
        let mut taken: HashMap<&str, i64> = HashMap::new();
        let mut redelivered: HashMap<&str, u32> = HashMap::new();
        for m in batch {
            let user_key = (m.activity_id.clone(), m.user_id.clone());
            let decision = if known_reservations.contains(&m.reservation_id) {
                *redelivered.entry(m.reservation_id.as_str()).or_default() += 1;
                Decision::Duplicate
            } else if known_users.contains(&user_key) {
                Decision::Superseded
            } else {
                let decision = match activities.get_mut(&m.activity_id) {
                    _ if matches!(new_rows, NewRows::Fail(_)) => {
                        let reason = match new_rows {
                            NewRows::Fail(reason) => reason,
                            NewRows::Order => "",
                        };
                        rows.push((m, "failed", Some(reason), None));
                        Decision::Failed { reason }
                    }
                    None => {
                        let reason = "unknown activity";
                        rows.push((m, "failed", Some(reason), None));
                        Decision::Failed { reason }
                    }
                    Some((timeout, available)) if *available >= i64::from(m.quantity) => {
                        *available -= i64::from(m.quantity);
                        *taken.entry(m.activity_id.as_str()).or_default() += i64::from(m.quantity);
                        rows.push((m, "pending_payment", None, Some(*timeout)));
                        Decision::Ordered
                    }
                    Some(_) => {
                        let reason = "no units left in the database";
                        rows.push((m, "failed", Some(reason), None));
                        Decision::Failed { reason }
                    }
                };
                known_reservations.insert(m.reservation_id.clone());
                known_users.insert(user_key);
                decision
            };
            decisions.push(decision);
        }

        for chunk in rows.chunks(500) {
            let values =
                vec!["(?, ?, ?, ?, ?, ?, NOW(3), NOW(3) + INTERVAL ? SECOND)"; chunk.len()]
                    .join(", ");
            let sql = format!(
                "INSERT INTO orders \
                 (reservation_id, activity_id, user_id, quantity, status, failure_reason, created_at, expires_at) \
                 VALUES {values}"
            );
            let mut q = sqlx::query(&sql);
            for (m, status, reason, timeout) in chunk {
                q = q
                    .bind(&m.reservation_id)
                    .bind(&m.activity_id)
                    .bind(&m.user_id)
                    .bind(m.quantity)
                    .bind(*status)
                    .bind(*reason)
                    // NULL seconds make a NULL deadline, right for a failed row.
                    .bind(*timeout);
            }
            q.execute(&mut *tx).await?;
        }
        for (activity, units) in &taken {
            let done = sqlx::query(
                "UPDATE activities SET available = available - ? WHERE id = ? AND available >= ?",
            )
            .bind(units)
            .bind(activity)
            .bind(units)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if done != 1 {
                // Impossible while the row is locked; refuse the batch rather than
                // write orders without their units.
                return Err(sqlx::Error::InvalidArgument(format!(
                    "activity {activity} lost units under its lock"
                )));
            }
        }
        // Redeliveries are counted per reservation; grouped by count, that is one
        // statement in the usual case (each seen once more).
        let mut by_count: HashMap<u32, Vec<&str>> = HashMap::new();
        for (reservation, n) in redelivered {
            by_count.entry(n).or_default().push(reservation);
        }
        for (n, reservations) in by_count {
            let sql = format!(
                "UPDATE orders SET redeliveries = redeliveries + ? WHERE reservation_id IN ({})",
                placeholders(reservations.len())
            );
            let mut q = sqlx::query(&sql).bind(n);
            for r in reservations {
                q = q.bind(r);
            }
            q.execute(&mut *tx).await?;
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

    /// Units held by live orders (awaiting payment or paid) of an activity.
    pub async fn live_units(&self, activity_id: &str) -> Result<i64, sqlx::Error> {
        let (n,): (i64,) = sqlx::query_as(
            "SELECT CAST(COALESCE(SUM(quantity), 0) AS SIGNED) FROM orders \
             WHERE activity_id = ? AND status IN ('pending_payment', 'paid')",
        )
        .bind(activity_id)
        .fetch_one(&self.pool)
        .await?;
        Ok(n)
    }

    /// (reservation id, units) of an activity's failed and cancelled orders whose
    /// units are not yet known to be back in Redis.
    pub async fn owed_units(&self, activity_id: &str) -> Result<Vec<(String, u32)>, sqlx::Error> {
        sqlx::query_as(
            "SELECT reservation_id, quantity FROM orders WHERE units_returned = FALSE \
             AND status IN ('failed', 'cancelled') AND activity_id = ?",
        )
        .bind(activity_id)
        .fetch_all(&self.pool)
        .await
    }

    /// A rebuild from MySQL counts every failed and cancelled order's units as
    /// available already; nothing is owed to the new Redis state.
    pub async fn mark_all_returned(&self, activity_id: &str) -> Result<(), sqlx::Error> {
        sqlx::query(
            "UPDATE orders SET units_returned = TRUE WHERE activity_id = ? \
             AND units_returned = FALSE AND status IN ('failed', 'cancelled')",
        )
        .bind(activity_id)
        .execute(&self.pool)
        .await?;
        Ok(())
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

fn placeholders(n: usize) -> String {
    vec!["?"; n].join(",")
}
