//! Rejoining a consumer group that forgot to give this consumer its share.
//!
//! A group coordinator is supposed to tell every live member, through its
//! heartbeats, when a dead member is dropped, so that the survivors rejoin and
//! take the dead member's partitions. A coordinator that drops the member without
//! saying so leaves a consumer holding no partition forever while the backlog
//! grows: reservations never reach MySQL and, after a Redis loss, the sale never
//! rebuilds. The consumer cannot see the group's assignment, but it can see the
//! symptom: it holds no partition, the group has messages left, and the group's
//! committed offsets have not moved for longer than a rebalance takes. Then it
//! leaves and joins again.
//!
//! A fleet with more consumers than partitions has idle members by design; they
//! see the others' commits move and never rejoin. When every holder is stuck for a
//! reason of its own (MySQL down), an idle member's rejoins would only shuffle
//! partitions around, so each rejoin doubles the patience for the next, up to
//! [`MAX_PATIENCE`].

use std::time::Duration;

use tokio::time::Instant;

/// The longest an idle consumer waits between two rejoins.
pub const MAX_PATIENCE: Duration = Duration::from_secs(300);

/// What to do after one look at the group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing is wrong, or it has not lasted long enough.
    Wait,
    /// Leave the group and join again.
    Rejoin,
}

/// Watches an idle consumer's group for a backlog nobody drains.
#[derive(Debug)]
pub struct StallWatch {
    first_patience: Duration,
    patience: Duration,
    /// The group's committed total when it was last seen to change, and when.
    still_since: Option<(i64, Instant)>,
}

impl StallWatch {
    /// `patience`: how long a backlog may stand still before the first rejoin.
    /// One session timeout: a coordinator that does its job has dropped a dead
    /// member and handed out its partitions by then. Rejoining early costs a
    /// rebalance, never a message.
    pub fn new(patience: Duration) -> Self {
        StallWatch {
            first_patience: patience,
            patience,
            still_since: None,
        }
    }

    /// This consumer holds partitions, or the group has nothing left: all is well.
    pub fn healthy(&mut self) {
        self.patience = self.first_patience;
        self.still_since = None;
    }

    /// This consumer holds no partition and the group has `lag` messages left,
    /// `committed` in all so far.
    pub fn idle(&mut self, committed: i64, lag: i64, now: Instant) -> Verdict {
        if lag <= 0 {
            self.healthy();
            return Verdict::Wait;
        }
        match self.still_since {
            Some((seen, since)) if seen == committed => {
                if now.duration_since(since) < self.patience {
                    return Verdict::Wait;
                }
                self.still_since = Some((committed, now));
                self.patience = (self.patience * 2).min(MAX_PATIENCE);
                Verdict::Rejoin
            }
            _ => {
                self.still_since = Some((committed, now));
                Verdict::Wait
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: Duration = Duration::from_secs(12);

    #[test]
    fn a_backlog_standing_still_past_the_patience_asks_for_a_rejoin() {
        let t0 = Instant::now();
        let mut w = StallWatch::new(P);
        assert_eq!(w.idle(5, 3, t0), Verdict::Wait);
        assert_eq!(
            w.idle(5, 3, t0 + P - Duration::from_millis(1)),
            Verdict::Wait
        );
        assert_eq!(w.idle(5, 3, t0 + P), Verdict::Rejoin);
    }

    #[test]
    fn commits_that_move_mean_another_member_drains() {
        let t0 = Instant::now();
        let mut w = StallWatch::new(P);
        for i in 0..10 {
            assert_eq!(w.idle(i, 3, t0 + P * i as u32), Verdict::Wait);
        }
    }

    #[test]
    fn no_backlog_means_no_rejoin() {
        let t0 = Instant::now();
        let mut w = StallWatch::new(P);
        for i in 0..10 {
            assert_eq!(w.idle(5, 0, t0 + P * i), Verdict::Wait);
        }
    }

    #[test]
    fn each_rejoin_doubles_the_patience_up_to_the_cap_and_health_resets_it() {
        let t0 = Instant::now();
        let mut w = StallWatch::new(P);
        w.idle(5, 3, t0);
        let mut t = t0 + P;
        assert_eq!(w.idle(5, 3, t), Verdict::Rejoin);
        assert_eq!(w.idle(5, 3, t + P), Verdict::Wait);
        assert_eq!(w.idle(5, 3, t + P * 2), Verdict::Rejoin);
        t += P * 2;
        for _ in 0..10 {
            t += MAX_PATIENCE;
            assert_eq!(w.idle(5, 3, t), Verdict::Rejoin);
        }
        assert_eq!(w.idle(5, 3, t + MAX_PATIENCE / 2), Verdict::Wait);
        w.healthy();
        w.idle(5, 3, t);
        assert_eq!(w.idle(5, 3, t + P), Verdict::Rejoin);
    }
}
