//! Read-only views of an activity's Redis state.

use redis::{AsyncCommands, RedisResult};

use super::keys::{home_shard, Keys};
use super::store::StockStore;

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

impl StockStore {
    /// Entries of `a`'s waiting-room journal not yet copied to MySQL.
    pub async fn room_journal_len(&self, a: &crate::activity::Activity) -> RedisResult<u64> {
        let keys = super::keys::RoomKeys::new(&a.id, a.stock_shards);
        let mut conn = self.conn.clone();
        conn.llen(&keys.journal).await
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
}
