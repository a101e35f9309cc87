//! MySQL access for orders.

mod decide;

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, NaiveDateTime, Utc};
use sqlx::{MySqlConnection, MySqlPool};

use crate::clock::Clock;

use decide::{decide, Known, Locked, NewOrder, Plan};
pub use decide::{Decision, Incoming, NewRows};

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

const COLUMNS: &str =
    "id, reservation_id, activity_id, CAST(user_id AS CHAR), quantity, CAST(status AS CHAR), \
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
    /// Payment deadlines are set and judged by it: the shared clock in the
    /// service (see `crate::clock`), not MySQL's or this process's.
    clock: Clock,
}

impl OrderRepo {
    pub fn new(pool: MySqlPool) -> Self {
        OrderRepo {
            pool,
            clock: Clock::local(),
        }
    }

    /// Sets and judges payment deadlines by `clock`.
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    /// The order of this user in this activity, if one reached MySQL: the live or
    /// cancelled one if there is one, else the latest failed one.
    pub async fn by_user(
        &self,
        activity_id: &str,
        user_id: &str,
    ) -> Result<Option<Order>, sqlx::Error> {
        let row: Option<OrderRow> = sqlx::query_as(&format!(
            "SELECT {COLUMNS} FROM orders WHERE activity_id = ? AND user_id = ? \
             ORDER BY status = 'failed', id DESC LIMIT 1"
        ))
        .bind(activity_id)
        .bind(user_id)
        .fetch_optional(&self.pool)
        .await?;
        row.map(from_row).transpose()
    }
}

