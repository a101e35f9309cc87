//! Redis side of the sale: the keys of one activity and the Lua scripts that change
//! them atomically.
//!
//! Every key of an activity carries the hash tag `{<activity_id>}`, so on Redis
//! Cluster they share one slot and a script may touch them all. Scripts are sent with
//! EVALSHA; `redis::Script` loads them and retries once on NOSCRIPT, so a flushed
//! script cache costs one extra round trip, never a failed request.

mod conn;

use redis::{AsyncCommands, RedisResult, Script};

pub use conn::RedisConn;

/// The Redis keys of one activity.
#[derive(Debug, Clone)]
pub struct Keys {
    pub stock: String,
    pub buyers: String,
    pub pending: String,
    pub res: String,
    pub refunded: String,
    pub state: String,
}

impl Keys {
    pub fn new(activity_id: &str) -> Self {
        let base = format!("flash:{{{activity_id}}}");
        Keys {
            stock: format!("{base}:stock"),
            buyers: format!("{base}:buyers"),
            pending: format!("{base}:pending"),
            res: format!("{base}:res"),
            refunded: format!("{base}:refunded"),
            state: format!("{base}:state"),
        }
    }
}

/// What the reserve script decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReserveOutcome {
    Reserved {
        reservation_id: String,
    },
    AlreadyReserved {
        reservation_id: String,
    },
    SoldOut,
    /// A key is missing: the activity is not loaded (or Redis lost it).
    NotLoaded,
    Paused,
}

/// Which refund: see `refund.lua`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefundMode {
    /// The reservation never reached the queue: return it only if still pending,
    /// and give the purchase right back.
    Undo,
    /// The order failed or was cancelled: return the units, keep the right spent.
    Return,
}

/// What the refund script did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefundOutcome {
    Returned { units: u32 },
    AlreadyRefunded,
    NothingToUndo,
    NotLoaded,
}

/// A read-only view of an activity's Redis state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StockSnapshot {
    /// `None` when the key is missing (not loaded).
    pub stock: Option<i64>,
    pub state: Option<String>,
    pub pending: u64,
    pub buyers: u64,
}

#[derive(Clone)]
pub struct StockStore {
    conn: RedisConn,
    reserve: Script,
    refund: Script,
    preload: Script,
}

impl StockStore {
    pub fn new(conn: RedisConn) -> Self {
        StockStore {
            conn,
            reserve: Script::new(include_str!("reserve.lua")),
            refund: Script::new(include_str!("refund.lua")),
            preload: Script::new(include_str!("preload.lua")),
        }
    }

    pub fn connection(&self) -> RedisConn {
        self.conn.clone()
    }

    /// Runs the reserve script: already bought → enough stock → decrement → record
    /// the buyer and a pending reservation, as one atomic step.
    pub async fn reserve(
        &self,
        activity_id: &str,
        user_id: &str,
        quantity: u32,
        new_reservation_id: &str,
        now_ms: i64,
    ) -> RedisResult<ReserveOutcome> {
        let k = Keys::new(activity_id);
        let mut conn = self.conn.clone();
        let (code, value): (i64, String) = self
            .reserve
            .key(&k.stock)
            .key(&k.buyers)
            .key(&k.pending)
            .key(&k.res)
            .key(&k.state)
            .arg(user_id)
            .arg(quantity)
            .arg(new_reservation_id)
            .arg(now_ms)
            .invoke_async(&mut conn)
            .await?;
        Ok(match code {
            1 => ReserveOutcome::Reserved {
                reservation_id: value,
            },
            0 => ReserveOutcome::AlreadyReserved {
                reservation_id: value,
            },
            -1 => ReserveOutcome::SoldOut,
            -4 => ReserveOutcome::Paused,
            _ => ReserveOutcome::NotLoaded,
        })
    }

