//! Finding a sale sold out and reopening it: the store's side of the sold-out
//! gate (`gate`), which reads the buyers' filters once in the background and
//! watches the restock counts.

use std::sync::atomic::Ordering;

use redis::{AsyncCommands, RedisResult};

use super::filter::BuyerFilter;
use super::gate::{Reading, Shut, SOLD_OUT_RECHECK};
use super::keys::Keys;
use super::store::StockStore;

impl StockStore {
    /// Whether this instance's sold-out gate answers `user_id` from memory: the
    /// sale was seen sold out, nothing came back since, and the buyers' filters
    /// rule the user out (a buyer must hear `already_reserved`). Costs one lock,
    /// one lookup and, for a shut sale, one SHA-1 of the user id.
    pub fn sold_out_from_memory(&self, activity_id: &str, user_id: &str) -> bool {
        let refused = self.gate.refuses(activity_id, user_id);
        if refused {
            metrics::counter!("flashsale_sold_out_gate_answers_total").increment(1);
        }
        refused
    }

    /// How many times this instance read a sold-out sale's filters to shut its
    /// gate (readings ended, shut or not): once per sell-out (and per
    /// reopening), however many requests found it sold out.
    pub fn sold_out_gate_readings(&self) -> usize {
        self.gate.readings.load(Ordering::Relaxed)
    }

    /// How many readings of a sold-out sale's filters this instance has begun
    /// (counted when a request finds the sale sold out, before its answer).
    pub fn sold_out_gate_readings_begun(&self) -> usize {
        self.gate.begun.load(Ordering::Relaxed)
    }

    /// Bytes of buyers' filters this instance holds for the sales it keeps shut.
    pub fn sold_out_gate_bytes(&self) -> usize {
        self.gate.filter_bytes()
    }

    /// Shuts the gate of a sale found sold out (`restock`: each shard's restock
    /// count as found empty), in the background, unless it is shut already,
    /// another call is at it, or its filters were found untrustworthy at these
    /// very counts.
    pub(super) fn shut_gate(&self, activity_id: &str, shards: u8, mut restock: Vec<(String, i64)>) {
        restock.sort_unstable();
        let Some(generation) = self.gate.begin_closing(activity_id, &restock) else {
            return;
        };
        let store = self.clone();
        let activity_id = activity_id.to_owned();
        tokio::spawn(async move {
            let found = match store.read_filters(&activity_id, shards, restock).await {
                Ok(found) => found,
                Err(err) => {
                    tracing::debug!(%activity_id, error = %err, "the sold-out gate stays open");
                    Reading::Open
                }
            };
            store.gate.end_closing(&activity_id, generation, found);
        });
    }

    /// Reads the buyers' filter of every shard of a sale found sold out (one
    /// `filter_read.lua` each): what to shut its gate with, unless a shard has
    /// no filter to trust (a sale loaded before filters were kept, a filter
    /// recreated without its header, a buyer recorded without its bits by an
    /// older version: the script reads only the header then) or a restock
    /// count moved meanwhile (a unit came back, a buyer was adopted or the sale
    /// rebuilt: a buyer the filters read may lack).
    ///
    /// Why no buyer is missed: a buyer is recorded only with a unit in the
    /// shard's stock (`reserve.lua`), by a build (`preload.lua`) or by an
    /// adoption (`confirm.lua`); the counts were read with every shard empty, a
    /// unit added since, a build and an adoption all bump them, and each of
    /// these writes the buyer's filter bits in the same atomic step as the
    /// buyer. So counts unchanged after the reading mean the filters read hold
    /// every buyer there is.
    async fn read_filters(
        &self,
        activity_id: &str,
        shards: u8,
        restock: Vec<(String, i64)>,
    ) -> RedisResult<Reading> {
        let mut filters = Vec::with_capacity(usize::from(shards.max(1)));
        for k in Keys::all(activity_id, shards) {
            let (trusted, bytes): (i64, Vec<u8>) = self
                .run(&self.filter_read, &[&k.filter, &k.buyers], &[])
                .await?;
            match BuyerFilter::read((trusted == 1).then_some(bytes)) {
                Some(f) => filters.push(f),
                None => return Ok(Reading::Ungateable(restock)),
            }
        }
        if !self.restock_unchanged(&restock).await {
            return Ok(Reading::Open);
        }
        Ok(Reading::Shut(Shut { restock, filters }))
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
}
