//! The sold-out gate's memory: sales this instance found sold out, answered
//! from memory until a unit comes back (`sold_out` finds and reopens them).

use std::collections::HashMap;
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
/// Finding a sale sold out reads its filters once per instance (one script a
/// shard, a few bytes a unit sold, whatever the number of users), in the
/// background, never on a request's path: requests go on to Redis until the
/// gate is shut. A sale whose filters cannot be trusted (`filter_read.lua`) is
/// remembered with the restock counts it was found at, and not read again
/// until a count moves.
#[derive(Default)]
pub(super) struct SoldOutGate {
    state: Mutex<GateState>,
    /// How many readings of filters to shut a gate have begun, since start.
    pub(super) begun: AtomicUsize,
    /// How many readings of filters to shut a gate have ended, since start.
    pub(super) readings: AtomicUsize,
}

#[derive(Default)]
struct GateState {
    shut: HashMap<String, Arc<Shut>>,
    /// Activities whose filters are being read now, to shut their gate, with
    /// their generation when the reading began.
    closing: HashMap<String, u64>,
    /// Bumped for an activity each time its gate is opened: a reading that
    /// began before an opening may have read the counts before the units came
    /// back, so what it found is dropped.
    generation: HashMap<String, u64>,
    /// Activities whose filters could not be trusted, with the restock counts
    /// (sorted by key) they were read at.
    ungateable: HashMap<String, Vec<(String, i64)>>,
}

/// What a reading of a sale's filters found.
pub(super) enum Reading {
    /// Every filter is trusted and no count moved: shut the gate.
    Shut(Shut),
    /// A shard's filter cannot be trusted at these restock counts (sorted by
    /// key): no gate, and no reading again until a count moves.
    Ungateable(Vec<(String, i64)>),
    /// A count moved meanwhile, or Redis failed: the gate stays open.
    Open,
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

    /// Whether this call is the one to read `activity_id`'s filters, found sold
    /// out at `restock` (sorted by key): it is not shut already, not known
    /// ungateable at these counts, and no one else is at it. `Some` holds the
    /// generation to hand back to [`end_closing`](Self::end_closing).
    pub(super) fn begin_closing(
        &self,
        activity_id: &str,
        restock: &[(String, i64)],
    ) -> Option<u64> {
        let mut state = self.state();
        if state.shut.contains_key(activity_id)
            || state.closing.contains_key(activity_id)
            || state
                .ungateable
                .get(activity_id)
                .is_some_and(|seen| seen.as_slice() == restock)
        {
            return None;
        }
        let generation = state.generation.get(activity_id).copied().unwrap_or(0);
        state.closing.insert(activity_id.to_owned(), generation);
        self.begun.fetch_add(1, Ordering::Relaxed);
        Some(generation)
    }

    /// Ends a reading begun at `generation`: the gate shut with what it found,
    /// remembered as ungateable, or left open. Found nothing if the gate was
    /// opened meanwhile (units came back after the reading checked the counts).
    pub(super) fn end_closing(&self, activity_id: &str, generation: u64, found: Reading) {
        let mut state = self.state();
        state.closing.remove(activity_id);
        self.readings.fetch_add(1, Ordering::Relaxed);
        if state.generation.get(activity_id).copied().unwrap_or(0) != generation {
            return;
        }
        match found {
            Reading::Shut(shut) => {
                state.ungateable.remove(activity_id);
                state.shut.insert(activity_id.to_owned(), Arc::new(shut));
            }
            Reading::Ungateable(restock) => {
                state.ungateable.insert(activity_id.to_owned(), restock);
            }
            Reading::Open => {}
        }
    }

    pub(super) fn open(&self, activity_id: &str) {
        let mut state = self.state();
        state.shut.remove(activity_id);
        state.ungateable.remove(activity_id);
        *state.generation.entry(activity_id.to_owned()).or_default() += 1;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn restock() -> Vec<(String, i64)> {
        vec![("a:restock".to_owned(), 3)]
    }

    fn shut() -> Reading {
        Reading::Shut(Shut {
            restock: restock(),
            filters: Vec::new(),
        })
    }

    #[test]
    fn a_reading_ended_after_an_opening_does_not_shut_the_gate() {
        let gate = SoldOutGate::default();
        let generation = gate.begin_closing("a", &restock()).expect("a reading");
        // This instance's own refund brings a unit back while the reading is
        // past its check of the counts: it finds nothing shut to open.
        gate.open("a");
        gate.end_closing("a", generation, shut());
        assert!(!gate.refuses("a", "anyone"));
        // The next reading shuts it.
        let generation = gate.begin_closing("a", &restock()).expect("a reading");
        gate.end_closing("a", generation, shut());
        assert!(gate.refuses("a", "anyone"));
    }

    #[test]
    fn an_ungateable_sale_is_read_again_only_when_a_count_moves() {
        let gate = SoldOutGate::default();
        let generation = gate.begin_closing("a", &restock()).expect("a reading");
        assert!(
            gate.begin_closing("a", &restock()).is_none(),
            "one at a time"
        );
        gate.end_closing("a", generation, Reading::Ungateable(restock()));
        assert!(gate.begin_closing("a", &restock()).is_none());
        assert!(!gate.refuses("a", "anyone"));
        let moved = vec![("a:restock".to_owned(), 4)];
        let generation = gate.begin_closing("a", &moved).expect("a count moved");
        gate.end_closing("a", generation, Reading::Open);
        assert_eq!(gate.begun.load(Ordering::Relaxed), 2);
        assert_eq!(gate.readings.load(Ordering::Relaxed), 2);
    }
}