/// MySQL errors that mean the data itself is bad, so retrying cannot help: a value
/// out of range, too long or of the wrong kind, a NULL where none may be, a
/// failed check or foreign key. Everything else (lost connections, read-only
/// after a failover, disk full, lock waits, timeouts, privileges, errors never
/// seen before) is transient: retried with backoff, never refunded.
pub fn is_permanent(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .is_some_and(|e| {
                matches!(
                    e.number(),
                    // ER_BAD_NULL_ERROR, ER_WARN_DATA_OUT_OF_RANGE, WARN_DATA_TRUNCATED,
                    // ER_TRUNCATED_WRONG_VALUE, ER_TRUNCATED_WRONG_VALUE_FOR_FIELD,
                    // ER_DATA_TOO_LONG, ER_NO_REFERENCED_ROW_2, ER_CHECK_CONSTRAINT_VIOLATED
                    // (MySQL), ER_CONSTRAINT_FAILED (MariaDB)
                    1048 | 1264 | 1265 | 1292 | 1366 | 1406 | 1452 | 3819 | 4025
                )
            }),
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

    /// Decides every reservation of `batch` that MySQL has not decided yet as
    /// `new_rows` says, under the same lock and unique keys whoever calls it: the
    /// consumer, a request withdrawing its own reservation, the reconciler.
    /// Whichever comes first decides; the others find the decision.
    ///
    /// Three steps in one transaction: read what MySQL holds for the batch (its
    /// activities locked first), decide in memory (`decide`), write.
    pub async fn apply(
        &self,
        batch: &[Incoming],
        new_rows: NewRows,
    ) -> Result<Vec<Decision>, sqlx::Error> {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        let mut tx = self.pool.begin().await?;
        let known = read(&mut tx, batch).await?;
        let plan = decide(batch, known, new_rows);
        write(&mut tx, &plan, self.clock.now().naive_utc()).await?;
        tx.commit().await?;
        Ok(plan.decisions)
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
        let now = self.clock.now().naive_utc();
        let done = sqlx::query(
            "UPDATE orders SET status = 'paid', paid_at = ? \
             WHERE id = ? AND user_id = ? AND status = 'pending_payment' AND expires_at > ?",
        )
        .bind(now)
        .bind(id)
        .bind(user_id)
        .bind(now)
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
        let now = self.clock.now().naive_utc();
        let candidates: Vec<(u64,)> = sqlx::query_as(
            "SELECT id FROM orders WHERE status = 'pending_payment' AND expires_at <= ? \
             ORDER BY expires_at LIMIT ?",
        )
        .bind(now)
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        let mut cancelled = Vec::new();
        for (id,) in candidates {
            let mut tx = self.pool.begin().await?;
            let won = sqlx::query(
                "UPDATE orders SET status = 'cancelled', cancelled_at = ? \
                 WHERE id = ? AND status = 'pending_payment' AND expires_at <= ?",
            )
            .bind(now)
            .bind(id)
            .bind(now)
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

    /// Units in an activity's orders awaiting payment: they come back if the
    /// payment lapses.
    pub async fn unpaid_units(&self, activity_id: &str) -> Result<i64, sqlx::Error> {
        let (n,): (i64,) = sqlx::query_as(
            "SELECT CAST(COALESCE(SUM(quantity), 0) AS SIGNED) FROM orders \
             WHERE activity_id = ? AND status = 'pending_payment'",
        )
        .bind(activity_id)
        .fetch_one(&self.pool)
        .await?;
        Ok(n)
    }

    /// How many of these reservations MySQL holds as orders (of any status).
    pub async fn count_orders_of(&self, reservation_ids: &[String]) -> Result<i64, sqlx::Error> {
        if reservation_ids.is_empty() {
            return Ok(0);
        }
        let placeholders = vec!["?"; reservation_ids.len()].join(",");
        let sql = format!("SELECT COUNT(*) FROM orders WHERE reservation_id IN ({placeholders})");
        let mut q = sqlx::query_as::<_, (i64,)>(&sql);
        for id in reservation_ids {
            q = q.bind(id);
        }
        Ok(q.fetch_one(&self.pool).await?.0)
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

    /// Units MySQL counts as available that Redis has yet to get back: the
    /// failed and cancelled orders of `owed_units`, and the top-ups not yet added
    /// to Redis; (reservation or top-up id, units), sorted, so two reads compare.
    pub async fn owed_to_redis(
        &self,
        activity_id: &str,
    ) -> Result<Vec<(String, u32)>, sqlx::Error> {
        let mut owed = self.owed_units(activity_id).await?;
        owed.extend(
            crate::activity::ActivityRepo::new(self.pool.clone())
                .unapplied_topups(activity_id)
                .await?,
        );
        owed.sort_unstable();
        Ok(owed)
    }

    /// An activity's cancelled orders (lapsed payments), returned or not.
    pub async fn cancelled(&self, activity_id: &str) -> Result<Vec<Order>, sqlx::Error> {
        let rows: Vec<OrderRow> = sqlx::query_as(&format!(
            "SELECT {COLUMNS} FROM orders WHERE activity_id = ? AND status = 'cancelled'"
        ))
        .bind(activity_id)
        .fetch_all(&self.pool)
        .await?;
        rows.into_iter().map(from_row).collect()
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

/// What MySQL holds for `batch`, its activities locked first (`FOR UPDATE`, in
/// id order). Every path that creates orders takes this lock first, so while it
/// is held nobody else inserts orders for these activities, and concurrent
/// consumers queue here instead of deadlocking on the orders' unique indexes.
async fn read(conn: &mut MySqlConnection, batch: &[Incoming]) -> Result<Known, sqlx::Error> {
    let mut known = Known {
        activities: lock_activities(conn, batch).await?,
        ..Known::default()
    };
    existing_orders(conn, batch, &mut known).await?;
    known.withdrawn = withdrawn(conn, batch).await?;
    Ok(known)
}

async fn lock_activities(
    conn: &mut MySqlConnection,
    batch: &[Incoming],
) -> Result<HashMap<String, Locked>, sqlx::Error> {
    let mut ids: Vec<&str> = batch.iter().map(|m| m.activity_id.as_str()).collect();
    ids.sort_unstable();
    ids.dedup();
    let sql = format!(
        "SELECT id, payment_timeout_secs, available FROM activities WHERE id IN ({}) ORDER BY id FOR UPDATE",
        placeholders(ids.len())
    );
    let mut q = sqlx::query_as::<_, (String, u32, i32)>(&sql);
    for id in &ids {
        q = q.bind(*id);
    }
    Ok(q.fetch_all(&mut *conn)
        .await?
        .into_iter()
        .map(|(id, payment_timeout_secs, available)| {
            let locked = Locked {
                payment_timeout_secs,
                available: i64::from(available),
            };
            (id, locked)
        })
        .collect())
}

/// The orders that exist for the batch's reservations or its users, into
/// `known.orders` and `known.buyers`.
async fn existing_orders(
    conn: &mut MySqlConnection,
    batch: &[Incoming],
    known: &mut Known,
) -> Result<(), sqlx::Error> {
    let mut sql = format!(
        "SELECT reservation_id, activity_id, CAST(user_id AS CHAR), status = 'failed' FROM orders WHERE reservation_id IN ({})",
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
    let mut q = sqlx::query_as::<_, (String, String, String, bool)>(&sql);
    for m in batch {
        q = q.bind(&m.reservation_id);
    }
    for (activity, users) in &users_by_activity {
        q = q.bind(*activity);
        for u in users {
            q = q.bind(*u);
        }
    }
    for (reservation, activity, user, failed) in q.fetch_all(&mut *conn).await? {
        if !failed {
            known.buyers.insert((activity, user));
        }
        known.orders.insert(reservation, failed);
    }
    Ok(())
}

async fn withdrawn(
    conn: &mut MySqlConnection,
    batch: &[Incoming],
) -> Result<HashSet<String>, sqlx::Error> {
    let sql = format!(
        "SELECT reservation_id FROM withdrawals WHERE reservation_id IN ({})",
        placeholders(batch.len())
    );
    let mut q = sqlx::query_as::<_, (String,)>(&sql);
    for m in batch {
        q = q.bind(&m.reservation_id);
    }
    Ok(q.fetch_all(&mut *conn)
        .await?
        .into_iter()
        .map(|(r,)| r)
        .collect())
}

/// Writes what the batch decided, in a handful of statements whatever its size:
/// multi-row inserts of the new orders (and failed ones) and of the withdrawals,
/// one guarded update per activity taking the units, and the redeliveries
/// counted.
async fn write(
    conn: &mut MySqlConnection,
    plan: &Plan<'_>,
    now: NaiveDateTime,
) -> Result<(), sqlx::Error> {
    insert_orders(conn, &plan.orders, now).await?;
    insert_withdrawals(conn, &plan.withdrawals).await?;
    take_units(conn, &plan.taken).await?;
    count_redeliveries(conn, &plan.redelivered).await
}

/// `now` (the shared clock) is each order's `created_at`, and its payment
/// deadline runs from it.
async fn insert_orders(
    conn: &mut MySqlConnection,
    rows: &[NewOrder<'_>],
    now: NaiveDateTime,
) -> Result<(), sqlx::Error> {
    for chunk in rows.chunks(500) {
        let values =
            vec!["(?, ?, ?, ?, ?, ?, ?, ?, ? + INTERVAL ? SECOND)"; chunk.len()].join(", ");
        let sql = format!(
            "INSERT INTO orders \
             (reservation_id, activity_id, user_id, quantity, status, failure_reason, units_returned, created_at, expires_at) \
             VALUES {values}"
        );
        let mut q = sqlx::query(&sql);
        for row in chunk {
            q = q
                .bind(&row.m.reservation_id)
                .bind(&row.m.activity_id)
                .bind(&row.m.user_id)
                .bind(row.m.quantity)
                .bind(row.status)
                .bind(row.reason)
                .bind(row.returned)
                .bind(now)
                .bind(now)
                // NULL seconds make a NULL deadline, right for a failed row.
                .bind(row.timeout);
        }
        q.execute(&mut *conn).await?;
    }
    Ok(())
}

async fn insert_withdrawals(
    conn: &mut MySqlConnection,
    withdrawals: &[(&Incoming, &'static str)],
) -> Result<(), sqlx::Error> {
    for chunk in withdrawals.chunks(500) {
        let values = vec!["(?, ?, ?, ?, ?)"; chunk.len()].join(", ");
        let sql = format!(
            "INSERT INTO withdrawals (reservation_id, activity_id, user_id, quantity, reason) \
             VALUES {values}"
        );
        let mut q = sqlx::query(&sql);
        for (m, reason) in chunk {
            q = q
                .bind(&m.reservation_id)
                .bind(&m.activity_id)
                .bind(&m.user_id)
                .bind(m.quantity)
                .bind(*reason);
        }
        q.execute(&mut *conn).await?;
    }
    Ok(())
}

/// Takes the new orders' units: `available >= taken` holds under the lock, and
/// MySQL's check constraint backs it.
async fn take_units(
    conn: &mut MySqlConnection,
    taken: &HashMap<&str, i64>,
) -> Result<(), sqlx::Error> {
    for (activity, units) in taken {
        let done = sqlx::query(
            "UPDATE activities SET available = available - ? WHERE id = ? AND available >= ?",
        )
        .bind(units)
        .bind(activity)
        .bind(units)
        .execute(&mut *conn)
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
    Ok(())
}

/// Redeliveries are counted per reservation; grouped by count, that is one
/// statement in the usual case (each seen once more).
async fn count_redeliveries(
    conn: &mut MySqlConnection,
    redelivered: &HashMap<&str, u32>,
) -> Result<(), sqlx::Error> {
    let mut by_count: HashMap<u32, Vec<&str>> = HashMap::new();
    for (reservation, n) in redelivered {
        by_count.entry(*n).or_default().push(reservation);
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
        q.execute(&mut *conn).await?;
    }
    Ok(())
}
