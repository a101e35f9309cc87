//! The dry-sibling cache: sibling shards of a split sale found with nothing to
//! lend, so a sold-out split sale costs one call a request, not one per shard.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a sibling shard found empty is not asked to lend again by this
/// instance. Once a split sale is sold out, a refused request then costs one call
/// (its home shard) instead of one per shard; a unit that comes back on a sibling
/// is seen by that sibling's own users at once and by everyone else within this.
pub const DRY_SIBLING_TTL: Duration = Duration::from_millis(50);

/// Sibling shards that had nothing to lend: when this instance saw it, and their
/// restock count then.
#[derive(Default)]
pub(super) struct DrySiblings {
    seen: Mutex<HashMap<String, (Instant, i64)>>,
}

impl DrySiblings {
    /// The restock count of a sibling found empty within the TTL.
    pub(super) fn recently(&self, stock_key: &str) -> Option<i64> {
        let seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        seen.get(stock_key)
            .filter(|(at, _)| at.elapsed() < DRY_SIBLING_TTL)
            .map(|(_, restock)| *restock)
    }

    pub(super) fn mark(&self, stock_key: &str, dry: Option<i64>) {
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
