//! docs/DESIGN.md's invariants, checked once a sale is quiet, against MySQL, Redis and
//! the answers the clients got. A checker never loosens an invariant to fit the
//! code: what breaks one is a finding.
//!
//! 1. No oversell: units held by live orders never exceed the stock; neither
//!    Redis's stock nor MySQL's available count is negative.
//! 2. One per user: at most one live or cancelled order per user.
//! 3. A `202` is kept: every `202` is an order (awaiting payment, paid, or
//!    cancelled for non-payment), never `failed`, never missing; and no withdrawn
//!    reservation is also an order.
//! 4. Conservation: Redis stock + live units = stock = MySQL available + live
//!    units (nothing is pending, and no unit is between stock shards, once quiet).
//!
//! 5. Nothing stays shut ([`Probe::room_outcomes`], [`Probe::units_left`]):
//!    once quiet, every user who joined a waiting room was told an outcome (an
//!    order, or `sold_out` / `expired`), and no unit in Redis waits for a buyer
//!    the room keeps out.
//!
//! Redis is read through the service's own `StockStore`, summed over the sale's
//! stock shards, on one node or a Cluster.
//!
//! And every answer is a documented one.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use flashsale::config::KafkaSettings;

/// One client request and what it got (`status: None`: the connection failed).
#[derive(Debug, Clone, Default)]
pub struct Answer {
    pub status: Option<u16>,
    pub code: Option<String>,
    pub reservation_id: Option<String>,
}

impl Answer {
    /// Reads a reservation answer.
    pub async fn from_response(result: Result<reqwest::Response, reqwest::Error>) -> Self {
        match result {
            Ok(resp) => {
                let status = resp.status().as_u16();
                let body: serde_json::Value = resp.json().await.unwrap_or_default();
                Answer {
                    status: Some(status),
                    code: body["code"].as_str().map(str::to_owned),
                    reservation_id: body["reservation_id"].as_str().map(str::to_owned),
                }
            }
            Err(_) => Answer::default(),
        }
    }

    fn documented(&self) -> bool {
        matches!(
            (self.status, self.code.as_deref()),
            (Some(202), _)
                | (Some(409), Some("sold_out" | "already_reserved"))
                // A sale with a waiting room, to a user without a turn.
                | (Some(403), Some("not_admitted"))
                | (Some(503), Some("unavailable" | "paused"))
                | (None, _)
        )
    }
}

/// Where one sale lives.
#[derive(Debug, Clone)]
pub struct Probe {
    pub mysql_url: String,
    pub redis_url: String,
    pub activity_id: String,
    /// The reservation topic and the consumers' group.
    pub kafka: KafkaSettings,
}

/// What the checker counted.
#[derive(Debug, Default, Clone)]
pub struct Figures {
    pub requests: usize,
    pub accepted: usize,
    pub refused_503: usize,
    pub lost_connections: usize,
    /// Awaiting payment or paid.
    pub live_orders: i64,
    pub paid: i64,
    pub cancelled: i64,
    /// Failed rows (MySQL refused: incidents).
    pub failed: i64,
    /// `202`s that became orders (live or cancelled).
    pub accepted_ordered: usize,
    /// `202`s that ended failed or with no order: broken promises.
    pub accepted_broken: usize,
    /// Reservations withdrawn before they reached anyone.
    pub withdrawn: i64,
    pub answers: BTreeMap<String, usize>,
}

impl Probe {
    async fn pool(&self) -> Result<sqlx::MySqlPool, String> {
        sqlx::MySqlPool::connect(&self.mysql_url)
            .await
            .map_err(|e| format!("MySQL: {e}"))
    }

    /// The service's own Redis handle: one node or a Cluster, as the URL says.
    async fn redis(&self) -> Result<flashsale::stock::RedisConn, String> {
        let settings = flashsale::config::RedisSettings {
            url: self.redis_url.clone(),
            connection_timeout_ms: 2000,
            response_timeout_ms: 2000,
            min_replicas_acked: flashsale::config::ReplicasAcked::Exactly(0),
            retain_after_end_secs: 86_400,
            replica_ack_timeout_ms: 0,
        };
        flashsale::stock::RedisConn::connect(&settings)
            .await
            .map_err(|e| format!("Redis: {e:#}"))
    }

