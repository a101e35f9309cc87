//! Readiness: what this instance's dependencies answered at their last probe.
//!
//! One prober per process checks Redis, MySQL and the broker every
//! [`PROBE_INTERVAL`] and keeps each answer with its time; `/readyz` reads these
//! answers, so a flood of probes costs the database, the broker and Redis
//! nothing (each `/readyz` used to run a statement on the pool that writes
//! orders). Each dependency has its own loop: a check that hangs until its
//! timeout leaves the others' answers fresh.
//!
//! An answer older than [`MAX_AGE`] (a prober delayed on a busy runtime, in the
//! middle of a flash sale's spike) is not reported as "not ready": the first
//! `/readyz` to find it so checks that dependency once more, the others wait for
//! that one check (one at a time per dependency), and all answer from it. Only
//! a dependency whose check fails, or does not answer within [`CHECK_TIMEOUT`],
//! makes the instance not ready; a busy instance is not pulled out of the load
//! balancer for being busy.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::MySqlPool;
use tokio_util::sync::CancellationToken;

use crate::kafka::Publisher;
use crate::periodic;
use crate::stock::StockStore;

/// How often each dependency is checked.
pub const PROBE_INTERVAL: Duration = Duration::from_millis(500);
/// An answer older than this (a check that hangs, a prober that stopped) is no
/// answer: readiness counts the dependency as not ready.
pub const MAX_AGE: Duration = Duration::from_secs(1);
/// The bound of one check.
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// A dependency readiness reports on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dependency {
    Redis,
    Mysql,
    Kafka,
}

impl Dependency {
    pub const ALL: [Dependency; 3] = [Dependency::Redis, Dependency::Mysql, Dependency::Kafka];

    /// The name `/readyz` reports it under.
    pub fn name(self) -> &'static str {
        match self {
            Dependency::Redis => "redis",
            Dependency::Mysql => "mysql",
            Dependency::Kafka => "kafka",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// A dependency's state as of a moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Status {
    /// It answered within the last [`MAX_AGE`].
    Ok,
    /// Its last check, within the last [`MAX_AGE`], failed; the reason.
    Down(String),
    /// No check has finished yet, or the last one finished longer ago than
    /// [`MAX_AGE`].
    Unknown,
}

impl Status {
    /// `ok`, `down` or `unknown`, as `/readyz` names it.
    pub fn label(&self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Down(_) => "down",
            Status::Unknown => "unknown",
        }
    }
}

struct Answer {
    at: Instant,
    outcome: Result<(), String>,
}

/// The last answer of each dependency, shared by the prober and `/readyz`.
#[derive(Clone, Default)]
pub struct Readiness {
    // A std mutex: held only to copy or replace one small value, never across an
    // await.
    last: Arc<[Mutex<Option<Answer>>; 3]>,
    /// Held while a stale answer is checked again from `/readyz`.
    refreshing: Arc<[tokio::sync::Mutex<()>; 3]>,
    checks: Arc<std::sync::OnceLock<Checks>>,
    /// What the start found wrong but not fatal (an evicting Redis), shown by
    /// `/readyz` beside the checks.
    warnings: Arc<Mutex<Vec<String>>>,
}

/// What the prober checks each dependency with.
struct Checks {
    stock: StockStore,
    pool: MySqlPool,
    publisher: Publisher,
}

impl Checks {
    async fn check(&self, dependency: Dependency) -> Result<(), String> {
        let check = async {
            match dependency {
                Dependency::Redis => self.stock.ping().await.map_err(|e| e.to_string()),
                Dependency::Mysql => sqlx::query("SELECT 1")
                    .execute(&self.pool)
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string()),
                Dependency::Kafka => self.publisher.check().await.map_err(|e| format!("{e:#}")),
            }
        };
        match tokio::time::timeout(CHECK_TIMEOUT, check).await {
            Ok(outcome) => outcome,
            Err(_) => Err(format!("no answer within {CHECK_TIMEOUT:?}")),
        }
    }
}

impl Readiness {
    /// Shows `warning` on every `/readyz` from now on.
    pub fn warn(&self, warning: String) {
        self.warnings
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(warning);
    }

