//! Redis side of the sale: the keys of one activity and the Lua scripts that change
//! them atomically.
//!
//! Every key of an activity carries the hash tag `{<activity_id>}` (or, for an
//! activity split over stock shards, one of `{<activity_id>#<k>}`: see `keys`), so
//! on Redis Cluster the keys a script touches share one slot. Scripts are sent with
//! EVALSHA; `redis::Script` loads them and retries once on NOSCRIPT, so a flushed
//! script cache costs one extra round trip, never a failed request.

mod conn;
mod keys;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::{AsyncCommands, RedisResult, Script};

use crate::activity::Build;

pub use conn::{Family, RedisConn};
pub use keys::{
    deal, home_shard, is_valid_reservation_id, new_reservation_id, shard_of, Keys, RoomKeys,
};

/// One script argument, encoded as Redis would.
pub(crate) fn arg<T: redis::ToRedisArgs>(value: T) -> Vec<u8> {
    value.to_redis_args().concat()
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

/// What `reserve.lua` answered on one shard.
enum ShardReserve {
    Done(ReserveOutcome),
    /// Fewer units left on this shard than asked for; its restock count then.
    Dry {
        left: i64,
        restock: i64,
    },
}

/// Which preload: see `preload.lua`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreloadMode {
    /// Replace whatever is there (the operator's preload).
    Force,
    /// Build only when the activity is not loaded (the automatic rebuild).
    Missing,
}

/// What `audit.lua` found, summed over the activity's shards.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub struct Audit {
    pub loaded: bool,
    pub stock: i64,
    pub pending_units: i64,
    pub owed_units: i64,
    pub expected: i64,
    pub repaired: bool,
    /// Units lent between shards and not yet received (split activities).
    pub in_transit: i64,
    /// Each shard's figures, as read (one entry when the activity is not split).
    #[serde(skip)]
    #[schema(ignore)]
    pub parts: Vec<ShardAudit>,
}

/// One shard's figures in an audit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShardAudit {
    pub loaded: bool,
    pub stock: i64,
    pub pending_units: i64,
    pub owed_units: i64,
    pub lent: i64,
    pub received: i64,
}

impl ShardAudit {
    /// The units this shard accounts for: no transfer between shards changes it.
    fn holds(&self) -> i64 {
        self.stock + self.pending_units + self.owed_units + self.lent - self.received
    }
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

/// Units one stock shard lent a sibling, as the lender recorded them (`lend.lua`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loan {
    pub lender: u8,
    pub to: u8,
    pub transfer: String,
    pub units: i64,
    pub lent_at_ms: i64,
    /// The lender's build when it lent: only that build may receive or close it.
    pub epoch: String,
    /// The record as read, so closing it can tell it is still the same loan.
    record: String,
}

impl Loan {
    /// A loan not yet marked done, from its record "units|to|ms|epoch". A record
    /// written before loans carried their epoch ("units|to|ms") takes the
    /// lender's epoch read with it.
    fn parse(lender: u8, transfer: String, record: String, lender_epoch: &str) -> Option<Self> {
        let fields: Vec<&str> = record.split('|').collect();
        let (units, to, at, epoch) = match fields.as_slice() {
            [units, to, at] => (units, to, at, lender_epoch),
            [units, to, at, epoch] if *epoch != "done" => (units, to, at, *epoch),
            _ => return None,
        };
        Some(Loan {
            lender,
            to: to.parse().ok()?,
            units: units.parse().ok()?,
            lent_at_ms: at.parse().ok()?,
            epoch: epoch.to_owned(),
            transfer,
            record,
        })
    }
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

/// One shard as `snapshot` reads it: stock, state, pending count, buyers count,
/// epoch, and the oldest pending reservation with its time.
type ShardFigures = (
    Option<i64>,
    Option<String>,
    u64,
    u64,
    Option<u32>,
    Vec<(String, f64)>,
);

/// A read-only view of an activity's Redis state, summed over its shards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StockSnapshot {
    /// `None` when the key is missing (not loaded) on any shard.
    pub stock: Option<i64>,
    /// "paused" when any shard is paused; `None` when missing on any shard.
    pub state: Option<String>,
    pub pending: u64,
    pub buyers: u64,
    /// Which build from MySQL this state is: the oldest over the shards (`None`:
    /// built before epochs).
    pub epoch: Option<u32>,
    /// Each shard's units left (`None`: not loaded), shard 0 first.
    pub shard_stock: Vec<Option<i64>>,
    /// When the oldest reservation still pending was made (ms), over every shard.
    pub oldest_pending_ms: Option<i64>,
}

impl StockSnapshot {
    /// Whether every shard holds the activity.
    pub fn loaded(&self) -> bool {
        self.stock.is_some() && self.state.is_some()
    }