    /// The sale's Redis state, summed over its stock shards: (snapshot, units
    /// lent between shards and not yet received).
    async fn redis_state(
        &self,
        pool: &sqlx::MySqlPool,
    ) -> Result<(flashsale::stock::StockSnapshot, i64), String> {
        let (shards,): (u8,) = sqlx::query_as("SELECT stock_shards FROM activities WHERE id = ?")
            .bind(&self.activity_id)
            .fetch_one(pool)
            .await
            .map_err(|e| e.to_string())?;
        let store = flashsale::stock::StockStore::new(self.redis().await?);
        let snapshot = store
            .snapshot(&self.activity_id, shards)
            .await
            .map_err(|e| e.to_string())?;
        let audit = store
            .audit(&self.activity_id, shards, 0, 0, &[])
            .await
            .map_err(|e| e.to_string())?;
        Ok((snapshot, audit.in_transit))
    }

    /// One look: `Ok(None)` when quiet, else what is still moving.
    async fn unquiet(&self) -> Result<Option<String>, String> {
        let lag = flashsale::kafka::consumer_lag(&self.kafka)
            .await
            .map_err(|e| e.to_string())?;
        let pool = self.pool().await?;
        let (snapshot, in_transit) = self.redis_state(&pool).await?;
        let (pending, stock, state) = (snapshot.pending, snapshot.stock, snapshot.state);
        let (owed, overdue): (i64, i64) = sqlx::query_as(
            "SELECT \
               CAST(COALESCE(SUM(units_returned = FALSE AND status IN ('failed', 'cancelled')), 0) AS SIGNED), \
               CAST(COALESCE(SUM(status = 'pending_payment' AND expires_at < NOW(3)), 0) AS SIGNED) \
             FROM orders WHERE activity_id = ?",
        )
        .bind(&self.activity_id)
        .fetch_one(&pool)
        .await
        .map_err(|e| e.to_string())?;
        pool.close().await;
        let quiet = lag == 0
            && pending == 0
            && in_transit == 0
            && stock.is_some()
            && state.as_deref() == Some("open")
            && owed == 0
            && overdue == 0;
        Ok((!quiet).then(|| {
            format!("lag {lag}, pending {pending}, in transit {in_transit}, stock {stock:?}, state {state:?}, owed {owed}, overdue {overdue}")
        }))
    }

