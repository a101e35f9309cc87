//! Rejoining a consumer group that forgot to hand out a dead member's partitions.
//!
//! A group coordinator is supposed to tell every live member, through its
//! heartbeats, when a dead member is dropped, so that the survivors rejoin and
//! share the dead member's partitions. A coordinator that drops the member without
//! saying so leaves those partitions with nobody while their backlog grows:
//! reservations never reach MySQL and, after a Redis loss, the sale never rebuilds
//! (it waits for the backlog to drain). A consumer cannot see the group's
//! assignment, but it can see the symptom: a partition it does not hold has
//! messages waiting and its committed offset has not moved for longer than a
//! coordinator takes to drop a dead member (one session timeout). Then it leaves
//! and joins again, which makes the coordinator share out every partition anew.
//!
//! A partition whose holder is alive but stuck (MySQL down) looks the same; a
//! rejoin then only moves partitions around, at the cost of one rebalance and no
//! message (offsets are committed after MySQL, so a batch redelivered is a no-op).
//! So the patience doubles with each rejoin while partitions stay stuck, up to
//! [`MAX_PATIENCE`], comes back to one session timeout only once nothing is stuck,
//! and carries a jitter so that idle members of one fleet do not keep rejoining
//! in step.
//!
//! A broker restart makes such orphans itself. The broker used here (tansu 0.6)
//! keeps the group on disk across its restart; a member that comes back under a
//! new id leaves its old id behind, and the rebalance that follows hands that
//! ghost partitions. The broker drops the ghost one session timeout after its
//! last heartbeat, without a new generation, so its partitions stay with nobody
//! until some member rejoins; a rejoin sooner than that hands them to the ghost
//! again. The ghost's last heartbeat came before the broker went away, and so
//! before this consumer saw the connection fail. Hence no rejoin until one
//! session timeout (and a margin) after this consumer lost the broker, when
//! every ghost is gone; then, once per outage and within one patience, a
//! partition not held here whose backlog stood still for `quick` is rejoined
//! over at once, instead of one whole patience after its messages began to
//! wait. A sale that lost Redis waits for that backlog.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use tokio::time::Instant;

use crate::kafka::PartitionOffsets;

/// The longest a consumer waits between two rejoins.
pub const MAX_PATIENCE: Duration = Duration::from_secs(300);

/// What to do after one look at the group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing is wrong, or it has not lasted long enough.
    Wait,
    /// Leave the group and join again.
    Rejoin,
}

/// Watches the group's partitions for a backlog that nobody drains. Every time is
/// the time of a reading of the group, not of the look at it: a reading looked at
/// late says what was true when it was taken.
#[derive(Debug)]
pub struct StallWatch {
    first_patience: Duration,
    /// How long an orphan's backlog stands before the one rejoin after an outage.
    quick: Duration,
    /// The outage (when every ghost of it is gone) already rejoined over, and
    /// when: no ordinary rejoin comes sooner than one patience after it.
    outage_done: Option<(Instant, Instant)>,
    patience: Duration,
    /// Readings further apart than this (the probe failed, or this consumer was
    /// busy) say nothing about the time between them: the clocks start again.
    gap: Duration,
    /// Each partition's committed offset when its clock started, whether messages
    /// were waiting then, and when: the clock starts again whenever the offset
    /// moves or nothing waits. A rejoin never resets these.
    still_since: HashMap<i32, (i64, bool, Instant)>,
    last_reading: Option<Instant>,
    last_rejoin: Option<Instant>,
}

impl StallWatch {
    /// `patience`: how long a partition's backlog may stand still before the
    /// first rejoin; `quick`: the same for the one rejoin after an outage (no
    /// longer than `patience`); `gap`: see the field.
    pub fn new(patience: Duration, quick: Duration, gap: Duration) -> Self {
        StallWatch {
            first_patience: patience,
            quick: quick.min(patience),
            outage_done: None,
            patience,
            gap,
            still_since: HashMap::new(),
            last_reading: None,
            last_rejoin: None,
        }
    }

