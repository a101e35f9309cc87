//! The one clock every instance judges time by (docs/API.md, version 4): Redis's.
//!
//! Instances' own clocks drift, and an instance ahead of the others would open a
//! sale early, close it early and expire turns the others gave. So every time
//! rule (a sale's window, turns, payment and pending deadlines, loans' grace,
//! tokens' `exp` and `nbf`) asks [`Clock::now`], which is Redis's `TIME` as last
//! sampled, carried forward by this process's monotonic clock: sampling once a
//! second costs Redis one command a second per instance, and a request costs
//! none. The sample is taken at the middle of its round trip, so it is off by at
//! most half of it; a slow round trip (a busy Redis) is kept only when no better
//! sample is recent. On a Cluster, the script's key routes every instance's
//! sample to the same node, the one owning [`CLOCK_KEY`]'s slot.
//!
//! Until the first sample (a Redis down when the process starts) the instance's
//! own clock stands in, and a warning says so. Redis down later changes nothing:
//! the last sample is carried forward.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use chrono::{DateTime, TimeZone, Utc};
use redis::RedisResult;
use tokio_util::sync::CancellationToken;

use crate::periodic;
use crate::stock::RedisConn;

/// The key whose slot picks the node every instance reads the time from.
pub const CLOCK_KEY: &str = "flash:{clock}";
/// How often the clock is sampled.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(1);
/// A sample whose round trip took longer than this replaces a better one only
/// once that one is older than [`KEEP_GOOD_SAMPLE`].
const GOOD_ROUND_TRIP: Duration = Duration::from_millis(20);
const KEEP_GOOD_SAMPLE: Duration = Duration::from_secs(30);

const TIME: &str = "return redis.call('TIME')";

#[derive(Clone, Copy, Debug)]
struct Sample {
    /// This process's monotonic clock at the middle of the round trip.
    at: Instant,
    /// Redis's clock then.
    time: DateTime<Utc>,
    round_trip: Duration,
}

/// Cheap to clone; every clone shares the samples.
#[derive(Clone, Default)]
pub struct Clock {
    sample: Arc<RwLock<Option<Sample>>>,
    /// `None`: the instance's own clock (tests and commands that keep no sale).
    redis: Option<RedisConn>,
}

impl Clock {
    /// The shared clock, read from `redis` (sampled by [`Clock::run`]).
    pub fn shared(redis: RedisConn) -> Self {
        Clock {
            sample: Arc::default(),
            redis: Some(redis),
        }
    }

    /// This instance's own clock: for what runs without a Redis.
    pub fn local() -> Self {
        Clock::default()
    }

    /// A clock that says `time` now and runs on from it (tests).
    pub fn fixed_at(time: DateTime<Utc>) -> Self {
        let clock = Clock::default();
        clock.keep(Sample {
            at: Instant::now(),
            time,
            round_trip: Duration::ZERO,
        });
        clock
    }

    /// The shared time now: the last sample carried forward, or this
    /// instance's own clock before any sample.
    pub fn now(&self) -> DateTime<Utc> {
        let sample = *self.sample.read().unwrap_or_else(|p| p.into_inner());
        match sample {
            Some(s) => {
                s.time + chrono::Duration::from_std(s.at.elapsed()).unwrap_or(chrono::Duration::MAX)
            }
            None => Utc::now(),
        }
    }

    /// [`Clock::now`] in Unix milliseconds.
    pub fn now_ms(&self) -> i64 {
        self.now().timestamp_millis()
    }

    /// How far this instance's own clock is ahead of the shared one (negative:
    /// behind), once sampled.
    pub fn own_ahead_by(&self) -> Option<chrono::Duration> {
        self.sampled().then(|| Utc::now() - self.now())
    }

