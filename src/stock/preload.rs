//! Building an activity's Redis state from MySQL, and its open/paused switch.

use redis::RedisResult;

use super::keys::{deal, home_shard, shard_of, Keys};
use super::script::arg;
use super::store::StockStore;
use crate::activity::Build;

/// Which preload: see `preload.lua`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreloadMode {
    /// Replace whatever is there (the operator's preload).
    Force,
    /// Build only when the activity is not loaded (the automatic rebuild).
    Missing,
}

impl StockStore {
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
    ) -> RedisResult<Preloaded> {
        let units = deal(build.available, shards);
        let mut outcome = Preloaded::Built;
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
            let built = self
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
                        &k.filter,
                        &k.removed,
                    ],
                    &args,
                )
                .await?;
            match decode_preload(built) {
                Preloaded::Built => {}
                // The marker is on every shard: the first says it for all.
                Preloaded::Removed => return Ok(Preloaded::Removed),
                Preloaded::LeftAlone => outcome = Preloaded::LeftAlone,
            }
        }
        self.gate.open(activity_id);
        Ok(outcome)
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
}

/// How long the marker of a removed sale's state stays (`StockStore::remove`).
pub const REMOVED_MARKER: std::time::Duration = std::time::Duration::from_secs(86_400);

impl StockStore {
    /// Deletes every key of the activity: each stock shard's and its waiting
    /// room's, one `UNLINK` per hash tag (so one slot each on a Cluster), and
    /// leaves in their place a marker that keeps any build from writing them
    /// again (`preload.lua`) for `REMOVED_MARKER` (longer than any build takes).
    /// Returns how many keys there were. Nothing else recreates them: the
    /// scripts that a late message or a lapse runs find the stock key missing
    /// and write nothing.
    pub async fn remove(&self, activity_id: &str, shards: u8) -> RedisResult<u64> {
        let room = super::RoomKeys::new(activity_id, shards);
        let mut removed = 0;
        for k in Keys::all(activity_id, shards) {
            let mut keys: Vec<&str> = vec![
                &k.removed,
                &k.stock,
                &k.buyers,
                &k.pending,
                &k.res,
                &k.refunded,
                &k.state,
                &k.epoch,
                &k.barrier,
                &k.lent,
                &k.received,
                &k.restock,
                &k.filter,
                &k.views,
            ];
            if k.shard == 0 {
                keys.extend(room.all());
            }
            let n: u64 = self
                .run(&self.remove, &keys, &[arg(REMOVED_MARKER.as_secs())])
                .await?;
            removed += n;
        }
        Ok(removed)
    }
}

/// What a build of an activity's Redis state did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preloaded {
    /// Written, on every shard.
    Built,
    /// Left alone on some shard: `Missing` found it loaded, `Force` found it
    /// selling.
    LeftAlone,
    /// The sale's state was removed for good after its retention (its marker
    /// is there): nothing was written.
    Removed,
}

/// `preload.lua`'s 1 built, 0 left alone, -1 removed.
fn decode_preload(n: i64) -> Preloaded {
    match n {
        1 => Preloaded::Built,
        -1 => Preloaded::Removed,
        _ => Preloaded::LeftAlone,
    }
}
