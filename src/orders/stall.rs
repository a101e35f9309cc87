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
//! Right after this consumer's group was reshaped (a rebalance, which is also how
//! a restarted broker shows itself), an orphan is judged much sooner: every live
//! member was handed its partitions in that rebalance, so a partition whose
//! backlog still stands a moment after it ended was handed to a member that is
//! gone. A broker that keeps departed members across its own restart does that,
//! and a sale that lost Redis then waits for that backlog before it rebuilds.

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
    /// The first patience while the group is fresh (see `look`).
    quick: Duration,
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
    /// first rejoin; `quick`: the same while the group is fresh (no longer than
    /// `patience`); `gap`: see the field.
    pub fn new(patience: Duration, quick: Duration, gap: Duration) -> Self {
        StallWatch {
            first_patience: patience,
            quick: quick.min(patience),
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
    /// nobody is late), whether it is fresh (settled from a rebalance less than
    /// one patience ago: a partition not held here, standing still for `quick`,
    /// is orphaned), and `jitter` in [0, 1) that stretches the wait between two rejoins
    /// by up to a quarter. The first rejoin comes after one patience exactly: a
    /// healthy coordinator would have handed the partition out by then, and idle
    /// members rejoining together make one rebalance, not several.
    pub fn look(
        &mut self,
        group: &[PartitionOffsets],
        held: &HashSet<i32>,
        settling: bool,
        fresh: bool,
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
        let judged_after = if fresh {
            self.quick
        } else {
            self.first_patience
        };
        let mut stuck = false;
        let mut orphaned = false;
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
            if p.lag > 0 && standing >= judged_after {
                stuck = true;
                orphaned |= !held.contains(&p.partition);
            }
        }
        if !stuck {
            self.patience = self.first_patience;
            self.last_rejoin = None;
        }
        let rested = self.last_rejoin.is_none_or(|last| {
            at.saturating_duration_since(last) >= self.patience.mul_f64(stretch)
        });
        if !orphaned || settling || !rested {
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
        (0..secs)
            .filter(|&i| {
                w.look(g, &held(mine), false, false, 0.0, from + SECOND * i) == Verdict::Rejoin
            })
            .collect()
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
                w.look(&g, &held(&[0, 1]), false, false, 0.0, at),
                Verdict::Wait
            );
        }
        let g = [part(0, 6, 1), part(1, 6, 1), part(2, 7, 4)];
        assert_eq!(
            w.look(&g, &held(&[0, 1]), false, false, 0.0, t0 + P),
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
            assert_eq!(w.look(&g, &held(&[]), false, false, 0.0, at), Verdict::Wait);
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
            w.look(&[part(0, 5, 3)], &held(&[]), false, false, 0.0, t0),
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
            assert_eq!(w.look(&g, &held(&[]), true, false, 0.0, at), Verdict::Wait);
        }
        assert_eq!(
            w.look(&g, &held(&[]), false, false, 0.0, t0 + SECOND * 60),
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
                w.look(&g, &held(&[]), false, false, 0.99, t0 + SECOND * i) == Verdict::Rejoin
            })
            .collect();
        // The first after one patience; the next after 6 s × 1.2475, not 6 s.
        assert_eq!(rejoins, vec![6, 14]);
    }

    #[test]
    fn a_fresh_group_judges_an_orphan_after_the_quick_patience() {
        let t0 = Instant::now();
        let mut w = watch();
        // Settling for 2 s after the rebalance, then fresh: the backlog that
        // stood through the rebalance is judged 2 s after it started, at once.
        let g = [part(0, 5, 3), part(1, 8, 0)];
        let mine = held(&[1]);
        assert_eq!(w.look(&g, &mine, true, true, 0.0, t0), Verdict::Wait);
        assert_eq!(
            w.look(&g, &mine, true, true, 0.0, t0 + SECOND),
            Verdict::Wait
        );
        assert_eq!(w.look(&g, &mine, false, true, 0.0, t0 + Q), Verdict::Rejoin);
        // The next rejoin still waits one whole patience.
        let later: Vec<u32> = (3..13)
            .filter(|&i| w.look(&g, &mine, false, true, 0.0, t0 + SECOND * i) == Verdict::Rejoin)
            .collect();
        assert_eq!(later, vec![8]);
    }

    #[test]
    fn a_fresh_group_never_rejoins_over_a_partition_it_holds_or_one_that_moves() {
        let t0 = Instant::now();
        let mut w = watch();
        for i in 0..30 {
            let g = [part(0, 5, 3), part(1, i, 2)];
            let at = t0 + SECOND * i as u32;
            assert_eq!(w.look(&g, &held(&[0]), false, true, 0.0, at), Verdict::Wait);
        }
    }
}