    /// Whether some shards hold the activity and others lost it.
    pub fn partly_loaded(&self) -> bool {
        !self.loaded() && self.shard_stock.iter().any(Option::is_some)
    }
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

/// A Lua script: its SHA for EVALSHA, and its text for the fallback.
#[derive(Clone)]
/// A Lua script, called by its SHA with the code as the fallback (`invoke`).
pub(crate) struct Lua {
    script: Script,
    code: &'static str,
}

impl Lua {
    pub(crate) fn new(code: &'static str) -> Self {
        Lua {
            script: Script::new(code),
            code,
        }
    }
}

/// Runs a script by its SHA; on `NOSCRIPT` (a restarted or failed-over Redis)
/// sends its code once to that same node, which loads it again. (redis-rs's own
/// `Script::invoke_async` answers `NOSCRIPT` on a Cluster by loading the script on
/// every node, which fails while any node is down: during a failover.)
pub(crate) async fn invoke<T: redis::FromRedisValue>(
    conn: &RedisConn,
    lua: &Lua,
    keys: &[&str],
    args: &[Vec<u8>],
) -> RedisResult<T> {
    let mut conn = conn.clone();
    let by_sha = redis::cmd("EVALSHA")
        .arg(lua.script.get_hash())
        .arg(keys.len())
        .arg(keys)
        .arg(args)
        .query_async(&mut conn)
        .await;
    match by_sha {
        Err(err) if err.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            metrics::counter!("flashsale_redis_script_eval_fallbacks_total").increment(1);
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

/// How long a sibling shard found empty is not asked to lend again by this
/// instance. Once a split sale is sold out, a refused request then costs one call
/// (its home shard) instead of one per shard; a unit that comes back on a sibling
/// is seen by that sibling's own users at once and by everyone else within this.
pub const DRY_SIBLING_TTL: Duration = Duration::from_millis(50);

/// Sibling shards that had nothing to lend: when this instance saw it, and their
/// restock count then.
#[derive(Default)]
struct DrySiblings {
    seen: Mutex<HashMap<String, (Instant, i64)>>,
}

impl DrySiblings {
    /// The restock count of a sibling found empty within the TTL.
    fn recently(&self, stock_key: &str) -> Option<i64> {
        let seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        seen.get(stock_key)
            .filter(|(at, _)| at.elapsed() < DRY_SIBLING_TTL)
            .map(|(_, restock)| *restock)
    }

    fn mark(&self, stock_key: &str, dry: Option<i64>) {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        match dry {
            Some(restock) => {
                if seen.len() > 10_000 {
                    seen.retain(|_, (at, _)| at.elapsed() < DRY_SIBLING_TTL);
                }
                seen.insert(stock_key.to_owned(), (Instant::now(), restock));
            }
            None => {
                seen.remove(stock_key);
            }
        }
    }
}

/// How often an instance looks at the restock counts of the sales it keeps shut:
/// the bound on how long units that come back wait for buyers on that instance.
pub const SOLD_OUT_RECHECK: Duration = Duration::from_millis(50);

/// The sold-out gate: activities this instance found sold out, answered
/// `sold_out` from memory without a Redis call. Each is held with the restock
/// count of every shard as it was when found empty (read in the same atomic
/// step) and the ids of its buyers (they cannot change until a count moves, so
/// a buyer asking again still gets `already_reserved` from Redis). Every script
/// that adds units bumps its shard's count (`reserve.lua`), and
/// `run_sold_out_gate` reopens a sale within `SOLD_OUT_RECHECK` of any bump, or
/// at once when a count cannot be read.
///
/// Finding a sale sold out reads its buyers once per instance, in the
/// background and in batches (`HSCAN`), never on a request's path: requests go
/// on to Redis until the gate is shut.
#[derive(Default)]
struct SoldOutGate {
    state: Mutex<GateState>,
    /// How many times buyers were read to shut a gate, since start.
    readings: AtomicUsize,
}

#[derive(Default)]
struct GateState {
    shut: HashMap<String, Shut>,
    /// Activities whose buyers are being read now, to shut their gate.
    closing: std::collections::HashSet<String>,
    /// Activities with more buyers than a gate keeps: never gated (buyers only
    /// grow, so this does not change).
    too_large: std::collections::HashSet<String>,
}

struct Shut {
    restock: Vec<(String, i64)>,
    buyers: std::collections::HashSet<String>,
}

/// Most buyers a shut sale keeps in memory; a larger sale is not gated.
const GATE_MAX_BUYERS: usize = 1_000_000;
/// Buyers read per `HSCAN` call while shutting a gate.
const GATE_SCAN_BATCH: usize = 1_000;

impl SoldOutGate {
    fn state(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether `user_id` is to be told `sold_out` from memory.
    fn refuses(&self, activity_id: &str, user_id: &str) -> bool {
        self.state()
            .shut
            .get(activity_id)
            .is_some_and(|s| !s.buyers.contains(user_id))
    }

    /// Whether this call is the one to read `activity_id`'s buyers: it is not
    /// shut already, not too large to gate, and no one else is at it.
    fn begin_closing(&self, activity_id: &str) -> bool {
        let mut state = self.state();
        if state.shut.contains_key(activity_id) || state.too_large.contains(activity_id) {
            return false;
        }
        state.closing.insert(activity_id.to_owned())
    }

    /// Ends a reading: the gate shut with what it found, or left open.
    fn end_closing(&self, activity_id: &str, found: Option<Shut>, too_large: bool) {
        let mut state = self.state();
        state.closing.remove(activity_id);
        if too_large {
            state.too_large.insert(activity_id.to_owned());
        }
        if let Some(shut) = found {
            state.shut.insert(activity_id.to_owned(), shut);
        }
    }

    fn open(&self, activity_id: &str) {
        self.state().shut.remove(activity_id);
    }

    fn snapshot(&self) -> Vec<(String, Vec<(String, i64)>)> {
        self.state()
            .shut
            .iter()
            .map(|(k, v)| (k.clone(), v.restock.clone()))
            .collect()
    }
}

#[derive(Clone)]
pub struct StockStore {
    conn: RedisConn,
    dry: Arc<DrySiblings>,
    gate: Arc<SoldOutGate>,
    barrier: Option<ReplicaBarrier>,
    reserve: Lua,
    refund: Lua,
    preload: Lua,
    audit: Lua,
    fate: Lua,
    confirm: Lua,
    lower: Lua,
    lend: Lua,
    receive: Lua,
    loan_done: Lua,
}

impl StockStore {
    pub fn new(conn: RedisConn) -> Self {
        StockStore {
            conn,
            dry: Arc::default(),
            gate: Arc::default(),
            barrier: None,
            reserve: Lua::new(include_str!("reserve.lua")),
            refund: Lua::new(include_str!("refund.lua")),
            preload: Lua::new(include_str!("preload.lua")),
            audit: Lua::new(include_str!("audit.lua")),
            fate: Lua::new(include_str!("fate.lua")),
            confirm: Lua::new(include_str!("confirm.lua")),
            lower: Lua::new(include_str!("lower.lua")),
            lend: Lua::new(include_str!("lend.lua")),
            receive: Lua::new(include_str!("receive.lua")),
            loan_done: Lua::new(include_str!("loan_done.lua")),
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
        invoke(&self.conn, lua, keys, args).await
    }

    /// Reserves `quantity` units for a user, under a reservation id from
    /// `new_reservation_id` (which names the user's home shard). On the home
    /// shard, one atomic step: already bought → enough stock → decrement → record
    /// the buyer and a pending reservation. A split activity's home shard that
    /// runs dry borrows what it lacks from its siblings in turn (`lend.lua`) and
    /// receives it in the same step as the reservation; sold out only when no
    /// shard has the units.
    /// Whether this instance's sold-out gate answers `user_id` from memory: the
    /// sale was seen sold out, nothing came back since, and the user holds none of
    /// it (a buyer must hear `already_reserved`). Costs one lock and two lookups.
    pub fn sold_out_from_memory(&self, activity_id: &str, user_id: &str) -> bool {
        let refused = self.gate.refuses(activity_id, user_id);
        if refused {
            metrics::counter!("flashsale_sold_out_gate_answers_total").increment(1);
        }
        refused
    }

    /// How many times this instance read a sold-out sale's buyers to shut its
    /// gate: once per sell-out (and per reopening), however many requests
    /// found it sold out.
    pub fn sold_out_gate_readings(&self) -> usize {
        self.gate.readings.load(Ordering::Relaxed)
    }

    pub async fn reserve(
        &self,
        activity_id: &str,
        user_id: &str,
        quantity: u32,
        reservation_id: &str,
        now_ms: i64,
    ) -> RedisResult<ReserveOutcome> {
        if self.sold_out_from_memory(activity_id, user_id) {
            return Ok(ReserveOutcome::SoldOut);
        }
        self.reserve_past_gate(activity_id, user_id, quantity, reservation_id, now_ms)
            .await
    }

    /// [`reserve`](Self::reserve) without asking the sold-out gate first: for a
    /// user the waiting room just admitted, whose turn may come from units that
    /// came back before this instance's gate has seen them.
    pub async fn reserve_past_gate(
        &self,
        activity_id: &str,
        user_id: &str,
        quantity: u32,
        reservation_id: &str,
        now_ms: i64,
    ) -> RedisResult<ReserveOutcome> {
        let home = Keys::of_reservation(activity_id, reservation_id);
        let (_, shards) = shard_of(reservation_id);
        let reserve = |transfer: Option<(String, i64, String)>| {
            self.reserve_on(&home, user_id, quantity, reservation_id, now_ms, transfer)
        };
        // Each shard's restock count as it was when found without the units.
        let mut empty = Vec::with_capacity(usize::from(shards));
        let mut left = match reserve(None).await? {
            ShardReserve::Done(outcome) => return Ok(outcome),
            ShardReserve::Dry { left, restock } => {
                empty.push((home.restock.clone(), restock));
                left
            }
        };
        for step in 1..shards {
            let lender = Keys::shard(activity_id, shards, (home.shard + step) % shards);
            if let Some(restock) = self.dry.recently(&lender.stock) {
                empty.push((lender.restock.clone(), restock));
                continue;
            }
            let transfer = format!("{reservation_id}>{}", lender.shard);
            let need = i64::from(quantity) - left;
            let (lent, epoch, restock): (i64, String, i64) = self
                .run(
                    &self.lend,
                    &[&lender.stock, &lender.lent, &lender.epoch, &lender.restock],
                    &[arg(&transfer), arg(need), arg(home.shard), arg(now_ms)],
                )
                .await?;
            self.dry.mark(&lender.stock, (lent == 0).then_some(restock));
            match lent {
                -3 => return Ok(ReserveOutcome::NotLoaded),
                0 => {
                    empty.push((lender.restock.clone(), restock));
                    continue;
                }
                _ => {}
            }
            metrics::counter!("flashsale_stock_shard_transfers_total").increment(1);
            left = match reserve(Some((transfer, lent, epoch))).await? {
                ShardReserve::Done(outcome) => return Ok(outcome),
                ShardReserve::Dry { left, restock } => {
                    empty.retain(|(k, _)| *k != home.restock);
                    empty.push((home.restock.clone(), restock));
                    left
                }
            };
        }
        // Sold out for a single unit, every shard seen empty with its count (a
        // lender that just lent its last units left none): no request could be
        // served, so the sale is shut here until a count moves.
        if quantity == 1
            && empty.len() == usize::from(shards)
            && self.gate.begin_closing(activity_id)
        {
            let store = self.clone();
            let activity_id = activity_id.to_owned();
            tokio::spawn(async move {
                let (found, too_large) = match store.read_buyers(&activity_id, shards, empty).await
                {
                    Ok(read) => read,
                    Err(err) => {
                        tracing::debug!(%activity_id, error = %err, "the sold-out gate stays open");
                        (None, false)
                    }
                };
                store.gate.end_closing(&activity_id, found, too_large);
            });
        }
        Ok(ReserveOutcome::SoldOut)
    }

    /// Reads the buyers of a sale found sold out, a batch at a time: what to
    /// shut its gate with, unless a restock count moved meanwhile (a unit came
    /// back, and with it maybe a buyer the reading missed) or a shard's buyers
    /// number other than what was read (the scan spanned a failover); and
    /// whether the sale has too many buyers to gate at all.
    async fn read_buyers(
        &self,
        activity_id: &str,
        shards: u8,
        restock: Vec<(String, i64)>,
    ) -> RedisResult<(Option<Shut>, bool)> {
        self.gate.readings.fetch_add(1, Ordering::Relaxed);
        let mut conn = self.conn.clone();
        let keys = Keys::all(activity_id, shards);
        let mut total = 0;
        for k in &keys {
            total += conn.hlen::<_, usize>(&k.buyers).await?;
        }
        if total > GATE_MAX_BUYERS {
            return Ok((None, true));
        }
        let mut buyers = std::collections::HashSet::with_capacity(total);
        for k in &keys {
            let before = buyers.len();
            let mut cursor: u64 = 0;
            loop {
                let (next, batch): (u64, Vec<String>) = redis::cmd("HSCAN")
                    .arg(&k.buyers)
                    .arg(cursor)
                    .arg("COUNT")
                    .arg(GATE_SCAN_BATCH)
                    .query_async(&mut conn)
                    .await?;
                // Field, value, field, value…: the fields are the buyers.
                buyers.extend(batch.into_iter().step_by(2));
                if next == 0 {
                    break;
                }
                cursor = next;
            }
            if conn.hlen::<_, usize>(&k.buyers).await? != buyers.len() - before {
                return Ok((None, false));
            }
        }
        if !self.restock_unchanged(&restock).await {
            return Ok((None, false));
        }
        Ok((Some(Shut { restock, buyers }), false))
    }

    /// Reopens the sales this instance keeps shut once any of their shards'
    /// restock counts moved (or cannot be read), every `SOLD_OUT_RECHECK`,
    /// until `shutdown`.
    pub async fn run_sold_out_gate(self, shutdown: tokio_util::sync::CancellationToken) {
        let mut tick = tokio::time::interval(SOLD_OUT_RECHECK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            for (activity_id, seen) in self.gate.snapshot() {
                if !self.restock_unchanged(&seen).await {
                    self.gate.open(&activity_id);
                }
            }
        }
    }

    async fn restock_unchanged(&self, seen: &[(String, i64)]) -> bool {
        for (key, count) in seen {
            let mut conn = self.conn.clone();
            let now: RedisResult<Option<i64>> = conn.get(key).await;
            match now {
                Ok(now) if now.unwrap_or(0) == *count => {}
                _ => return false,
            }
        }
        true
    }

    async fn reserve_on(
        &self,
        k: &Keys,
        user_id: &str,
        quantity: u32,
        reservation_id: &str,
        now_ms: i64,
        transfer: Option<(String, i64, String)>,
    ) -> RedisResult<ShardReserve> {
        let mut args = vec![
            arg(user_id),
            arg(quantity),
            arg(reservation_id),
            arg(now_ms),
        ];
        if let Some((id, units, epoch)) = transfer {
            args.extend([arg(id), arg(units), arg(epoch)]);
        }
        let (code, value, restock): (i64, String, i64) = self
            .run(&self.reserve, &k.reserve_script_keys(), &args)
            .await?;
        Ok(ShardReserve::Done(match code {
            1 => ReserveOutcome::Reserved {
                reservation_id: value,
            },
            0 => ReserveOutcome::AlreadyReserved {
                reservation_id: value,
            },
            -1 => {
                return Ok(ShardReserve::Dry {
                    left: value.parse().unwrap_or(0),
                    restock,
                })
            }
            -4 => ReserveOutcome::Paused,
            _ => ReserveOutcome::NotLoaded,
        }))
    }

    /// Finishes the transfers between shards that their borrower left half done
    /// (lent more than `older_than_ms` ago and not marked done): receives each
    /// once on its borrower, then marks it done on its lender. Returns how many
    /// were received now.
    pub async fn finish_transfers(
        &self,
        activity_id: &str,
        shards: u8,
        older_than_ms: i64,
    ) -> RedisResult<u64> {
        let mut received = 0;
        for loan in self.open_loans(activity_id, shards, older_than_ms).await? {
            if let Some(now) = self.receive_loan(activity_id, shards, &loan).await? {
                received += u64::from(now);
                self.mark_loan_done(activity_id, shards, &loan).await?;
            }
        }
        Ok(received)
    }

    /// The loans between shards lent more than `older_than_ms` ago and not yet
    /// marked done, each as its lender recorded it.
    pub async fn open_loans(
        &self,
        activity_id: &str,
        shards: u8,
        older_than_ms: i64,
    ) -> RedisResult<Vec<Loan>> {
        let mut loans = Vec::new();
        if shards <= 1 {
            return Ok(loans);
        }
        for lender in Keys::all(activity_id, shards) {
            let mut conn = self.conn.clone();
            let (lent, epoch): (HashMap<String, String>, Option<String>) = redis::pipe()
                .hgetall(&lender.lent)
                .get(&lender.epoch)
                .query_async(&mut conn)
                .await?;
            let epoch = epoch.unwrap_or_default();
            for (transfer, record) in lent {
                let Some(loan) = Loan::parse(lender.shard, transfer, record, &epoch) else {
                    continue; // done, or not ours
                };
                if loan.lent_at_ms <= older_than_ms && loan.to < shards {
                    loans.push(loan);
                }
            }
        }
        Ok(loans)
    }

    /// Receives a loan on its borrower, once and only into the build it was lent
    /// from (`receive.lua`). `Some(true)` received now, `Some(false)` received
    /// before; `None` when it never will be (a rebuild wiped it, or the borrower
    /// is not loaded).
    pub async fn receive_loan(
        &self,
        activity_id: &str,
        shards: u8,
        loan: &Loan,
    ) -> RedisResult<Option<bool>> {
        let borrower = Keys::shard(activity_id, shards, loan.to);
        let n: i64 = self
            .run(
                &self.receive,
                &[
                    &borrower.stock,
                    &borrower.received,
                    &borrower.epoch,
                    &borrower.restock,
                ],
                &[arg(&loan.transfer), arg(loan.units), arg(&loan.epoch)],
            )
            .await?;
        if n == 1 {
            self.gate.open(activity_id);
            metrics::counter!("flashsale_stock_shard_transfers_finished_total").increment(1);
        }
        Ok((n >= 0).then_some(n == 1))
    }

    /// Marks a received loan done on its lender (`loan_done.lua`): only while the
    /// lender is still the build that lent it. Returns whether it was marked.
    pub async fn mark_loan_done(
        &self,
        activity_id: &str,
        shards: u8,
        loan: &Loan,
    ) -> RedisResult<bool> {
        let lender = Keys::shard(activity_id, shards, loan.lender);
        let n: i64 = self
            .run(
                &self.loan_done,
                &[&lender.lent, &lender.epoch],
                &[arg(&loan.transfer), arg(&loan.record), arg(&loan.epoch)],
            )
            .await?;
        Ok(n == 1)
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
        let k = Keys::of_reservation(activity_id, reservation_id);
        self.refund_on(&k, activity_id, reservation_id, user_id, quantity, mode)
            .await
    }

    /// Adds a top-up's units to the activity's first shard, once: `key` joins the
    /// returned units (as a refund would), so a second call, or one after a rebuild
    /// that counted it, adds nothing. `NotLoaded`: the next build reads MySQL, which
    /// has the units already.
    pub async fn top_up(
        &self,
        activity_id: &str,
        shards: u8,
        key: &str,
        units: u32,
    ) -> RedisResult<RefundOutcome> {
        let k = Keys::shard(activity_id, shards, 0);
        self.refund_on(&k, activity_id, key, "", units, RefundMode::Return)
            .await
    }

    /// `refund.lua` on one shard. Units that came back through this instance open
    /// its sold-out gate at once (the other instances' within `SOLD_OUT_RECHECK`).
    async fn refund_on(
        &self,
        k: &Keys,
        activity_id: &str,
        id: &str,
        user_id: &str,
        quantity: u32,
        mode: RefundMode,
    ) -> RedisResult<RefundOutcome> {
        let mode = match mode {
            RefundMode::Undo => "undo",
            RefundMode::Return => "return",
            RefundMode::Drop => "drop",
        };
        let n: i64 = self
            .run(
                &self.refund,
                &[
                    &k.stock,
                    &k.buyers,
                    &k.pending,
                    &k.res,
                    &k.refunded,
                    &k.restock,
                ],
                &[arg(id), arg(user_id), arg(quantity), arg(mode)],
            )
            .await?;
        let outcome = match n {
            0 => RefundOutcome::AlreadyRefunded,
            -1 => RefundOutcome::NothingToUndo,
            -2 => RefundOutcome::Acknowledged,
            -3 => RefundOutcome::NotLoaded,
            // The script returns the quantity it was given, which is at least 1.
            units => RefundOutcome::Returned {
                units: u32::try_from(units).unwrap_or(u32::MAX),
            },
        };
        if matches!(outcome, RefundOutcome::Returned { .. }) {
            self.gate.open(activity_id);
        }
        Ok(outcome)
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
        let mut adopted = 0;
        for (k, orders) in by_shard(activity_id, orders, |o| &o.0) {
            let mut args = Vec::with_capacity(orders.len() * 3);
            for (reservation, user, units) in orders {
                args.extend([arg(reservation), arg(user), arg(*units)]);
            }
            let n: u64 = self
                .run(
                    &self.confirm,
                    &[&k.stock, &k.buyers, &k.pending, &k.res],
                    &args,
                )
                .await?;
            adopted += n;
        }
        Ok(adopted)
    }

    /// Drops pending marks without touching stock, buyers or refunds: for
    /// reservations MySQL decided as failed already (the reconciler's drift repair
    /// settles their units against MySQL's count).
    pub async fn release(&self, activity_id: &str, reservation_ids: &[String]) -> RedisResult<()> {
        for (k, ids) in by_shard(activity_id, reservation_ids, |r| r) {
            let mut conn = self.conn.clone();
            let _: () = redis::pipe()
                .zrem(&k.pending, &ids)
                .ignore()
                .hdel(&k.res, &ids)
                .ignore()
                .query_async(&mut conn)
                .await?;
        }
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
        let k = Keys::of_reservation(activity_id, reservation_id);
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
    /// units the stock was lowered by (`None`: done before). `owed`: the units
    /// MySQL counts as available and Redis has yet to get back (reservation or
    /// top-up id, units; see `OrderRepo::owed_to_redis`), read after `available`;
    /// they are left room for, so their refunds do not lift Redis above MySQL.
    /// For a split activity the units its other shards account for are read
    /// first and left to them.
    pub async fn lower(
        &self,
        activity_id: &str,
        reservation_id: &str,
        user_id: &str,
        available: i64,
        owed: &[(String, u32)],
    ) -> RedisResult<Option<i64>> {
        let k = Keys::of_reservation(activity_id, reservation_id);
        let (_, shards) = shard_of(reservation_id);
        let mut others = 0;
        for sibling in Keys::all(activity_id, shards) {
            if sibling.shard != k.shard {
                let part = self
                    .audit_shard(&sibling, 0, &owed_on(owed, sibling.shard), None)
                    .await?;
                others += part.stock.max(0) + part.holds() - part.stock;
            }
        }
        let mut args = vec![
            arg(reservation_id),
            arg(user_id),
            arg(available),
            arg(others),
        ];
        for (id, units) in owed_on(owed, k.shard) {
            args.push(arg(id));
            args.push(arg(units));
        }
        let n: i64 = self
            .run(
                &self.lower,
                &[
                    &k.stock,
                    &k.buyers,
                    &k.pending,
                    &k.res,
                    &k.refunded,
                    &k.lent,
                    &k.received,
                ],
                &args,
            )
            .await?;
        Ok((n >= 0).then_some(n))
    }

    /// Whether the configured replicas hold every write made to the reservation's
    /// primary so far (the reservation among them): `true` at once when no
    /// replicas are required. A bump of `…:barrier` on a barrier connection, then
    /// `WAIT` on that same connection (on a Cluster, at the primary that owns the
    /// slot of the reservation's shard).
    pub async fn replicated(
        &self,
        activity_id: &str,
        user_id: &str,
        reservation_id: &str,
    ) -> RedisResult<bool> {
        let Some(b) = &self.barrier else {
            return Ok(true);
        };
        let k = Keys::of_reservation(activity_id, reservation_id);
        let i = b.next.fetch_add(1, Ordering::Relaxed) % b.conns.len();
        let mut conn = b.conns[i].clone();
        // One pipeline: the check, the bump and the `WAIT` reach the same node,
        // the primary that owns the barrier's slot (a `WAIT` routed on its own
        // could land on another node during a failover and count that node's
        // replicas). The barrier's connection may know a newer primary than the
        // one the reservation was written on: only a node that holds the user's
        // purchase right under this reservation can vouch for it (the right
        // stays once the order is written, unlike the reservation's details).
        let (holder, _, acked): (Option<String>, i64, u32) = redis::pipe()
            .hget(&k.buyers, user_id)
            .incr(&k.barrier, 1)
            .cmd("WAIT")
            .arg(b.replicas)
            .arg(b.timeout_ms)
            .query_async(&mut conn)
            .await?;
        Ok(holder.as_deref() == Some(reservation_id) && acked >= b.replicas)
    }

    /// Builds the activity's Redis state from a MySQL snapshot (see `preload.lua`):
    /// a split activity's units are dealt evenly over its shards, each buyer to
    /// their home shard. Returns whether every shard was built (`Missing` leaves a
    /// loaded shard alone; `Force` one that is selling).
    pub async fn preload(
        &self,
        activity_id: &str,
        shards: u8,
        build: &Build,
        mode: PreloadMode,
    ) -> RedisResult<bool> {
        let units = deal(build.available, shards);
        let mut all_built = true;
        for (k, available) in Keys::all(activity_id, shards).into_iter().zip(units) {
            let buyers: Vec<_> = build
                .buyers
                .iter()
                .filter(|(user, _)| home_shard(user, shards) == k.shard)
                .collect();
            let mut args = vec![
                arg(available),
                arg(if build.paused { "paused" } else { "open" }),
                arg(match mode {
                    PreloadMode::Force => "force",
                    PreloadMode::Missing => "missing",
                }),
                arg(build.epoch),
                arg(buyers.len()),
            ];
            for (user, reservation) in buyers {
                args.push(arg(user));
                args.push(arg(reservation));
            }
            for reservation in &build.returned {
                if shards <= 1 || shard_of(reservation).0 == k.shard {
                    args.push(arg(reservation));
                }
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
                        &k.lent,
                        &k.received,
                        &k.restock,
                    ],
                    &args,
                )
                .await?;
            all_built &= built == 1;
        }
        self.gate.open(activity_id);
        Ok(all_built)
    }

    async fn audit_shard(
        &self,
        k: &Keys,
        expected_total: i64,
        owed: &[(String, u32)],
        repair: Option<&ShardAudit>,
    ) -> RedisResult<ShardAudit> {
        let mut args = vec![arg(expected_total), arg(0)];
        match repair {
            Some(seen) => args.extend([arg("repair"), arg(seen.stock), arg(seen.pending_units)]),
            None => args.extend([arg("read"), arg(0), arg(0)]),
        }
        for (reservation, units) in owed {
            args.push(arg(reservation));
            args.push(arg(*units));
        }
        let v: Vec<i64> = self
            .run(
                &self.audit,
                &[
                    &k.stock,
                    &k.pending,
                    &k.res,
                    &k.refunded,
                    &k.lent,
                    &k.received,
                    &k.restock,
                ],
                &args,
            )
            .await?;
        let at = |i: usize| v.get(i).copied().unwrap_or_default();
        Ok(ShardAudit {
            loaded: at(0) == 1,
            stock: at(1),
            pending_units: at(2),
            owed_units: at(3),
            lent: at(6),
            received: at(7),
        })
        .map(|part| {
            if repair.is_some() && at(5) != 1 {
                // Not repaired: report it as a shard that changed meanwhile.
                ShardAudit {
                    loaded: false,
                    ..part
                }
            } else {
                part
            }
        })
    }

    /// Compares Redis's stock with what MySQL implies (see `audit.lua`): MySQL's
    /// `total` units minus `live_units` in live orders must all be in Redis, for
    /// sale, pending, owed back (`owed`: failed or cancelled orders' reservations
    /// and units) or between shards.
    pub async fn audit(
        &self,
        activity_id: &str,
        shards: u8,
        total: i64,
        live_units: i64,
        owed: &[(String, u32)],
    ) -> RedisResult<Audit> {
        let mut audit = Audit {
            loaded: true,
            ..Audit::default()
        };
        for k in Keys::all(activity_id, shards) {
            let owed = owed_on(owed, k.shard);
            let part = self.audit_shard(&k, 0, &owed, None).await?;
            audit.loaded &= part.loaded;
            audit.stock += part.stock;
            audit.pending_units += part.pending_units;
            audit.owed_units += part.owed_units;
            audit.in_transit += part.lent - part.received;
            audit.parts.push(part);
        }
        audit.expected =
            total - live_units - audit.pending_units - audit.owed_units - audit.in_transit;
        Ok(audit)
    }

    /// Sets the stock to what MySQL implies, given what `audit` read (`seen`):
    /// on one shard (the one with the most units when lowering), only if that
    /// shard still holds exactly what the read saw (compare-and-set). Returns the
    /// audit with `repaired` set.
    pub async fn repair(
        &self,
        activity_id: &str,
        shards: u8,
        total: i64,
        live_units: i64,
        owed: &[(String, u32)],
        seen: &Audit,
    ) -> RedisResult<Audit> {
        let mut done = seen.clone();
        let drift = seen.stock - seen.expected;
        let target = if drift > 0 {
            seen.parts
                .iter()
                .enumerate()
                .max_by_key(|(_, p)| p.stock)
                .map_or(0, |(i, _)| i)
        } else {
            0
        };
        let (Some(part), Ok(shard)) = (seen.parts.get(target), u8::try_from(target)) else {
            return Ok(done);
        };
        let others: i64 = seen
            .parts
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != target)
            .map(|(_, p)| p.holds())
            .sum();
        let k = Keys::shard(activity_id, shards, shard);
        let owed = owed_on(owed, k.shard);
        let after = self
            .audit_shard(&k, total - live_units - others, &owed, Some(part))
            .await?;
        done.repaired = after.loaded;
        if done.repaired {
            self.gate.open(activity_id);
        }
        Ok(done)
    }

    /// Pending reservations older than `before_ms`, oldest first on each shard
    /// (at most `limit` a shard). Reservations whose details are gone are dropped
    /// from the set.
    pub async fn expired_pending(
        &self,
        activity_id: &str,
        shards: u8,
        before_ms: i64,
        limit: usize,
    ) -> RedisResult<Vec<PendingReservation>> {
        let mut out = Vec::new();
        for k in Keys::all(activity_id, shards) {
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
                continue;
            }
            let details: Vec<Option<String>> = redis::cmd("HMGET")
                .arg(&k.res)
                .arg(&ids)
                .query_async(&mut conn)
                .await?;
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
        }
        Ok(out)
    }

    /// Sets the live open/paused switch on every shard that holds the activity.
    /// Returns whether every shard did.
    pub async fn set_paused(
        &self,
        activity_id: &str,
        shards: u8,
        paused: bool,
    ) -> RedisResult<bool> {
        let mut all = true;
        for k in Keys::all(activity_id, shards) {
            let mut conn = self.conn.clone();
            let set: Option<String> = redis::cmd("SET")
                .arg(&k.state)
                .arg(if paused { "paused" } else { "open" })
                .arg("XX")
                .query_async(&mut conn)
                .await?;
            all &= set.is_some();
        }
        Ok(all)
    }

    /// Units Redis may still hand out; `None` when not loaded.
    pub async fn stock_left(&self, activity_id: &str, shards: u8) -> RedisResult<Option<i64>> {
        Ok(self.snapshot(activity_id, shards).await?.stock)
    }

    pub async fn snapshot(&self, activity_id: &str, shards: u8) -> RedisResult<StockSnapshot> {
        let mut snap = StockSnapshot {
            stock: Some(0),
            state: Some("open".into()),
            pending: 0,
            buyers: 0,
            epoch: None,
            shard_stock: Vec::new(),
            oldest_pending_ms: None,
        };
        for (i, k) in Keys::all(activity_id, shards).into_iter().enumerate() {
            let mut conn = self.conn.clone();
            // One slot, so one pipeline works on Cluster too.
            let (stock, state, pending, buyers, epoch, oldest): ShardFigures = redis::pipe()
                .get(&k.stock)
                .get(&k.state)
                .zcard(&k.pending)
                .hlen(&k.buyers)
                .get(&k.epoch)
                .zrange_withscores(&k.pending, 0, 0)
                .query_async(&mut conn)
                .await?;
            if let Some((_, score)) = oldest.first() {
                let ms = *score as i64;
                snap.oldest_pending_ms = Some(snap.oldest_pending_ms.map_or(ms, |o| o.min(ms)));
            }
            snap.stock = snap.stock.zip(stock).map(|(a, b)| a + b);
            snap.state = match (snap.state, state) {
                (Some(a), Some(b)) if a == "paused" || b == "paused" => Some("paused".into()),
                (Some(_), Some(b)) => Some(b),
                _ => None,
            };
            snap.pending += pending;
            snap.buyers += buyers;
            snap.epoch = if i == 0 {
                epoch
            } else {
                snap.epoch.zip(epoch).map(|(a, b)| a.min(b))
            };
            snap.shard_stock.push(stock);
        }
        Ok(snap)
    }

    /// The reservation id this user holds in Redis, if any (on their home shard).
    pub async fn reservation_of(
        &self,
        activity_id: &str,
        shards: u8,
        user_id: &str,
    ) -> RedisResult<Option<String>> {
        let k = Keys::shard(activity_id, shards, home_shard(user_id, shards));
        let mut conn = self.conn.clone();
        conn.hget(&k.buyers, user_id).await
    }

    pub async fn ping(&self) -> RedisResult<()> {
        let mut conn = self.conn.clone();
        let _: String = redis::cmd("PING").query_async(&mut conn).await?;
        Ok(())
    }
}

/// The owed reservations (id, units) that live on shard `k`.
fn owed_on(owed: &[(String, u32)], k: u8) -> Vec<(String, u32)> {
    owed.iter()
        .filter(|(r, _)| shard_of(r).0 == k)
        .cloned()
        .collect()
}

/// Groups items by the shard of the reservation id `rid` reads from each, in
/// the order the shards first appear.
fn by_shard<'a, T>(
    activity_id: &str,
    items: &'a [T],
    rid: impl Fn(&'a T) -> &'a String,
) -> Vec<(Keys, Vec<&'a T>)> {
    let mut groups: Vec<(Keys, Vec<&'a T>)> = Vec::new();
    for item in items {
        let k = Keys::of_reservation(activity_id, rid(item));
        match groups.iter_mut().find(|(g, _)| g.stock == k.stock) {
            Some((_, group)) => group.push(item),
            None => groups.push((k, vec![item])),
        }
    }
    groups
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

    #[test]
    fn loan_records() {
        let loan = |r: &str| Loan::parse(0, "t>0".into(), r.into(), "7");
        let l = loan("2|1|1000|5").expect("a loan");
        assert_eq!(
            (l.units, l.to, l.lent_at_ms, l.epoch.as_str()),
            (2, 1, 1000, "5")
        );
        // Recorded before loans carried their epoch: the lender's.
        assert_eq!(loan("2|1|1000").expect("a loan").epoch, "7");
        assert_eq!(loan("2|1|1000|done"), None);
        assert_eq!(loan("2|1|1000|5|done"), None);
        assert_eq!(loan("x|1|1000|5"), None);
    }
}
