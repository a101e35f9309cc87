//! The one broker quirk the consumer works around: tansu 0.6's coordinator
//! keeps a departed member as a ghost and leaves its partitions with nobody.
//! Everything here acts only under `kafka.broker_quirks = "tansu-0.6"`; against
//! Kafka's own group protocol the consumer never builds any of it, and never
//! rejoins over a live member (one busy retrying MySQL would otherwise stall
//! every partition of the group until it polled again).
//!
//! Three parts: [`Memory`], what the consumer's callbacks remember (the last
//! rebalance, when every broker was last lost); a probe on a client of its own
//! that reads the group's offsets every heartbeat, off the consumer's loop; and
//! [`GhostWatch`], which turns each reading into a verdict ([`stall`]).

mod stall;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use self::stall::{StallWatch, Verdict};
use crate::config::KafkaSettings;
use crate::kafka::{GroupProbe, PartitionOffsets};

/// What the consumer's callbacks tell the watch: when the last assignment or
/// revocation came, and when every broker was first found down in the last
/// outage (a restart leaves ghosts, see [`stall`]).
pub struct Memory {
    last: Mutex<Option<(Instant, bool)>>,
    broker_lost: Mutex<Option<Instant>>,
    /// How long an outage's first failure is remembered ([`begins_outage`]).
    outage_memory: Duration,
}

impl Memory {
    /// `outage_memory`: longer than a session timeout, so that failures repeated
    /// through one outage never move its start past the ghosts' expiry.
    pub fn new(outage_memory: Duration) -> Self {
        Memory {
            last: Mutex::new(None),
            broker_lost: Mutex::new(None),
            outage_memory,
        }
    }

    /// An error the client reported: every broker down begins or continues an
    /// outage (one connection failing is not one).
    pub fn saw_error(&self, error: &KafkaError) {
        if error.rdkafka_error_code() != Some(RDKafkaErrorCode::AllBrokersDown) {
            return;
        }
        let now = Instant::now();
        // A poisoned lock only means a panic elsewhere; the time is still good.
        let assigned = match *self.last.lock().unwrap_or_else(|p| p.into_inner()) {
            Some((at, true)) => Some(at),
            _ => None,
        };
        let mut lost = self.broker_lost.lock().unwrap_or_else(|p| p.into_inner());
        if begins_outage(*lost, assigned, now, self.outage_memory) {
            *lost = Some(now);
        }
    }

    /// A rebalance reached this consumer: an assignment, or a revocation.
    pub fn saw_rebalance(&self, assigned: bool) {
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some((Instant::now(), assigned));
    }

    /// A rebalance is under way (revoked, not yet assigned again, for less than
    /// `patience`) or has just ended (assigned less than `just` ago): this
    /// consumer's assignment says nothing yet.
    fn settling(&self, now: Instant, just: Duration, patience: Duration) -> bool {
        match *self.last.lock().unwrap_or_else(|p| p.into_inner()) {
            Some((at, true)) => now.duration_since(at) < just,
            Some((at, false)) => now.duration_since(at) < patience,
            None => false,
        }
    }

    /// When every member that heartbeated before the last outage this consumer
    /// saw has been dropped by the coordinator: one session timeout after the
    /// connection failed, and a margin.
    fn ghosts_gone(&self, session: Duration, margin: Duration) -> Option<Instant> {
        let lost = *self.broker_lost.lock().unwrap_or_else(|p| p.into_inner());
        lost.map(|at| at + session + margin)
    }
}

/// Whether every broker found down `now` begins a new outage: the first one, one
/// after the group was rebuilt (an assignment since the last outage began), or
/// one longer than `memory` after it began. Failures in between belong to the
/// same outage, whose ghosts are timed from its first failure.
fn begins_outage(
    lost: Option<Instant>,
    assigned: Option<Instant>,
    now: Instant,
    memory: Duration,
) -> bool {
    lost.is_none_or(|at| now.duration_since(at) > memory || assigned.is_some_and(|a| a > at))
}

/// The group's offsets as the probe last read them, and when.
type GroupView = Option<(Instant, Vec<PartitionOffsets>)>;

/// The consumer's side of the watch: the probe's latest reading, the verdicts,
/// and when to look next.
pub struct GhostWatch {
    view: tokio::sync::watch::Receiver<GroupView>,
    stall: StallWatch,
    /// When the consumer should look next (between batches: a rejoin never
    /// revokes a batch half done).
    pub next: Instant,
    every: Duration,
    patience: Duration,
}

