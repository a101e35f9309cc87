//! The sold-out gate's memory: sales this instance found sold out, answered
//! from memory until a unit comes back (`sold_out` finds and reopens them).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::filter::{BuyerFilter, UserHash};

/// How often an instance looks at the restock counts of the sales it keeps shut:
/// the bound on how long units that come back wait for buyers on that instance.
pub const SOLD_OUT_RECHECK: Duration = Duration::from_millis(50);

/// The sold-out gate: activities this instance found sold out, answered
/// `sold_out` from memory without a Redis call. Each is held with the restock
/// count of every shard as it was when found empty (read in the same atomic
/// step) and every shard's buyers' filter (`filter`): the buyers cannot change
/// until a count moves, and a user the filters do not rule out (every buyer,
/// and a few others) goes on to Redis, so a buyer asking again still gets
/// `already_reserved`. Every script that adds units bumps its shard's count
/// (`reserve.lua`), and `run_sold_out_gate` reopens a sale within
/// `SOLD_OUT_RECHECK` of any bump, or at once when a count cannot be read.
///
/// Finding a sale sold out reads its filters once per instance (one `GET` a
/// shard, a few bytes a unit sold, whatever the number of users), in the
/// background, never on a request's path: requests go on to Redis until the
/// gate is shut.
#[derive(Default)]
pub(super) struct SoldOutGate {
    state: Mutex<GateState>,
    /// How many readings of filters to shut a gate have ended, since start.
    pub(super) readings: AtomicUsize,
}

#[derive(Default)]
struct GateState {
    shut: HashMap<String, Arc<Shut>>,
    /// Activities whose filters are being read now, to shut their gate.
    closing: HashSet<String>,
}

pub(super) struct Shut {
    pub(super) restock: Vec<(String, i64)>,
    /// One filter a shard.
    pub(super) filters: Vec<BuyerFilter>,
}

impl Shut {
    /// Whether `user` is certainly none of the sale's buyers.
    fn rules_out(&self, user: UserHash) -> bool {
        !self.filters.iter().any(|f| f.may_hold(user))
    }
}

impl SoldOutGate {
    fn state(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether `user_id` is to be told `sold_out` from memory. The user's hash is
    /// taken only for a shut sale, outside the lock.
    pub(super) fn refuses(&self, activity_id: &str, user_id: &str) -> bool {
        let shut = self.state().shut.get(activity_id).cloned();
        shut.is_some_and(|s| s.rules_out(UserHash::of(user_id)))
    }

    /// Whether this call is the one to read `activity_id`'s filters: it is not
    /// shut already, and no one else is at it.
    pub(super) fn begin_closing(&self, activity_id: &str) -> bool {
        let mut state = self.state();
        if state.shut.contains_key(activity_id) {
            return false;
        }
        state.closing.insert(activity_id.to_owned())
    }

    /// Ends a reading: the gate shut with what it found, or left open.
    pub(super) fn end_closing(&self, activity_id: &str, found: Option<Shut>) {
        let mut state = self.state();
        state.closing.remove(activity_id);
        self.readings.fetch_add(1, Ordering::Relaxed);
        if let Some(shut) = found {
            state.shut.insert(activity_id.to_owned(), Arc::new(shut));
        }
    }

    pub(super) fn open(&self, activity_id: &str) {
        self.state().shut.remove(activity_id);
    }

    pub(super) fn snapshot(&self) -> Vec<(String, Vec<(String, i64)>)> {
        self.state()
            .shut
            .iter()
            .map(|(k, v)| (k.clone(), v.restock.clone()))
            .collect()
    }

    /// Bytes of filters held by shut gates.
    pub(super) fn filter_bytes(&self) -> usize {
        self.state()
            .shut
            .values()
            .flat_map(|s| s.filters.iter().map(BuyerFilter::bytes))
            .sum()
    }
}
