//! The sold-out gate's memory: sales this instance found sold out, answered
//! from memory until a unit comes back (`sold_out` finds and reopens them).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicUsize;
use std::sync::Mutex;
use std::time::Duration;

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
pub(super) struct SoldOutGate {
    state: Mutex<GateState>,
    /// How many times buyers were read to shut a gate, since start.
    pub(super) readings: AtomicUsize,
}

#[derive(Default)]
struct GateState {
    shut: HashMap<String, Shut>,
    /// Activities whose buyers are being read now, to shut their gate.
    closing: HashSet<String>,
    /// Activities with more buyers than a gate keeps: never gated (buyers only
    /// grow, so this does not change).
    too_large: HashSet<String>,
}

pub(super) struct Shut {
    pub(super) restock: Vec<(String, i64)>,
    pub(super) buyers: HashSet<String>,
}

/// Most buyers a shut sale keeps in memory; a larger sale is not gated.
pub(super) const GATE_MAX_BUYERS: usize = 1_000_000;

/// Buyers read per `HSCAN` call while shutting a gate.
pub(super) const GATE_SCAN_BATCH: usize = 1_000;

impl SoldOutGate {
    fn state(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether `user_id` is to be told `sold_out` from memory.
    pub(super) fn refuses(&self, activity_id: &str, user_id: &str) -> bool {
        self.state()
            .shut
            .get(activity_id)
            .is_some_and(|s| !s.buyers.contains(user_id))
    }

    /// Whether this call is the one to read `activity_id`'s buyers: it is not
    /// shut already, not too large to gate, and no one else is at it.
    pub(super) fn begin_closing(&self, activity_id: &str) -> bool {
        let mut state = self.state();
        if state.shut.contains_key(activity_id) || state.too_large.contains(activity_id) {
            return false;
        }
        state.closing.insert(activity_id.to_owned())
    }

    /// Ends a reading: the gate shut with what it found, or left open.
    pub(super) fn end_closing(&self, activity_id: &str, found: Option<Shut>, too_large: bool) {
        let mut state = self.state();
        state.closing.remove(activity_id);
        if too_large {
            state.too_large.insert(activity_id.to_owned());
        }
        if let Some(shut) = found {
            state.shut.insert(activity_id.to_owned(), shut);
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
}