    /// Whether the shared clock has been read at least once.
    pub fn sampled(&self) -> bool {
        self.sample
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    /// Reads Redis's `TIME` once and keeps it if it is at least as good as
    /// the one kept (see the module's comment).
    pub async fn sample_once(&self) -> RedisResult<()> {
        let Some(redis) = &self.redis else {
            return Ok(());
        };
        let mut conn = redis.clone();
        let sent = Instant::now();
        let (secs, micros): (i64, i64) = redis::cmd("EVAL")
            .arg(TIME)
            .arg(1)
            .arg(CLOCK_KEY)
            .query_async(&mut conn)
            .await?;
        let round_trip = sent.elapsed();
        let Some(time) = Utc
            .timestamp_opt(
                secs,
                u32::try_from(micros.clamp(0, 999_999) * 1000).unwrap_or(0),
            )
            .single()
        else {
            return Err(redis::RedisError::from((
                redis::ErrorKind::Parse,
                "TIME answered an impossible time",
            )));
        };
        self.keep(Sample {
            at: sent + round_trip / 2,
            time,
            round_trip,
        });
        Ok(())
    }

    fn keep(&self, new: Sample) {
        let mut kept = self.sample.write().unwrap_or_else(|p| p.into_inner());
        let better = match *kept {
            None => true,
            Some(old) => {
                new.round_trip <= GOOD_ROUND_TRIP.max(old.round_trip)
                    || old.at.elapsed() > KEEP_GOOD_SAMPLE
            }
        };
        if better {
            *kept = Some(new);
        }
    }

    /// Samples now, then every [`SAMPLE_EVERY`] until `shutdown`; logs when this instance's own clock
    /// is more than a second off the shared one, once per change.
    pub async fn run(self, shutdown: CancellationToken) {
        let reported = Arc::new(AtomicBool::new(false));
        periodic::every(SAMPLE_EVERY, shutdown, || {
            let clock = self.clone();
            let reported = reported.clone();
            async move {
                match clock.sample_once().await {
                    Ok(()) => {
                        let ahead = clock.own_ahead_by().unwrap_or_default();
                        metrics::gauge!("flashsale_clock_own_ahead_seconds")
                            .set(ahead.num_milliseconds() as f64 / 1000.0);
                        let skewed = ahead.num_milliseconds().abs() > 1000;
                        if skewed && !reported.swap(true, Ordering::Relaxed) {
                            tracing::warn!(ahead_ms = ahead.num_milliseconds(), "this instance's clock is off the shared clock (Redis TIME) by more than a second; every time rule follows the shared one");
                        }
                        if !skewed {
                            reported.store(false, Ordering::Relaxed);
                        }
                    }
                    Err(err) => {
                        tracing::debug!(error = %err, "could not read the shared clock; carrying the last sample forward");
                    }
                }
            }
        })
        .await;
    }

    /// One sample before serving, at most `within`: a process that answers
    /// before it has one would judge by its own clock.
    pub async fn first_sample(&self, within: Duration) {
        if self.redis.is_none() {
            return;
        }
        match tokio::time::timeout(within, self.sample_once()).await {
            Ok(Ok(())) => {}
            Ok(Err(err)) => {
                tracing::warn!(error = %err, "could not read the shared clock (Redis TIME) at start; this instance's own clock stands in until it can")
            }
            Err(_) => tracing::warn!(
                "the shared clock (Redis TIME) did not answer at start; this instance's own clock stands in until it does"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fixed_clock_runs_on_from_its_time() {
        let start = Utc
            .with_ymd_and_hms(2030, 1, 1, 0, 0, 0)
            .single()
            .expect("a time");
        let clock = Clock::fixed_at(start);
        let now = clock.now();
        assert!(now >= start && now - start < chrono::Duration::seconds(5));
    }

    #[test]
    fn a_slow_round_trip_does_not_replace_a_recent_good_sample() {
        let clock = Clock::default();
        let good = Utc
            .with_ymd_and_hms(2030, 1, 1, 0, 0, 0)
            .single()
            .expect("a time");
        clock.keep(Sample {
            at: Instant::now(),
            time: good,
            round_trip: Duration::from_millis(1),
        });
        clock.keep(Sample {
            at: Instant::now(),
            time: good + chrono::Duration::seconds(10),
            round_trip: Duration::from_millis(400),
        });
        assert!(clock.now() - good < chrono::Duration::seconds(5));
        clock.keep(Sample {
            at: Instant::now(),
            time: good + chrono::Duration::seconds(10),
            round_trip: Duration::from_millis(2),
        });
        assert!(clock.now() - good >= chrono::Duration::seconds(10));
    }

    #[test]
    fn without_a_sample_the_own_clock_stands_in() {
        let clock = Clock::local();
        assert!(!clock.sampled());
        assert!((clock.now() - Utc::now()).num_seconds().abs() <= 1);
        assert!(clock.own_ahead_by().is_none());
    }
}