    pub fn warnings(&self) -> Vec<String> {
        self.warnings
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Keeps `outcome` as `dependency`'s answer at `at`. Returns the previous
    /// outcome when this one differs from it (for the log), `None` otherwise.
    pub fn record(
        &self,
        dependency: Dependency,
        outcome: Result<(), String>,
        at: Instant,
    ) -> Option<Option<Result<(), String>>> {
        let mut slot = self.last[dependency.index()]
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let previous = slot.as_ref().map(|a| a.outcome.clone());
        let changed = previous.as_ref().map(Result::is_ok) != Some(outcome.is_ok());
        *slot = Some(Answer { at, outcome });
        changed.then_some(previous)
    }

    /// `dependency`'s state now: the last answer, or, when it is older than
    /// [`MAX_AGE`] and the prober runs, one more check shared by every caller
    /// that finds it so.
    pub async fn current(&self, dependency: Dependency) -> Status {
        let status = self.status(dependency, Instant::now());
        let Some(checks) = self.checks.get() else {
            return status;
        };
        if status != Status::Unknown {
            return status;
        }
        let _one_at_a_time = self.refreshing[dependency.index()].lock().await;
        let status = self.status(dependency, Instant::now());
        if status != Status::Unknown {
            return status;
        }
        let outcome = checks.check(dependency).await;
        log_change(
            dependency,
            outcome.as_ref().err().cloned(),
            self.record(dependency, outcome, Instant::now()),
        );
        self.status(dependency, Instant::now())
    }

    /// `dependency`'s state as of `now`.
    pub fn status(&self, dependency: Dependency, now: Instant) -> Status {
        let slot = self.last[dependency.index()]
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        match slot.as_ref() {
            Some(a) if now.saturating_duration_since(a.at) <= MAX_AGE => match &a.outcome {
                Ok(()) => Status::Ok,
                Err(reason) => Status::Down(reason.clone()),
            },
            _ => Status::Unknown,
        }
    }
}

/// The prober: checks each dependency every [`PROBE_INTERVAL`], each within
/// [`CHECK_TIMEOUT`], until `shutdown`. A change of state is logged once, not at
/// every probe.
pub async fn run(
    readiness: Readiness,
    stock: StockStore,
    pool: MySqlPool,
    publisher: Publisher,
    shutdown: CancellationToken,
) {
    let checks = readiness.checks.get_or_init(|| Checks {
        stock,
        pool,
        publisher,
    });
    let probes = Dependency::ALL.map(|dependency| {
        let (readiness, shutdown) = (readiness.clone(), shutdown.clone());
        async move {
            periodic::every(PROBE_INTERVAL, shutdown, || async {
                let outcome = checks.check(dependency).await;
                let failure = outcome.as_ref().err().cloned();
                log_change(
                    dependency,
                    failure,
                    readiness.record(dependency, outcome, Instant::now()),
                );
            })
            .await;
        }
    });
    let [redis, mysql, kafka] = probes;
    tokio::join!(redis, mysql, kafka);
}

/// Logs a change of state once (`changed` is what [`Readiness::record`] returned).
fn log_change(
    dependency: Dependency,
    failure: Option<String>,
    changed: Option<Option<Result<(), String>>>,
) {
    let Some(previous) = changed else {
        return;
    };
    match failure {
        Some(reason) => {
            tracing::warn!(dependency = dependency.name(), %reason, "not ready: a dependency does not answer")
        }
        None if previous.is_some() => {
            tracing::info!(dependency = dependency.name(), "a dependency answers again")
        }
        None => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ago(d: Duration) -> Instant {
        Instant::now()
            .checked_sub(d)
            .expect("the clock runs longer than the test's delays")
    }

    #[test]
    fn no_answer_yet_is_unknown() {
        let r = Readiness::default();
        for d in Dependency::ALL {
            assert_eq!(r.status(d, Instant::now()), Status::Unknown);
        }
    }

    #[test]
    fn a_fresh_answer_is_the_state() {
        let r = Readiness::default();
        r.record(Dependency::Redis, Ok(()), Instant::now());
        r.record(Dependency::Mysql, Err("refused".into()), Instant::now());
        let now = Instant::now();
        assert_eq!(r.status(Dependency::Redis, now), Status::Ok);
        assert_eq!(
            r.status(Dependency::Mysql, now),
            Status::Down("refused".into())
        );
        assert_eq!(r.status(Dependency::Kafka, now), Status::Unknown);
    }

    #[test]
    fn an_answer_older_than_a_second_is_unknown() {
        let r = Readiness::default();
        r.record(Dependency::Kafka, Ok(()), ago(Duration::from_millis(900)));
        assert_eq!(r.status(Dependency::Kafka, Instant::now()), Status::Ok);
        r.record(Dependency::Kafka, Ok(()), ago(Duration::from_millis(1100)));
        assert_eq!(r.status(Dependency::Kafka, Instant::now()), Status::Unknown);
        r.record(
            Dependency::Kafka,
            Err("down".into()),
            ago(Duration::from_secs(5)),
        );
        assert_eq!(r.status(Dependency::Kafka, Instant::now()), Status::Unknown);
    }

    #[test]
    fn only_a_change_of_state_is_reported() {
        let r = Readiness::default();
        assert_eq!(
            r.record(Dependency::Redis, Ok(()), Instant::now()),
            Some(None)
        );
        assert_eq!(r.record(Dependency::Redis, Ok(()), Instant::now()), None);
        assert_eq!(
            r.record(Dependency::Redis, Err("a".into()), Instant::now()),
            Some(Some(Ok(())))
        );
        assert_eq!(
            r.record(Dependency::Redis, Err("b".into()), Instant::now()),
            None
        );
        assert_eq!(
            r.record(Dependency::Redis, Ok(()), Instant::now()),
            Some(Some(Err("b".into())))
        );
    }
}
