//! Redis side of the sale: the keys of one activity and the Lua scripts that change
//! them atomically.
//!
//! Every key of an activity carries the hash tag `{<activity_id>}`, so on Redis
//! Cluster they share one slot and a script may touch them all. Scripts are sent with
//! EVALSHA; `redis::Script` loads them and retries once on NOSCRIPT, so a flushed
//! script cache costs one extra round trip, never a failed request.

mod conn;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

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
    pub epoch: String,
    pub barrier: String,
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
            epoch: format!("{base}:epoch"),
            barrier: format!("{base}:barrier"),
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

/// Where a pending reservation stands (see `fate.lua`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Fate {
    /// Reserved; its message may or may not be in the queue.
    Pending,
    /// Its message is in the queue and a `202` was (or is being) answered.
    Acknowledged,
    /// Being withdrawn: no `202` may be answered; MySQL decides.
    Withdrawing,
}

impl Fate {
    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "p" => Fate::Pending,
            "a" => Fate::Acknowledged,
            "w" => Fate::Withdrawing,
            _ => return None,
        })
    }
}

/// What moving a reservation to a fate did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FateChange {
    /// Done, or it was in that fate already.
    Done,
    /// It is in the other fate already (acknowledged vs withdrawing).
    Refused,
    /// No such pending reservation: decided already, or Redis lost it.
    Unknown,
}

/// A reservation pending in Redis: not yet confirmed by MySQL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingReservation {
    pub reservation_id: String,
    pub user_id: String,
    pub units: u32,
    pub fate: Fate,
}

/// Which refund: see `refund.lua`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefundMode {
    /// The reservation never reached the queue: return it only if still pending,
    /// and give the purchase right back.
    Undo,
    /// The order failed or was cancelled: return the units, keep the right spent.
    Return,
    /// It lost to another order of the same user: return the units only if it is
    /// still pending here, keep the right spent.
    Drop,
}

/// What the refund script did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefundOutcome {
    Returned {
        units: u32,
    },
    AlreadyRefunded,
    NothingToUndo,
    /// `Undo` refused: the reservation was acknowledged (a `202` was answered).
    Acknowledged,
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
    /// Which build from MySQL this state is (`None`: built before epochs).
    pub epoch: Option<u32>,
}

/// A reservation's details: "user|units|fate".
/// Details written before fates existed ("user|units") read as pending.
fn parse_detail(d: &str) -> Option<(String, u32, Fate)> {
    let (rest, fate) = match d.rsplit_once('|') {
        Some((rest, f)) if f.parse::<u32>().is_err() => (rest, Fate::parse(f)?),
        _ => (d, Fate::Pending),
    };
    let (user, units) = rest.split_once('|')?;
    Some((user.to_owned(), units.parse::<u32>().ok()?, fate))
}

/// What a (re)build writes into Redis, read from MySQL in one snapshot.
#[derive(Debug, Clone, Default)]
pub struct Build {
    /// Units MySQL still has for sale.
    pub available: i64,
    pub paused: bool,
    /// The build's number (MySQL's `redis_epoch`); Redis keeps it in `…:epoch`.
    pub epoch: u32,
    /// (user id, reservation id) of every user whose purchase right is spent.
    pub buyers: Vec<(String, String)>,
    /// Reservations of failed and cancelled orders: their units are in `available`.
    pub returned: Vec<String>,
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

/// Connections of their own for `WAIT`, which blocks the connection it is sent on
/// until the replicas catch up: on the shared connection, one lagging replica
/// would stall every request behind it. A write on one of these connections (a
/// counter bump) follows the reservation in the primary's one replication
/// stream, so replicas that acknowledged it hold the reservation too.
#[derive(Clone)]
struct ReplicaBarrier {
    conns: Arc<Vec<RedisConn>>,
    next: Arc<AtomicUsize>,
    replicas: u32,
    timeout_ms: u64,
}

#[derive(Clone)]
pub struct StockStore {
    conn: RedisConn,
    barrier: Option<ReplicaBarrier>,
    reserve: Lua,
    refund: Lua,
    preload: Lua,
    audit: Lua,
    fate: Lua,
    confirm: Lua,
    lower: Lua,
}

impl StockStore {
    pub fn new(conn: RedisConn) -> Self {
        StockStore {
            conn,
            barrier: None,
            reserve: Lua::new(include_str!("reserve.lua")),
            refund: Lua::new(include_str!("refund.lua")),
            preload: Lua::new(include_str!("preload.lua")),
            audit: Lua::new(include_str!("audit.lua")),
            fate: Lua::new(include_str!("fate.lua")),
            confirm: Lua::new(include_str!("confirm.lua")),
            lower: Lua::new(include_str!("lower.lua")),
        }
    }