    /// Returns a reservation's units exactly once (see `refund.lua` for the modes).
    pub async fn refund(
        &self,
        activity_id: &str,
        reservation_id: &str,
        user_id: &str,
        quantity: u32,
        mode: RefundMode,
    ) -> RedisResult<RefundOutcome> {
        let k = Keys::new(activity_id);
        let mut conn = self.conn.clone();
        let n: i64 = self
            .refund
            .key(&k.stock)
            .key(&k.buyers)
            .key(&k.pending)
            .key(&k.res)
            .key(&k.refunded)
            .arg(reservation_id)
            .arg(user_id)
            .arg(quantity)
            .arg(match mode {
                RefundMode::Undo => "undo",
                RefundMode::Return => "return",
            })
            .invoke_async(&mut conn)
            .await?;
        Ok(match n {
            0 => RefundOutcome::AlreadyRefunded,
            -1 => RefundOutcome::NothingToUndo,
            -3 => RefundOutcome::NotLoaded,
            // The script returns the quantity it was given, which is at least 1.
            units => RefundOutcome::Returned {
                units: u32::try_from(units).unwrap_or(u32::MAX),
            },
        })
    }

    /// Clears the pending marks of reservations MySQL now holds, so the reconciler
    /// sees only reservations that truly never arrived.
    pub async fn confirm(&self, activity_id: &str, reservation_ids: &[String]) -> RedisResult<()> {
        if reservation_ids.is_empty() {
            return Ok(());
        }
        let k = Keys::new(activity_id);
        let mut conn = self.conn.clone();
        let _: () = redis::pipe()
            .zrem(&k.pending, reservation_ids)
            .ignore()
            .hdel(&k.res, reservation_ids)
            .ignore()
            .query_async(&mut conn)
            .await?;
        Ok(())
    }

    /// Replaces the activity's Redis state with `available` units and the given
    /// buyers (user id, reservation id).
    pub async fn preload(
        &self,
        activity_id: &str,
        available: i64,
        paused: bool,
        buyers: &[(String, String)],
    ) -> RedisResult<()> {
        let k = Keys::new(activity_id);
        let mut conn = self.conn.clone();
        let mut invocation = self.preload.prepare_invoke();
        invocation
            .key(&k.stock)
            .key(&k.buyers)
            .key(&k.pending)
            .key(&k.res)
            .key(&k.refunded)
            .key(&k.state)
            .arg(available)
            .arg(if paused { "paused" } else { "open" });
        for (user, reservation) in buyers {
            invocation.arg(user).arg(reservation);
        }
        let _: i64 = invocation.invoke_async(&mut conn).await?;
        Ok(())
    }

    /// Sets the live open/paused switch, only if the activity is loaded.
    /// Returns whether it was loaded.
    pub async fn set_paused(&self, activity_id: &str, paused: bool) -> RedisResult<bool> {
        let k = Keys::new(activity_id);
        let mut conn = self.conn.clone();
        let set: Option<String> = redis::cmd("SET")
            .arg(&k.state)
            .arg(if paused { "paused" } else { "open" })
            .arg("XX")
            .query_async(&mut conn)
            .await?;
        Ok(set.is_some())
    }

    /// Units Redis may still hand out; `None` when not loaded.
    pub async fn stock_left(&self, activity_id: &str) -> RedisResult<Option<i64>> {
        let k = Keys::new(activity_id);
        let mut conn = self.conn.clone();
        conn.get(&k.stock).await
    }

    pub async fn snapshot(&self, activity_id: &str) -> RedisResult<StockSnapshot> {
        let k = Keys::new(activity_id);
        let mut conn = self.conn.clone();
        // One slot, so one pipeline works on Cluster too.
        let (stock, state, pending, buyers): (Option<i64>, Option<String>, u64, u64) =
            redis::pipe()
                .get(&k.stock)
                .get(&k.state)
                .zcard(&k.pending)
                .hlen(&k.buyers)
                .query_async(&mut conn)
                .await?;
        Ok(StockSnapshot {
            stock,
            state,
            pending,
            buyers,
        })
    }

    /// The reservation id this user holds in Redis, if any.
    pub async fn reservation_of(
        &self,
        activity_id: &str,
        user_id: &str,
    ) -> RedisResult<Option<String>> {
        let k = Keys::new(activity_id);
        let mut conn = self.conn.clone();
        conn.hget(&k.buyers, user_id).await
    }

    pub async fn ping(&self) -> RedisResult<()> {
        let mut conn = self.conn.clone();
        let _: String = redis::cmd("PING").query_async(&mut conn).await?;
        Ok(())
    }
}
