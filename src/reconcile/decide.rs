//! What each step of a pass decides, from what it read. No I/O: the rules are
//! tested here without Redis, MySQL or a broker, and the steps (`mod`,
//! `rebuild`, `drift`, `retention`) only read, call these, and act.

use std::time::Duration;

use crate::stock::PreloadMode;

/// Whether a current sale gets a full pass, before anything is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Look {
    /// It lost its state (as this instance saw): always.
    Pass,
    /// On a rebuild's retry, a sale that is not selling needs nothing.
    Skip,
    /// One look at its Redis state decides ([`after_look`]).
    ReadRedis,
}

/// `full`: the interval's tick (not a rebuild's retry, nor a wake-up).
pub(super) fn first_look(lost: bool, full: bool, open: bool) -> Look {
    if lost {
        Look::Pass
    } else if !full && !open {
        Look::Skip
    } else {
        Look::ReadRedis
    }
}

/// After one look at Redis: an open sale that lost its state, holds an older
/// build than MySQL's last (`behind`), or is still paused automatically,
/// always; any other open one on a full pass; an ended one only while a
/// reservation of it is pending or units lent between its shards are not
/// received yet (`in_transit`: a transfer its request left half done when the
/// sale ended; nothing else of an ended sale needs the reconciler: a lost one
/// is not rebuilt, a late message or a lapse is the consumer's and the
/// sweeper's).
pub(super) fn after_look(
    open: bool,
    full: bool,
    loaded: bool,
    behind: bool,
    pending: u64,
    in_transit: bool,
) -> bool {
    match (open, loaded) {
        (true, false) => true,
        (true, true) => full || behind,
        (false, _) => pending > 0 || in_transit,
    }
}

/// What a pass makes of a sale's Redis state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum State {
    /// Whole and current.
    Whole,
    /// Not loaded (`Missing`), or only some of its shards (`Force`: the others
    /// still sell and hold reservations, so it is rebuilt whole).
    Lost(PreloadMode),
    /// Older than the last build MySQL recorded: a primary that went back in
    /// time (a failover to a replica that missed the build); rebuilt by force.
    Stale,
}

pub(super) fn state(loaded: bool, partly_loaded: bool, epoch: Option<u32>, built: u32) -> State {
    if !loaded {
        return State::Lost(if partly_loaded {
            PreloadMode::Force
        } else {
            PreloadMode::Missing
        });
    }
    // A build begun elsewhere that wrote nothing is no sign of it: `built`
    // counts only the builds written whole.
    match epoch {
        Some(epoch) if epoch < built => State::Stale,
        _ => State::Whole,
    }
}

/// What becomes of a sale that is not whole and current.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Recovery {
    /// Not selling: nothing to protect (the operator preloads before a start).
    NotSelling,
    /// A publish made in the lost state may still be on its way: wait.
    Wait,
    /// Every publish of the lost state has landed or failed: rebuild.
    Rebuild,
}

/// `seen_for`: since this instance first saw the loss; `in_flight`: the
/// longest a publish may still be on its way (publish timeout and grace).
pub(super) fn recovery(open: bool, seen_for: Duration, in_flight: Duration) -> Recovery {
    if !open {
        Recovery::NotSelling
    } else if seen_for < in_flight {
        Recovery::Wait
    } else {
        Recovery::Rebuild
    }
}

/// What a drift repair found of the reservations pending in Redis (read after
/// the audit): how many it read, of at most `limit`, and how many of them are
/// orders in MySQL already.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Pending {
    pub read: usize,
    pub limit: usize,
    pub ordered: i64,
}

/// Why a drift repair must wait, if it must. A reservation the consumers wrote
/// to MySQL and have not settled in Redis yet is counted by MySQL's live units
/// and by Redis's pending units at once, which reads as drift that is not; one
/// settled since the audit changes the pending units the repair's
/// compare-and-set checks, one written since changes the live units MySQL is
/// read for again. With more pending than can be checked, the repair waits.
pub(super) fn repair_waits(pending_units: i64, pending: Option<Pending>) -> Option<String> {
    if pending_units == 0 {
        return None;
    }
    match pending {
        None => Some(format!(
            "{pending_units} units pending in Redis (with the stock split, a repair waits for none)"
        )),
        Some(p) if p.read >= p.limit => Some(format!(
            "{} or more reservations pending in Redis; next pass",
            p.read
        )),
        Some(p) if p.ordered > 0 => Some(format!(
            "{} reservations pending in Redis are orders in MySQL, not settled yet; next pass",
            p.ordered
        )),
        Some(_) => None,
    }
}

