//! Redis side of the sale: the keys of one activity and the Lua scripts that change
//! them atomically.
//!
//! Every key of an activity carries the hash tag `{<activity_id>}` (or, for an
//! activity split over stock shards, one of `{<activity_id>#<k>}`: see `keys`), so
//! on Redis Cluster the keys a script touches share one slot. Scripts are sent by
//! their SHA, with their code as the fallback (`script`), so a flushed script
//! cache costs one extra round trip, never a failed request.
//!
//! Layout: one concern a file, each adding its methods to [`StockStore`] (`store`).
//! - `conn`, `keys`, `script`: the Redis plumbing (connections, key names,
//!   running a script), shared with the waiting room;
//! - `reserve`: reserving, with units borrowed between shards; `loans`: the
//!   loans a borrower left half done;
//! - `gate`: the sold-out gate's memory, `filter`: the buyers' Bloom filter it
//!   reads, `sold_out`: finding and reopening sold-out sales; `dry`: the dry-sibling cache;
//! - `barrier`: the replica barrier;
//! - `pending`: reservations awaiting MySQL's decision; `refund`: units going
//!   back;
//! - `preload`: building from MySQL; `snapshot`: read-only views; `audit`: Redis
//!   against MySQL, and the repair;
//! - `views`: reservation-status polls answered without MySQL.

mod audit;
mod barrier;
mod conn;
mod dry;
mod filter;
mod gate;
mod keys;
mod loans;
mod pending;
mod preload;
mod refund;
mod reserve;
mod script;
mod snapshot;
mod sold_out;
mod store;
mod views;

pub use audit::{Audit, ShardAudit};
pub use barrier::Replication;
pub use conn::{Family, RedisConn, Topology};
pub use dry::DRY_SIBLING_TTL;
pub use gate::SOLD_OUT_RECHECK;
pub use keys::{
    deal, home_shard, is_valid_reservation_id, new_reservation_id, shard_of, Keys, RoomKeys,
};
pub use loans::Loan;
pub use pending::{Fate, FateChange, PendingReservation};
pub use preload::{PreloadMode, Preloaded};
pub use refund::{RefundMode, RefundOutcome};
pub use reserve::ReserveOutcome;
pub(crate) use script::{arg, invoke, Lua};
pub use snapshot::StockSnapshot;
pub use store::StockStore;
pub use views::{Polled, ViewChange};
