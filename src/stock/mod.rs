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

/// One script argument, encoded as Redis would.
fn arg<T: redis::ToRedisArgs>(value: T) -> Vec<u8> {
    value.to_redis_args().concat()
}

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

/// Which preload: see `preload.lua`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreloadMode {
    /// Replace whatever is there (the operator's preload).
    Force,
    /// Build only when the activity is not loaded (the automatic rebuild).
    Missing,
}

/// What `audit.lua` found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Audit {
    pub loaded: bool,
    pub stock: i64,
    pub pending_units: i64,
    pub owed_units: i64,
    pub expected: i64,
    pub repaired: bool,
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

/// A Lua script: its SHA for EVALSHA, and its text for the fallback.
#[derive(Clone)]
struct Lua {
    script: Script,
    code: &'static str,
}

impl Lua {
    fn new(code: &'static str) -> Self {
        Lua {
            script: Script::new(code),
            code,
        }
    }
}

#[derive(Clone)]
pub struct StockStore {
    conn: RedisConn,
    reserve: Lua,
    refund: Lua,
    preload: Lua,
    audit: Lua,
}

impl StockStore {
    pub fn new(conn: RedisConn) -> Self {
        StockStore {
            conn,
            reserve: Lua::new(include_str!("reserve.lua")),
            refund: Lua::new(include_str!("refund.lua")),
            preload: Lua::new(include_str!("preload.lua")),
            audit: Lua::new(include_str!("audit.lua")),
        }
    }

    pub fn connection(&self) -> RedisConn {
        self.conn.clone()
    }

    /// EVALSHA, which `redis::Script` follows with SCRIPT LOAD and one retry on
    /// NOSCRIPT. If the cache is flushed again between that load and the retry,
    /// the script is sent whole with EVAL: a flushed cache never fails a call.
    async fn run<T: redis::FromRedisValue>(
        &self,
        lua: &Lua,
        keys: &[&str],
        args: &[Vec<u8>],
    ) -> RedisResult<T> {
        let mut conn = self.conn.clone();
        let mut invocation = lua.script.prepare_invoke();
        for k in keys {
            invocation.key(*k);
        }
        for a in args {
            invocation.arg(a.as_slice());
        }
        match invocation.invoke_async(&mut conn).await {
            Err(err)
                if err.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
            {
                metrics::counter!("redis_script_eval_fallbacks_total").increment(1);
                redis::cmd("EVAL")
                    .arg(lua.code)
                    .arg(keys.len())
                    .arg(keys)
                    .arg(args)
                    .query_async(&mut conn)
                    .await
            }
            other => other,
        }
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
        let (code, value): (i64, String) = self
            .run(
                &self.reserve,
                &[&k.stock, &k.buyers, &k.pending, &k.res, &k.state],
                &[
                    arg(user_id),
                    arg(quantity),
                    arg(new_reservation_id),
                    arg(now_ms),
                ],
            )
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
        let mode = match mode {
            RefundMode::Undo => "undo",
            RefundMode::Return => "return",
        };
        let n: i64 = self
            .run(
                &self.refund,
                &[&k.stock, &k.buyers, &k.pending, &k.res, &k.refunded],
                &[arg(reservation_id), arg(user_id), arg(quantity), arg(mode)],
            )
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

    /// Builds the activity's Redis state with `available` units and the given
    /// buyers (user id, reservation id). Returns whether it was built (`Missing`
    /// leaves a loaded activity alone).
    pub async fn preload(
        &self,
        activity_id: &str,
        available: i64,
        paused: bool,
        buyers: &[(String, String)],
        mode: PreloadMode,
    ) -> RedisResult<bool> {
        let k = Keys::new(activity_id);
        let mut args = vec![
            arg(available),
            arg(if paused { "paused" } else { "open" }),
            arg(match mode {
                PreloadMode::Force => "force",
                PreloadMode::Missing => "missing",
            }),
        ];
        for (user, reservation) in buyers {
            args.push(arg(user));
            args.push(arg(reservation));
        }
        let built: i64 = self
            .run(
                &self.preload,
                &[
                    &k.stock,
                    &k.buyers,
                    &k.pending,
                    &k.res,
                    &k.refunded,
                    &k.state,
                ],
                &args,
            )
            .await?;
        Ok(built == 1)
    }

    /// Compares Redis's stock with what MySQL implies (see `audit.lua`); with
    /// `repair = Some((stock, pending))` it also sets the expected value, if Redis
    /// still holds exactly what the read saw.
    pub async fn audit(
        &self,
        activity_id: &str,
        total: i64,
        live_units: i64,
        owed: &[(String, u32)],
        repair: Option<(i64, i64)>,
    ) -> RedisResult<Audit> {
        let k = Keys::new(activity_id);
        let mut args = vec![arg(total), arg(live_units)];
        match repair {
            Some((stock, pending)) => args.extend([arg("repair"), arg(stock), arg(pending)]),
            None => args.extend([arg("read"), arg(0), arg(0)]),
        }
        for (reservation, units) in owed {
            args.push(arg(reservation));
            args.push(arg(*units));
        }
        let v: Vec<i64> = self
            .run(
                &self.audit,
                &[&k.stock, &k.pending, &k.res, &k.refunded],
                &args,
            )
            .await?;
        let at = |i: usize| v.get(i).copied().unwrap_or_default();
        Ok(Audit {
            loaded: at(0) == 1,
            stock: at(1),
            pending_units: at(2),
            owed_units: at(3),
            expected: at(4),
            repaired: at(5) == 1,
        })
    }

    /// Pending reservations older than `before_ms`: (reservation id, user id,
    /// units). Reservations whose details are gone are dropped from the set.
    pub async fn expired_pending(
        &self,
        activity_id: &str,
        before_ms: i64,
        limit: usize,
    ) -> RedisResult<Vec<(String, String, u32)>> {
        let k = Keys::new(activity_id);
        let mut conn = self.conn.clone();
        let ids: Vec<String> = redis::cmd("ZRANGEBYSCORE")
            .arg(&k.pending)
            .arg("-inf")
            .arg(before_ms)
            .arg("LIMIT")
            .arg(0)
            .arg(limit)
            .query_async(&mut conn)
            .await?;
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let details: Vec<Option<String>> = redis::cmd("HMGET")
            .arg(&k.res)
            .arg(&ids)
            .query_async(&mut conn)
            .await?;
        let mut out = Vec::with_capacity(ids.len());
        let mut junk = Vec::new();
        for (id, detail) in ids.into_iter().zip(details) {
            let parsed = detail.as_deref().and_then(|d| {
                let (user, units) = d.split_once('|')?;
                Some((user.to_owned(), units.parse::<u32>().ok()?))
            });
            match parsed {
                Some((user, units)) => out.push((id, user, units)),
                None => junk.push(id),
            }
        }
        if !junk.is_empty() {
            let _: () = conn.zrem(&k.pending, &junk).await?;
        }
        Ok(out)
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