/// What the retention does with a sale whose end is past its retention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Removal {
    /// Remove it now (or finish a removal begun).
    Remove,
    /// Not yet: its waiting room's loop is not done with it (a minute past
    /// the end).
    Wait,
    /// Only if no reservation of it is pending (the pass that decides them
    /// needs them).
    IfNothingPending,
}

/// `removing`: a removal was begun; `looked_after`: the passes still look at
/// it (an hour after its end); `room_busy`: its waiting room's loop still
/// steps it (a minute after its end).
pub(super) fn removal(removing: bool, looked_after: bool, room_busy: bool) -> Removal {
    match (removing, looked_after, room_busy) {
        (true, _, _) | (false, false, _) => Removal::Remove,
        (false, true, true) => Removal::Wait,
        (false, true, false) => Removal::IfNothingPending,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_sale_is_passed_always_and_between_intervals_nothing_else_is_unless_open() {
        for ticked in [false, true] {
            for open in [false, true] {
                assert_eq!(first_look(true, ticked, open), Look::Pass);
            }
        }
        assert_eq!(first_look(false, false, false), Look::Skip);
        assert_eq!(first_look(false, false, true), Look::ReadRedis);
        assert_eq!(first_look(false, true, false), Look::ReadRedis);
        assert_eq!(first_look(false, true, true), Look::ReadRedis);
    }

    #[test]
    fn an_ended_sale_with_units_between_shards_gets_a_pass() {
        assert!(after_look(false, false, true, false, 0, true));
        assert!(!after_look(false, true, true, false, 0, false));
    }

    #[test]
    fn after_one_look_only_live_work_gets_a_pass() {
        // Open: lost, stale or paused automatically always; whole on a full
        // pass only.
        assert!(after_look(true, false, false, false, 0, false));
        assert!(after_look(true, true, false, false, 0, false));
        assert!(after_look(true, true, true, false, 0, false));
        assert!(after_look(true, false, true, true, 0, false));
        assert!(!after_look(true, false, true, false, 3, false));
        // Ended: only with something pending, loaded or not.
        assert!(!after_look(false, true, true, true, 0, false));
        assert!(!after_look(false, true, false, false, 0, false));
        assert!(after_look(false, true, true, false, 1, false));
    }

    #[test]
    fn a_state_is_lost_partly_lost_stale_or_whole() {
        assert_eq!(
            state(false, false, None, 3),
            State::Lost(PreloadMode::Missing)
        );
        assert_eq!(
            state(false, true, Some(3), 3),
            State::Lost(PreloadMode::Force)
        );
        assert_eq!(state(true, false, Some(2), 3), State::Stale);
        assert_eq!(state(true, false, Some(3), 3), State::Whole);
        // Newer than MySQL's last written build: a build being written.
        assert_eq!(state(true, false, Some(4), 3), State::Whole);
        // Loaded before epochs were kept.
        assert_eq!(state(true, false, None, 3), State::Whole);
    }

    #[test]
    fn a_rebuild_waits_out_the_publishes_in_flight_and_never_runs_outside_the_window() {
        let in_flight = Duration::from_millis(3_500);
        assert_eq!(
            recovery(false, Duration::from_secs(60), in_flight),
            Recovery::NotSelling
        );
        assert_eq!(recovery(true, Duration::ZERO, in_flight), Recovery::Wait);
        assert_eq!(
            recovery(true, Duration::from_millis(3_499), in_flight),
            Recovery::Wait
        );
        assert_eq!(recovery(true, in_flight, in_flight), Recovery::Rebuild);
    }

    #[test]
    fn a_repair_waits_only_for_reservations_written_and_not_settled() {
        let p = |read, ordered| {
            Some(Pending {
                read,
                limit: 5_000,
                ordered,
            })
        };
        assert_eq!(repair_waits(0, None), None);
        assert_eq!(repair_waits(2, p(2, 0)), None, "pending, none written yet");
        assert!(repair_waits(2, p(2, 1)).is_some_and(|w| w.contains("not settled")));
        assert!(repair_waits(2, p(5_000, 0)).is_some_and(|w| w.contains("5000 or more")));
        assert!(repair_waits(2, None).is_some());
    }

    #[test]
    fn a_removal_waits_for_what_still_looks_at_the_sale() {
        assert_eq!(
            removal(true, true, true),
            Removal::Remove,
            "begun: finish it"
        );
        assert_eq!(removal(false, false, true), Removal::Remove);
        assert_eq!(removal(false, true, true), Removal::Wait);
        assert_eq!(removal(false, true, false), Removal::IfNothingPending);
    }
}