    /// Waits until the sale is quiet: the consumers drained, nothing pending in
    /// Redis, the activity loaded and open, every failed or cancelled order's
    /// units back, no unpaid order past its deadline.
    pub async fn wait_quiet(&self, limit: Duration) -> Result<(), String> {
        let deadline = std::time::Instant::now() + limit;
        loop {
            let last = match self.unquiet().await {
                Ok(None) => return Ok(()),
                Ok(Some(s)) => s,
                Err(e) => e,
            };
            if std::time::Instant::now() > deadline {
                return Err(format!("never quiet: {last}"));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The units Redis holds for sale now, over every shard (`None`: not loaded).
    pub async fn units_left(&self) -> Result<Option<i64>, String> {
        let pool = self.pool().await?;
        let state = self.redis_state(&pool).await;
        pool.close().await;
        Ok(state?.0.stock)
    }

    /// Invariant 5 for a waiting room, once the sale is quiet. `places` holds
    /// every user who joined with the state `GET /flash/{sku}/queue` answers
    /// them now (`"none"` when it does not know them). Each must have been told
    /// an outcome: an order (whatever became of it), or `expired`, or
    /// `sold_out`; and while the sale is open, no one may be told `sold_out`
    /// or left waiting while units are for sale in Redis. Once it has ended,
    /// Redis's units say nothing of the room any more (a lapse after the end
    /// returns a unit no one can buy), so the second half is judged only on
    /// an open sale: a room that shut early and then ended is not caught
    /// here. `Err` names who and how many.
    pub async fn room_outcomes(&self, places: &[(String, String)]) -> Result<(), String> {
        let pool = self.pool().await?;
        let ordered: Result<Vec<(String,)>, String> = sqlx::query_as(
            "SELECT CAST(user_id AS CHAR) FROM orders WHERE activity_id = ? GROUP BY user_id",
        )
        .bind(&self.activity_id)
        .fetch_all(&pool)
        .await
        .map_err(|e| e.to_string());
        // Who the draw placed (MySQL keeps them): tells a reader whether the
        // untold joined before the start or after.
        let drawn: Result<Vec<(String,)>, String> = sqlx::query_as(
            "SELECT CAST(user_id AS CHAR) FROM waiting_room_entries WHERE activity_id = ?",
        )
        .bind(&self.activity_id)
        .fetch_all(&pool)
        .await
        .map_err(|e| e.to_string());
        let ended: Result<i64, String> = sqlx::query_scalar(
            "SELECT CAST(ends_at <= NOW(3) AS SIGNED) FROM activities WHERE id = ?",
        )
        .bind(&self.activity_id)
        .fetch_one(&pool)
        .await
        .map_err(|e| e.to_string());
        let state = self.redis_state(&pool).await;
        pool.close().await;
        let ordered: std::collections::HashSet<String> =
            ordered?.into_iter().map(|(u,)| u).collect();
        let drawn: std::collections::HashSet<String> = drawn?.into_iter().map(|(u,)| u).collect();
        let ended = ended? != 0;
        let Some(left) = state?.0.stock else {
            return Err("the sale is not loaded in Redis: its units cannot be told".into());
        };
        let mut untold: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        let mut shut_out = 0;
        for (user, place) in places {
            if ordered.contains(user) {
                continue;
            }
            match place.as_str() {
                "expired" => {}
                "sold_out" if left <= 0 || ended => {}
                "sold_out" => shut_out += 1,
                other => untold.entry(other).or_default().push(user),
            }
        }
        let mut problems = Vec::new();
        for (place, users) in &untold {
            let some: Vec<&&str> = users.iter().take(5).collect();
            let placed = users.iter().filter(|u| drawn.contains(**u)).count();
            problems.push(format!(
                "{} joined users told no outcome (queue state {place:?}, no order; {placed} of them placed by the draw, {} joined after it), e.g. {some:?}",
                users.len(),
                users.len() - placed
            ));
        }
        if shut_out > 0 {
            problems.push(format!(
                "{shut_out} joined users told sold_out while Redis holds {left} units"
            ));
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems.join("\n"))
        }
    }

    /// Checks the invariants; `Err` lists every one broken, with the figures.
    pub async fn check(&self, answers: &[Answer]) -> Result<Figures, String> {
        let mut f = Figures {
            requests: answers.len(),
            ..Figures::default()
        };
        let mut problems = tally_answers(answers, &mut f);
        let pool = self.pool().await?;
        let Rows {
            stock,
            available,
            orders,
            withdrawn,
            withdrawn_ordered,
        } = self.rows(&pool).await?;
        let (snapshot, _) = self.redis_state(&pool).await?;
        pool.close().await;
        f.withdrawn = withdrawn;
        let (live_units, holders, fate) = tally_orders(&orders, &mut f);
        let redis_stock = snapshot.stock.ok_or("Redis does not hold the activity")?;

        // 1. No oversell.
        if live_units > stock {
            problems.push(format!("oversell: {live_units} live units for {stock}"));
        }
        if snapshot.shard_stock.iter().flatten().any(|s| *s < 0) || available < 0 {
            problems.push(format!(
                "negative stock: redis {redis_stock}, mysql {available}"
            ));
        }
        // 2. One per user.
        let doubles: Vec<_> = holders.iter().filter(|(_, n)| **n > 1).collect();
        if !doubles.is_empty() {
            problems.push(format!("users with two orders: {doubles:?}"));
        }
        // 3. Every 202 kept; nothing withdrawn is an order.
        problems.extend(promises_kept(answers, &fate, &mut f));
        if withdrawn_ordered > 0 {
            problems.push(format!(
                "{withdrawn_ordered} withdrawn reservations are orders too"
            ));
        }
        // 4. Conservation, in Redis and in MySQL.
        if redis_stock + live_units != stock {
            problems.push(format!(
                "not conserved: redis {redis_stock} + live {live_units} != stock {stock}"
            ));
        }
        if available + live_units != stock {
            problems.push(format!(
                "mysql not conserved: available {available} + live {live_units} != stock {stock}"
            ));
        }
        if problems.is_empty() {
            Ok(f)
        } else {
            Err(format!("{}\nfigures: {f:?}", problems.join("\n")))
        }
    }

    /// What MySQL holds of the sale.
    async fn rows(&self, pool: &sqlx::MySqlPool) -> Result<Rows, String> {
        let (stock, available): (i64, i64) = sqlx::query_as(
            "SELECT CAST(stock AS SIGNED), CAST(available AS SIGNED) FROM activities WHERE id = ?",
        )
        .bind(&self.activity_id)
        .fetch_one(pool)
        .await
        .map_err(|e| e.to_string())?;
        let orders: Vec<(String, String, String, i64)> = sqlx::query_as(
            "SELECT reservation_id, CAST(user_id AS CHAR), CAST(status AS CHAR), CAST(quantity AS SIGNED) \
             FROM orders WHERE activity_id = ?",
        )
        .bind(&self.activity_id)
        .fetch_all(pool)
        .await
        .map_err(|e| e.to_string())?;
        let (withdrawn, withdrawn_ordered): (i64, i64) = sqlx::query_as(
            "SELECT CAST(COUNT(*) AS SIGNED), CAST(COALESCE(SUM(o.id IS NOT NULL), 0) AS SIGNED) \
             FROM withdrawals w LEFT JOIN orders o ON o.reservation_id = w.reservation_id \
             WHERE w.activity_id = ?",
        )
        .bind(&self.activity_id)
        .fetch_one(pool)
        .await
        .map_err(|e| e.to_string())?;
        Ok(Rows {
            stock,
            available,
            orders,
            withdrawn,
            withdrawn_ordered,
        })
    }
}

/// MySQL's side of a sale: the activity's counts, its orders (reservation,
/// user, status, units) and its withdrawals.
struct Rows {
    stock: i64,
    available: i64,
    orders: Vec<(String, String, String, i64)>,
    withdrawn: i64,
    withdrawn_ordered: i64,
}

/// Counts the answers by kind; an undocumented one is a problem.
fn tally_answers(answers: &[Answer], f: &mut Figures) -> Vec<String> {
    let mut problems = Vec::new();
    for a in answers {
        let key = match (a.status, &a.code) {
            (Some(s), Some(c)) => format!("{s} {c}"),
            (Some(s), None) => s.to_string(),
            (None, _) => "connection lost".into(),
        };
        *f.answers.entry(key).or_default() += 1;
        match a.status {
            Some(202) => f.accepted += 1,
            Some(503) => f.refused_503 += 1,
            None => f.lost_connections += 1,
            _ => {}
        }
        if !a.documented() {
            problems.push(format!(
                "an undocumented answer: {:?} {:?}",
                a.status, a.code
            ));
        }
    }
    problems
}

/// Counts the orders by status: the live units, how many orders each user
/// holds (failed ones aside), and each reservation's fate.
fn tally_orders<'a>(
    orders: &'a [(String, String, String, i64)],
    f: &mut Figures,
) -> (i64, HashMap<&'a str, usize>, HashMap<&'a str, &'a str>) {
    let mut live_units = 0;
    let mut holders: HashMap<&str, usize> = HashMap::new();
    let mut fate: HashMap<&str, &str> = HashMap::new();
    for (reservation, user, status, units) in orders {
        match status.as_str() {
            "pending_payment" | "paid" => {
                live_units += units;
                f.live_orders += 1;
                if status == "paid" {
                    f.paid += 1;
                }
            }
            "cancelled" => f.cancelled += 1,
            _ => f.failed += 1,
        }
        if status != "failed" {
            *holders.entry(user).or_default() += 1;
        }
        fate.insert(reservation, status);
    }
    (live_units, holders, fate)
}

/// Invariant 3's first half: every `202` is an order, never a failed one.
fn promises_kept(answers: &[Answer], fate: &HashMap<&str, &str>, f: &mut Figures) -> Vec<String> {
    let mut failed_after_202 = 0;
    let mut missing = 0;
    for a in answers.iter().filter(|a| a.status == Some(202)) {
        match a.reservation_id.as_deref().and_then(|r| fate.get(r)) {
            Some(&"failed") => failed_after_202 += 1,
            Some(_) => f.accepted_ordered += 1,
            None => missing += 1,
        }
    }
    f.accepted_broken = failed_after_202 + missing;
    let mut problems = Vec::new();
    if failed_after_202 > 0 {
        problems.push(format!("{failed_after_202} answers of 202 ended failed"));
    }
    if missing > 0 {
        problems.push(format!("{missing} answers of 202 are in no order"));
    }
    problems
}
