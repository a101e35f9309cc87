//! Finding a sale sold out and reopening it: the store's side of the sold-out
//! gate (`gate`), which reads the buyers once in the background and watches the
//! restock counts.

use std::collections::HashSet;
use std::sync::atomic::Ordering;

use redis::{AsyncCommands, RedisResult};

use super::gate::{Shut, GATE_MAX_BUYERS, GATE_SCAN_BATCH, SOLD_OUT_RECHECK};
use super::keys::Keys;
use super::store::StockStore;

impl StockStore {
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

    /// Shuts the gate of a sale found sold out (`restock`: each shard's restock
    /// count as found empty), in the background, unless it is shut already or
    /// another call is at it.
    pub(super) fn shut_gate(&self, activity_id: &str, shards: u8, restock: Vec<(String, i64)>) {
        if !self.gate.begin_closing(activity_id) {
            return;
        }
        let store = self.clone();
        let activity_id = activity_id.to_owned();
        tokio::spawn(async move {
            let (found, too_large) = match store.read_buyers(&activity_id, shards, restock).await {
                Ok(read) => read,
                Err(err) => {
                    tracing::debug!(%activity_id, error = %err, "the sold-out gate stays open");
                    (None, false)
                }
            };
            store.gate.end_closing(&activity_id, found, too_large);
        });
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
        let mut buyers = HashSet::with_capacity(total);
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
}