    /// One look at a reading taken at `at`: the group's offsets per partition,
    /// the partitions this consumer holds, whether its group is settling (a
    /// rebalance under way, or ended a moment ago: it holds nothing yet, and
    /// nobody is late), when the ghosts of the last broker outage this consumer
    /// saw are gone (see the module), and `jitter` in [0, 1) that stretches the
    /// wait between two rejoins by up to a quarter. The first rejoin comes after
    /// one patience exactly: a healthy coordinator would have handed the
    /// partition out by then, and idle members rejoining together make one
    /// rebalance, not several. Around an outage: no rejoin while its ghosts may
    /// be there; in the patience after they are gone, one rejoin over a backlog
    /// that stood `quick`; no ordinary rejoin within a patience after that one.
    pub fn look(
        &mut self,
        group: &[PartitionOffsets],
        held: &HashSet<i32>,
        settling: bool,
        ghosts_gone: Option<Instant>,
        jitter: f64,
        at: Instant,
    ) -> Verdict {
        if self
            .last_reading
            .is_some_and(|last| at.saturating_duration_since(last) > self.gap)
        {
            self.still_since.clear();
        }
        self.last_reading = Some(at);
        let stretch = 1.0 + jitter.clamp(0.0, 1.0) / 4.0;
        let mut stuck = false;
        let mut orphaned = false;
        let mut orphaned_a_while = false;
        for p in group {
            // A partition with nothing waiting is never late: its clock starts
            // when messages wait and nothing is committed.
            let since = match self.still_since.get(&p.partition) {
                Some(&(seen, true, since)) if seen == p.committed && p.lag > 0 => since,
                _ => {
                    self.still_since
                        .insert(p.partition, (p.committed, p.lag > 0, at));
                    at
                }
            };
            let standing = at.saturating_duration_since(since);
            orphaned_a_while |= p.lag > 0 && standing >= self.quick && !held.contains(&p.partition);
            if p.lag > 0 && standing >= self.first_patience {
                stuck = true;
                orphaned |= !held.contains(&p.partition);
            }
        }
        // After a broker outage: until its ghosts are gone no rejoin helps (it
        // would hand the partition to a ghost again); then, for one patience,
        // one quick rejoin.
        let mut ghosts_left = false;
        if let Some(gone) = ghosts_gone {
            let done = self.outage_done.is_some_and(|(g, _)| g == gone);
            ghosts_left = at < gone;
            let window = at >= gone && at < gone + self.first_patience;
            if orphaned_a_while && !settling && window && !done {
                self.outage_done = Some((gone, at));
                return Verdict::Rejoin;
            }
        }
        if !stuck {
            self.patience = self.first_patience;
            self.last_rejoin = None;
        }
        let rested = self.last_rejoin.is_none_or(|last| {
            at.saturating_duration_since(last) >= self.patience.mul_f64(stretch)
        }) && self
            .outage_done
            .is_none_or(|(_, quick)| at.saturating_duration_since(quick) >= self.first_patience);
        if !orphaned || settling || !rested || ghosts_left {
            return Verdict::Wait;
        }
        if self.last_rejoin.is_some() {
            self.patience = (self.patience * 2).min(MAX_PATIENCE.max(self.first_patience));
        }
        self.last_rejoin = Some(at);
        Verdict::Rejoin
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: Duration = Duration::from_secs(6);
    const Q: Duration = Duration::from_secs(2);
    const SECOND: Duration = Duration::from_secs(1);

    fn part(partition: i32, committed: i64, lag: i64) -> PartitionOffsets {
        PartitionOffsets {
            partition,
            committed,
            lag,
        }
    }

    fn held(ps: &[i32]) -> HashSet<i32> {
        ps.iter().copied().collect()
    }

    fn watch() -> StallWatch {
        StallWatch::new(P, Q, Duration::from_secs(3))
    }

    /// Looks every second from `from` for `secs` seconds at the same reading;
    /// returns the seconds at which it asked for a rejoin.
    fn every_second(
        w: &mut StallWatch,
        g: &[PartitionOffsets],
        mine: &[i32],
        from: Instant,
        secs: u32,
    ) -> Vec<u32> {
        looks_every_second(w, g, mine, None, from, secs)
    }

    #[test]
    fn an_orphaned_backlog_standing_still_for_the_patience_asks_for_a_rejoin() {
        let t0 = Instant::now();
        let mut w = watch();
        assert_eq!(every_second(&mut w, &[part(0, 5, 3)], &[], t0, 7), vec![6]);
    }

    #[test]
    fn one_orphaned_partition_among_drained_ones_is_found() {
        let t0 = Instant::now();
        let mut w = watch();
        // This consumer drains 0 and 1; partition 2 stands still with nobody.
        for i in 0..6 {
            let g = [part(0, i, 1), part(1, i, 1), part(2, 7, 4)];
            let at = t0 + SECOND * i as u32;
            assert_eq!(
                w.look(&g, &held(&[0, 1]), false, None, 0.0, at),
                Verdict::Wait
            );
        }
        let g = [part(0, 6, 1), part(1, 6, 1), part(2, 7, 4)];
        assert_eq!(
            w.look(&g, &held(&[0, 1]), false, None, 0.0, t0 + P),
            Verdict::Rejoin
        );
    }

    #[test]
    fn a_partition_this_consumer_holds_is_never_a_reason_to_rejoin() {
        let t0 = Instant::now();
        let mut w = watch();
        assert!(every_second(&mut w, &[part(0, 5, 3)], &[0], t0, 600).is_empty());
    }

    #[test]
    fn commits_that_move_mean_another_member_drains() {
        let t0 = Instant::now();
        let mut w = watch();
        for i in 0..60 {
            let g = [part(0, i, 3)];
            let at = t0 + SECOND * i as u32;
            assert_eq!(w.look(&g, &held(&[]), false, None, 0.0, at), Verdict::Wait);
        }
    }

    #[test]
    fn no_backlog_means_no_rejoin() {
        let t0 = Instant::now();
        let mut w = watch();
        assert!(every_second(&mut w, &[part(0, 5, 0)], &[], t0, 600).is_empty());
    }

    #[test]
    fn while_a_partition_stays_stuck_the_rejoins_space_out_up_to_the_cap() {
        let t0 = Instant::now();
        let mut w = watch();
        // Looked at every second for an hour: the holder is stuck (MySQL down).
        let rejoins = every_second(&mut w, &[part(0, 5, 3)], &[], t0, 3600);
        let gaps: Vec<u32> = rejoins.windows(2).map(|w| w[1] - w[0]).collect();
        assert_eq!(rejoins[0], 6);
        assert_eq!(&gaps[..6], &[6, 12, 24, 48, 96, 192]);
        assert!(gaps[6..].iter().all(|&g| g == 300), "{gaps:?}");
    }

    #[test]
    fn the_patience_comes_back_once_nothing_is_stuck() {
        let t0 = Instant::now();
        let mut w = watch();
        assert_eq!(
            every_second(&mut w, &[part(0, 5, 3)], &[], t0, 13),
            vec![6, 12]
        );
        // Drained, then a new stall: judged after one patience again.
        let t = t0 + SECOND * 13;
        assert!(every_second(&mut w, &[part(0, 9, 0)], &[], t, 2).is_empty());
        let t = t + SECOND * 2;
        assert_eq!(every_second(&mut w, &[part(0, 9, 2)], &[], t, 7), vec![6]);
    }

    #[test]
    fn a_message_arriving_on_a_quiet_partition_starts_its_clock() {
        let t0 = Instant::now();
        let mut w = watch();
        // Quiet for an hour, then one message nobody reads.
        assert!(every_second(&mut w, &[part(0, 9, 0)], &[], t0, 3600).is_empty());
        let t = t0 + SECOND * 3600;
        assert_eq!(every_second(&mut w, &[part(0, 9, 1)], &[], t, 7), vec![6]);
    }

    #[test]
    fn readings_far_apart_start_the_clocks_again() {
        let t0 = Instant::now();
        let mut w = watch();
        // The probe failed for 20 s (the broker was down) after one reading.
        assert_eq!(
            w.look(&[part(0, 5, 3)], &held(&[]), false, None, 0.0, t0),
            Verdict::Wait
        );
        let t = t0 + Duration::from_secs(20);
        assert_eq!(every_second(&mut w, &[part(0, 5, 3)], &[], t, 7), vec![6]);
    }

    #[test]
    fn a_settling_group_is_never_judged() {
        let t0 = Instant::now();
        let mut w = watch();
        let g = [part(0, 5, 3)];
        for i in 0..60 {
            let at = t0 + SECOND * i;
            assert_eq!(w.look(&g, &held(&[]), true, None, 0.0, at), Verdict::Wait);
        }
        assert_eq!(
            w.look(&g, &held(&[]), false, None, 0.0, t0 + SECOND * 60),
            Verdict::Rejoin
        );
    }

    #[test]
    fn jitter_stretches_the_wait_between_rejoins_by_up_to_a_quarter() {
        let t0 = Instant::now();
        let mut w = watch();
        let g = [part(0, 5, 3)];
        let rejoins: Vec<u32> = (0..15)
            .filter(|&i| {
                w.look(&g, &held(&[]), false, None, 0.99, t0 + SECOND * i) == Verdict::Rejoin
            })
            .collect();
        // The first after one patience; the next after 6 s × 1.2475, not 6 s.
        assert_eq!(rejoins, vec![6, 14]);
    }

    /// The same, with the ghosts of an outage gone at `gone`.
    fn every_second_after_outage(
        w: &mut StallWatch,
        g: &[PartitionOffsets],
        mine: &[i32],
        gone: Instant,
        from: Instant,
        secs: u32,
    ) -> Vec<u32> {
        looks_every_second(w, g, mine, Some(gone), from, secs)
    }

    fn looks_every_second(
        w: &mut StallWatch,
        g: &[PartitionOffsets],
        mine: &[i32],
        ghosts_gone: Option<Instant>,
        from: Instant,
        secs: u32,
    ) -> Vec<u32> {
        (0..secs)
            .filter(|&i| {
                let at = from + SECOND * i;
                w.look(g, &held(mine), false, ghosts_gone, 0.0, at) == Verdict::Rejoin
            })
            .collect()
    }

    #[test]
    fn after_an_outage_an_orphan_is_rejoined_over_once_its_ghosts_are_gone() {
        let t0 = Instant::now();
        let mut w = watch();
        // Messages stand from 0 s on a partition held elsewhere; the ghosts go
        // at 4 s: one rejoin then, not at 6 s; the next one patience later.
        let g = [part(0, 5, 3), part(1, 0, 0)];
        let rejoins = every_second_after_outage(&mut w, &g, &[1], t0 + SECOND * 4, t0, 20);
        assert_eq!(rejoins, vec![4, 10, 16]);
    }

    #[test]
    fn the_ghosts_gone_do_not_hurry_a_backlog_that_just_began() {
        let t0 = Instant::now();
        let mut w = watch();
        // Ghosts gone at 0 s; messages stand from 0 s: the quick rejoin after 2 s.
        let g = [part(0, 5, 3)];
        let rejoins = every_second_after_outage(&mut w, &g, &[], t0, t0, 3);
        assert_eq!(rejoins, vec![2]);
    }

    #[test]
    fn an_outage_gives_no_rejoin_over_a_held_moving_or_empty_partition_or_a_settling_group() {
        let t0 = Instant::now();
        let mut w = watch();
        for i in 0..30 {
            let g = [part(0, 5, 3), part(1, i, 2), part(2, 9, 0)];
            let at = t0 + SECOND * i as u32;
            assert_eq!(
                w.look(&g, &held(&[0]), false, Some(t0), 0.0, at),
                Verdict::Wait
            );
        }
        let mut w = watch();
        for i in 0..5 {
            let at = t0 + SECOND * i;
            assert_eq!(
                w.look(&[part(0, 5, 3)], &held(&[]), true, Some(t0), 0.0, at),
                Verdict::Wait
            );
        }
    }

    #[test]
    fn a_second_outage_gives_one_more_quick_rejoin() {
        let t0 = Instant::now();
        let mut w = watch();
        let g = [part(0, 5, 3)];
        assert_eq!(
            every_second_after_outage(&mut w, &g, &[], t0, t0, 4),
            vec![2]
        );
        let t = t0 + SECOND * 4;
        // The same outage again: nothing until the patience; a new one: at once.
        assert!(every_second_after_outage(&mut w, &g, &[], t0, t, 1).is_empty());
        assert_eq!(
            every_second_after_outage(&mut w, &g, &[], t, t + SECOND, 1),
            vec![0]
        );
    }

    #[test]
    fn no_rejoin_while_the_ghosts_of_an_outage_may_be_there() {
        let t0 = Instant::now();
        let mut w = watch();
        // Messages stand from 0 s; the ghosts go at 8 s: the ordinary rejoin
        // (6 s) would hand the partition back to a ghost, so it waits.
        let g = [part(0, 5, 3)];
        let gone = t0 + SECOND * 8;
        assert_eq!(
            every_second_after_outage(&mut w, &g, &[], gone, t0, 10),
            vec![8]
        );
    }

    #[test]
    fn an_outage_long_past_leaves_the_ordinary_patience() {
        let t0 = Instant::now();
        let mut w = watch();
        // The ghosts went at 0 s; a backlog begins at 10 s, past the window.
        let g = [part(0, 5, 3)];
        let t = t0 + SECOND * 10;
        assert_eq!(
            every_second_after_outage(&mut w, &g, &[], t0, t, 7),
            vec![6]
        );
    }
}