    /// Makes `replicated` wait for `replicas` replicas, at most `timeout`, over
    /// `conns` (connections used for nothing else).
    pub fn with_replica_barrier(
        mut self,
        conns: Vec<RedisConn>,
        replicas: u32,
        timeout: std::time::Duration,
    ) -> Self {
        if replicas > 0 && !conns.is_empty() {
            self.barrier = Some(ReplicaBarrier {
                conns: Arc::new(conns),
                next: Arc::new(AtomicUsize::new(0)),
                replicas,
                timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
            });
        }
        self
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
            RefundMode::Drop => "drop",
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
            -2 => RefundOutcome::Acknowledged,
            -3 => RefundOutcome::NotLoaded,
            // The script returns the quantity it was given, which is at least 1.
            units => RefundOutcome::Returned {
                units: u32::try_from(units).unwrap_or(u32::MAX),
            },
        })
    }

    /// Clears the pending marks of orders MySQL now holds (reservation id, user id,
    /// units), so the reconciler sees only reservations still undecided, and adopts
    /// the orders this Redis state does not know (see `confirm.lua`). Returns how
    /// many were adopted: more than 0 means Redis had lost reservations.
    pub async fn confirm(
        &self,
        activity_id: &str,
        orders: &[(String, String, u32)],
    ) -> RedisResult<u64> {
        if orders.is_empty() {
            return Ok(0);
        }
        let k = Keys::new(activity_id);
        let mut args = Vec::with_capacity(orders.len() * 3);
        for (reservation, user, units) in orders {
            args.extend([arg(reservation), arg(user), arg(*units)]);
        }
        self.run(
            &self.confirm,
            &[&k.stock, &k.buyers, &k.pending, &k.res],
            &args,
        )
        .await
    }

    /// Drops pending marks without touching stock, buyers or refunds: for
    /// reservations MySQL decided as failed already (the reconciler's drift repair
    /// settles their units against MySQL's count).
    pub async fn release(&self, activity_id: &str, reservation_ids: &[String]) -> RedisResult<()> {
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

    /// Moves a pending reservation to `Acknowledged` (`ack = true`: a `202` is about
    /// to be answered) or `Withdrawing`; exactly one of the two can ever succeed.
    pub async fn set_fate(
        &self,
        activity_id: &str,
        reservation_id: &str,
        ack: bool,
    ) -> RedisResult<FateChange> {
        let k = Keys::new(activity_id);
        let n: i64 = self
            .run(
                &self.fate,
                &[&k.res],
                &[
                    arg(reservation_id),
                    arg(if ack { "ack" } else { "withdraw" }),
                ],
            )
            .await?;
        Ok(match n {
            1 => FateChange::Done,
            0 => FateChange::Refused,
            _ => FateChange::Unknown,
        })
    }

    /// MySQL refused the reservation for lack of units: drops it and lowers the
    /// stock to what MySQL still has (`available`), never raising it. Returns the
    /// units the stock was lowered by (`None`: done before).
    pub async fn lower(
        &self,
        activity_id: &str,
        reservation_id: &str,
        user_id: &str,
        available: i64,
    ) -> RedisResult<Option<i64>> {
        let k = Keys::new(activity_id);
        let n: i64 = self
            .run(
                &self.lower,
                &[&k.stock, &k.buyers, &k.pending, &k.res, &k.refunded],
                &[arg(reservation_id), arg(user_id), arg(available)],
            )
            .await?;
        Ok((n >= 0).then_some(n))
    }

    /// Whether the configured replicas hold every write made to the activity's
    /// primary so far (the caller's reservation among them): `true` at once when
    /// no replicas are required. A bump of `…:barrier` on a barrier connection,
    /// then `WAIT` on that same connection (on a Cluster, at the primary that owns
    /// the activity's slot).
    pub async fn replicated(&self, activity_id: &str) -> RedisResult<bool> {
        let Some(b) = &self.barrier else {
            return Ok(true);
        };
        let k = Keys::new(activity_id);
        let i = b.next.fetch_add(1, Ordering::Relaxed) % b.conns.len();
        let mut conn = b.conns[i].clone();
        let _: i64 = conn.incr(&k.barrier, 1).await?;
        let mut wait = redis::cmd("WAIT");
        wait.arg(b.replicas).arg(b.timeout_ms);
        let acked: u32 = conn.route_by_key(&wait, &k.barrier).await?;
        Ok(acked >= b.replicas)
    }

    /// Builds the activity's Redis state from a MySQL snapshot (see `preload.lua`).
    /// Returns whether it was built (`Missing` leaves a loaded activity alone).
    pub async fn preload(
        &self,
        activity_id: &str,
        build: &Build,
        mode: PreloadMode,
    ) -> RedisResult<bool> {
        let k = Keys::new(activity_id);
        let mut args = vec![
            arg(build.available),
            arg(if build.paused { "paused" } else { "open" }),
            arg(match mode {
                PreloadMode::Force => "force",
                PreloadMode::Missing => "missing",
            }),
            arg(build.epoch),
            arg(build.buyers.len()),
        ];
        for (user, reservation) in &build.buyers {
            args.push(arg(user));
            args.push(arg(reservation));
        }
        for reservation in &build.returned {
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
                    &k.epoch,
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

    /// Pending reservations older than `before_ms`, oldest first. Reservations
    /// whose details are gone are dropped from the set.
    pub async fn expired_pending(
        &self,
        activity_id: &str,
        before_ms: i64,
        limit: usize,
    ) -> RedisResult<Vec<PendingReservation>> {
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
            match detail.as_deref().and_then(parse_detail) {
                Some((user_id, units, fate)) => out.push(PendingReservation {
                    reservation_id: id,
                    user_id,
                    units,
                    fate,
                }),
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
        let (stock, state, pending, buyers, epoch): (
            Option<i64>,
            Option<String>,
            u64,
            u64,
            Option<u32>,
        ) = redis::pipe()
            .get(&k.stock)
            .get(&k.state)
            .zcard(&k.pending)
            .hlen(&k.buyers)
            .get(&k.epoch)
            .query_async(&mut conn)
            .await?;
        Ok(StockSnapshot {
            stock,
            state,
            pending,
            buyers,
            epoch,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservation_details() {
        assert_eq!(
            parse_detail("alice|2|a"),
            Some(("alice".into(), 2, Fate::Acknowledged))
        );
        assert_eq!(
            parse_detail("bob-1|1|w"),
            Some(("bob-1".into(), 1, Fate::Withdrawing))
        );
        // Written before fates existed.
        assert_eq!(
            parse_detail("carol|3"),
            Some(("carol".into(), 3, Fate::Pending))
        );
        assert_eq!(parse_detail("dave|x|p"), None);
        assert_eq!(parse_detail("erin|1|z"), None);
        assert_eq!(parse_detail("nobody"), None);
    }
}