impl GhostWatch {
    /// Starts the probe. `every`: how often the group is read and looked at
    /// (the heartbeat); `patience`: how long a partition's backlog may stand
    /// still, held by nobody here, before the consumer rejoins (the session).
    pub fn start(
        kafka: &KafkaSettings,
        every: Duration,
        patience: Duration,
        shutdown: &CancellationToken,
    ) -> Self {
        GhostWatch {
            view: spawn_probe(kafka, every, shutdown),
            stall: StallWatch::new(patience, every * 2, every * 5),
            next: Instant::now() + every,
            every,
            patience,
        }
    }

    /// One look at the latest reading: whether a partition this consumer does
    /// not hold (`held` is what it holds) has messages waiting and nothing
    /// committed for longer than the patience, so that it should leave the
    /// group and join again. Cheap: everything it reads is in memory.
    pub fn look(&mut self, memory: &Memory, held: &HashSet<i32>) -> bool {
        let now = Instant::now();
        self.next = now + self.every;
        let Some((read_at, view)) = self.view.borrow().clone() else {
            return false;
        };
        let settling = memory.settling(now, self.every * 2, self.patience);
        let ghosts_gone = memory.ghosts_gone(self.patience, self.every / 2);
        // A fraction in [0, 1) from the process's random source: members of one
        // fleet do not rejoin in step.
        let jitter =
            (uuid::Uuid::new_v4().as_u128() & ((1 << 53) - 1)) as f64 / (1u64 << 53) as f64;
        let verdict = self
            .stall
            .look(&view, held, settling, ghosts_gone, jitter, read_at);
        if verdict == Verdict::Rejoin {
            let waiting: i64 = view.iter().map(|p| p.lag).sum();
            tracing::warn!(
                waiting,
                "a partition this consumer does not hold has messages nobody commits; rejoining the group"
            );
        }
        verdict == Verdict::Rejoin
    }
}

/// Reads the group's offsets every `every` on a client of its own, off the
/// consumer's loop, so that a slow broker never keeps the consumer from polling
/// (a rebalance waits for every member to poll).
fn spawn_probe(
    kafka: &KafkaSettings,
    every: Duration,
    shutdown: &CancellationToken,
) -> tokio::sync::watch::Receiver<GroupView> {
    let (tx, rx) = tokio::sync::watch::channel(None);
    let probe = match GroupProbe::new(kafka) {
        Ok(p) => Arc::new(p),
        Err(err) => {
            tracing::error!(error = %err, "no group probe: a partition nobody holds will not be noticed");
            return rx;
        }
    };
    let shutdown = shutdown.clone();
    tokio::spawn(async move {
        let mut failing = false;
        let mut first = true;
        loop {
            // The first reading at once: a restarted consumer's clocks start
            // when it does.
            if !std::mem::take(&mut first) {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(every) => {}
                }
            }
            let p = probe.clone();
            let read = tokio::task::spawn_blocking(move || p.read(Duration::from_secs(2))).await;
            let view = match read {
                Ok(Ok(v)) => v,
                Ok(Err(err)) => {
                    if !failing {
                        tracing::warn!(error = %err, "cannot read the consumer group's offsets; the group watch waits");
                    }
                    failing = true;
                    continue;
                }
                Err(err) => {
                    tracing::error!(error = %err, "the group probe task failed");
                    continue;
                }
            };
            if failing {
                tracing::info!("the consumer group's offsets can be read again");
            }
            failing = false;
            if tx.send(Some((Instant::now(), view))).is_err() {
                return;
            }
        }
    });
    rx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_outage_begins_with_its_first_failure_and_again_once_the_group_was_rebuilt() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let memory = s * 24;
        assert!(begins_outage(None, None, t0, memory));
        // Failures repeated through the outage keep its start.
        assert!(!begins_outage(Some(t0), None, t0 + s * 5, memory));
        assert!(!begins_outage(Some(t0 + s), Some(t0), t0 + s * 5, memory));
        // The group was rebuilt since it began: the next failure is a new one.
        assert!(begins_outage(
            Some(t0),
            Some(t0 + s * 3),
            t0 + s * 5,
            memory
        ));
        // Long after it began: a new one.
        assert!(begins_outage(Some(t0), None, t0 + s * 25, memory));
    }
}
