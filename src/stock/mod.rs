//! Redis side of the sale: the keys of one activity and the Lua scripts that change
//! them atomically.
//!
//! Every key of an activity carries the hash tag `{<activity_id>}` (or, for an
//! activity split over stock shards, one of `{<activity_id>#<k>}`: see `keys`), so
//! on Redis Cluster the keys a script touches share one slot. Scripts are sent by
//! their SHA, with their code as the fallback (`script`), so a flushed script
//! cache costs one extra round trip, never a failed request.
//!
//! Layout: one concern a file, each adding its methods to [`StockStore`].
//! - `conn`, `keys`, `script`: the Redis plumbing (connections, key names,
//!   running a script), shared with the waiting room;
//! - `reserve`: reserving, with units borrowed between shards; `loans`: the
//!   loans a borrower left half done;
//! - `gate`: the sold-out gate; `dry`: the dry-sibling cache;
//! - `barrier`: the replica barrier;
//! - `pending`: reservations awaiting MySQL's decision; `refund`: units going
//!   back;
//! - `preload`: building from MySQL; `snapshot`: read-only views; `audit`: Redis
//!   against MySQL, and the repair.

mod audit;
mod barrier;
mod conn;
mod dry;
mod gate;
mod keys;
mod loans;
mod pending;
mod preload;
mod refund;
mod reserve;
mod script;
mod snapshot;

use std::sync::Arc;

use redis::RedisResult;

use crate::activity::Build;

pub use audit::{Audit, ShardAudit};
pub use conn::{Family, RedisConn};
pub use dry::DRY_SIBLING_TTL;
pub use gate::SOLD_OUT_RECHECK;
pub use keys::{
    deal, home_shard, is_valid_reservation_id, new_reservation_id, shard_of, Keys, RoomKeys,
};
pub use loans::Loan;
pub use pending::{Fate, FateChange, PendingReservation};
pub use preload::PreloadMode;
pub use refund::{RefundMode, RefundOutcome};
pub use reserve::ReserveOutcome;
pub(crate) use script::{arg, invoke, Lua};
pub use snapshot::StockSnapshot;

use barrier::ReplicaBarrier;
use dry::DrySiblings;
use gate::SoldOutGate;

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

    pub fn connection(&self) -> RedisConn {
        self.conn.clone()
    }

    /// Runs one of the stock's scripts on the shared connection (see [`invoke`]).
    async fn run<T: redis::FromRedisValue>(
        &self,
        lua: &Lua,
        keys: &[&str],
        args: &[Vec<u8>],
    ) -> RedisResult<T> {
        invoke(&self.conn, lua, keys, args).await
    }

    pub async fn ping(&self) -> RedisResult<()> {
        let mut conn = self.conn.clone();
        let _: String = redis::cmd("PING").query_async(&mut conn).await?;
        Ok(())
    }
}
