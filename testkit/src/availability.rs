//! Time without service: what a new buyer sees through a fault.
//!
//! A fault costs availability from the moment it strikes (or, for a fault that
//! lasts, from the moment it ends) until a new buyer gets an answer other than a
//! `5xx` or a lost connection. Every reservation answer a harness records is a
//! [`Sample`] with the instants it was sent and received; [`Outage::measure`]
//! reads the time without service off them. Between the load's requests, a
//! [`Prober`] sends one new buyer's reservation at a steady pace (none waiting for
//! the one before), so a sale whose load is over, or a load that is stuck waiting,
//! still shows when service came back.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use flashsale::auth::Auth;

use crate::api::{Api, Caller};
use crate::invariants::Answer;

/// A fault's outage begins within this of its mark: a kill or a restart bites at
/// once, and so does whatever is left of a fault that lasted.
pub const BITES_WITHIN: Duration = Duration::from_secs(1);

/// One reservation answer, with when it was asked and answered.
#[derive(Debug, Clone)]
pub struct Sample {
    pub sent: Instant,
    pub received: Instant,
    pub answer: Answer,
    /// Which of the caller's targets (instances) it went to.
    pub via: usize,
}

impl Sample {
    /// Sends one request to target `via` and records its answer and timing.
    pub async fn take(request: reqwest::RequestBuilder, via: usize) -> Sample {
        let sent = Instant::now();
        let answer = Answer::from_response(request.send().await).await;
        Sample {
            sent,
            received: Instant::now(),
            answer,
            via,
        }
    }

    /// A real answer: not a `5xx`, not a lost connection.
    pub fn served(&self) -> bool {
        matches!(self.answer.status, Some(s) if s < 500)
    }

    /// Milliseconds from `mark` to the answer; negative for one that came before.
    pub fn received_ms_from(&self, mark: Instant) -> i64 {
        if self.received >= mark {
            self.received.duration_since(mark).as_millis() as i64
        } else {
            -(mark.duration_since(self.received).as_millis() as i64)
        }
    }
}

/// What a fault cost the buyers, read off the samples.
#[derive(Debug, Clone, Default)]
pub struct Outage {
    /// From the mark to the first real answer to a request sent at or after it;
    /// `None` when no such answer came at all.
    pub gap: Option<Duration>,
    /// After service came back, the longest a new buyer then waited again for a
    /// real answer (zero when no later request went unserved).
    pub later_gap: Duration,
    /// Answers counted, and how many of them were `5xx` or lost connections.
    pub answers: usize,
    pub unserved: usize,
}

impl Outage {
    /// Every request sent at or after `mark` that went unserved opens a stretch
    /// without service, which lasts until the first real answer to a request
    /// sent at or after it; overlapping stretches are one outage. The time
    /// without service runs from the mark to the end of the last outage that
    /// begins within [`BITES_WITHIN`] of it (or, with none, to the first real
    /// answer); any outage after those is a later gap.
    pub fn measure(samples: &[Sample], mark: Instant) -> Outage {
        let mut served: Vec<&Sample> = samples.iter().filter(|s| s.served()).collect();
        served.sort_by_key(|s| s.sent);
        // The earliest real answer to a request sent at or after `t`.
        let back_after = |t: Instant| -> Option<Instant> {
            let first = served.partition_point(|s| s.sent < t);
            served[first..].iter().map(|s| s.received).min()
        };
        let mut unserved: Vec<&Sample> = samples
            .iter()
            .filter(|s| !s.served() && s.sent >= mark)
            .collect();
        unserved.sort_by_key(|s| s.sent);
        // Outages as (start, end); `None` as an end: service never came back.
        let mut outages: Vec<(Instant, Option<Instant>)> = Vec::new();
        for u in unserved {
            let end = back_after(u.sent);
            match outages.last_mut() {
                Some((_, last_end)) if last_end.is_none_or(|e| u.sent <= e) => {
                    *last_end = match (*last_end, end) {
                        (Some(a), Some(b)) => Some(a.max(b)),
                        _ => None,
                    };
                }
                _ => outages.push((u.sent, end)),
            }
        }
        // The fault's own outages are those that begin as it bites: a few
        // requests answered in that moment do not mean service is back.
        let own = outages
            .iter()
            .take_while(|(start, _)| start.saturating_duration_since(mark) <= BITES_WITHIN)
            .count();
        let (gap, later) = match outages[..own].last() {
            Some((_, end)) => (
                end.map(|e| e.saturating_duration_since(mark)),
                &outages[own..],
            ),
            None => (
                back_after(mark).map(|f| f.saturating_duration_since(mark)),
                &outages[..],
            ),
        };
        let later_gap = later
            .iter()
            .map(|(start, end)| match end {
                Some(e) => e.saturating_duration_since(*start),
                None => Duration::MAX,
            })
            .max()
            .unwrap_or(Duration::ZERO);
        Outage {
            gap,
            later_gap,
            answers: samples.len(),
            unserved: samples.iter().filter(|s| !s.served()).count(),
        }
    }

    /// The share of answers that were `5xx` or lost, in per cent.
    pub fn unserved_percent(&self) -> f64 {
        if self.answers == 0 {
            return 0.0;
        }
        100.0 * self.unserved as f64 / self.answers as f64
    }

    /// Answers per `step` from the mark, as `+0.00 s 12/3` (served / not), for a
    /// person reading a failure.
    pub fn timeline(samples: &[Sample], mark: Instant, step: Duration) -> String {
        let mut buckets: std::collections::BTreeMap<i64, (usize, usize)> = Default::default();
        let step_ms = step.as_millis().max(1) as i64;
        for s in samples {
            let at = s.received_ms_from(mark);
            let b = buckets.entry(at.div_euclid(step_ms)).or_default();
            if s.served() {
                b.0 += 1;
            } else {
                b.1 += 1;
            }
        }
        buckets
            .iter()
            .map(|(k, (ok, bad))| format!("{:+.2} s {ok}/{bad}", (*k * step_ms) as f64 / 1000.0))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// `Ok` when service came back within `bound` and never went away again for
    /// longer than `later`.
    pub fn within(&self, bound: Duration, later: Duration) -> Result<(), String> {
        match self.gap {
            None => Err(format!(
                "no new buyer was served after the fault ({} of {} answers 5xx or lost)",
                self.unserved, self.answers
            )),
            Some(gap) if gap > bound => Err(format!(
                "time without service {:.2} s, above the target of {:.2} s",
                gap.as_secs_f64(),
                bound.as_secs_f64()
            )),
            Some(_) if self.later_gap > later => Err(format!(
                "service came back, then went away again for {:.2} s (bound {:.2} s)",
                self.later_gap.as_secs_f64(),
                later.as_secs_f64()
            )),
            Some(_) => Ok(()),
        }
    }
}

/// New buyers at a steady pace, round-robin over `targets`, until stopped.
pub struct Prober {
    samples: Arc<Mutex<Vec<Sample>>>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Prober {
    /// `users` names each buyer (`probe-0`, `probe-1`, … under a prefix of the
    /// caller's): a new one for every request.
    pub fn start(
        client: reqwest::Client,
        targets: Vec<String>,
        sku: String,
        auth: Auth,
        users: String,
        every: Duration,
    ) -> Prober {
        let apis: Vec<Api> = targets
            .iter()
            .map(|base| Api::new(client.clone(), base, "").with_users(auth.clone()))
            .collect();
        let samples = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let task = {
            let (samples, stop) = (samples.clone(), stop.clone());
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(every);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                let mut requests = Vec::new();
                let mut i = 0usize;
                while !stop.load(Ordering::SeqCst) && !apis.is_empty() {
                    tick.tick().await;
                    let via = i % apis.len();
                    let request = apis[via].reserve(&sku, Caller::User(&format!("{users}{i}")));
                    let samples = samples.clone();
                    requests.push(tokio::spawn(async move {
                        let sample = Sample::take(request, via).await;
                        samples
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .push(sample);
                    }));
                    i += 1;
                }
                for r in requests {
                    let _ = r.await;
                }
            })
        };
        Prober {
            samples,
            stop,
            task,
        }
    }

    /// The answers so far.
    pub fn samples(&self) -> Vec<Sample> {
        self.samples
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Stops sending, waits for the answers in flight, and returns them all.
    pub async fn stop(self) -> Vec<Sample> {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.task.await;
        std::mem::take(&mut *self.samples.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(base: Instant, sent_ms: u64, took_ms: u64, status: Option<u16>) -> Sample {
        Sample {
            sent: base + Duration::from_millis(sent_ms),
            received: base + Duration::from_millis(sent_ms + took_ms),
            answer: Answer {
                status,
                ..Answer::default()
            },
            via: 0,
        }
    }

    #[test]
    fn the_gap_runs_from_the_mark_to_the_first_real_answer() {
        let t = Instant::now();
        let samples = vec![
            sample(t, 0, 5, Some(202)),
            sample(t, 100, 5, Some(503)),
            sample(t, 200, 900, Some(503)),
            sample(t, 1500, 300, Some(202)),
            sample(t, 1600, 10, Some(409)),
            sample(t, 1700, 10, Some(202)),
        ];
        let o = Outage::measure(&samples, t + Duration::from_millis(100));
        // The 409 sent at 1.6 s arrived at 1.61 s, before the 202 sent at 1.5 s.
        assert_eq!(o.gap, Some(Duration::from_millis(1510)));
        assert_eq!(o.later_gap, Duration::ZERO);
        assert_eq!((o.answers, o.unserved), (6, 2));
        assert!(o.within(Duration::from_secs(2), Duration::ZERO).is_ok());
        assert!(o.within(Duration::from_secs(1), Duration::ZERO).is_err());
    }

    #[test]
    fn a_second_outage_after_service_came_back_is_measured() {
        let t = Instant::now();
        let samples = vec![
            sample(t, 0, 10, Some(202)),
            sample(t, 1500, 10, Some(503)),
            sample(t, 1600, 10, None),
            sample(t, 1700, 10, Some(503)),
            sample(t, 3500, 10, Some(409)),
        ];
        let o = Outage::measure(&samples, t);
        assert_eq!(o.gap, Some(Duration::from_millis(10)));
        assert_eq!(o.later_gap, Duration::from_millis(2010));
        assert!(o
            .within(Duration::from_secs(1), Duration::from_secs(1))
            .is_err());
    }

    #[test]
    fn answers_in_the_moment_before_the_fault_bites_do_not_end_it() {
        let t = Instant::now();
        let mut samples = vec![sample(t, 0, 5, Some(202)), sample(t, 3, 5, Some(202))];
        // One more served between the first failures: still the fault biting.
        samples.push(sample(t, 12, 5, Some(202)));
        samples.push(sample(t, 10, 20, Some(503)));
        samples.extend((1..40).map(|i| sample(t, i * 50, 20, Some(503))));
        samples.push(sample(t, 2400, 100, Some(202)));
        samples.push(sample(t, 2600, 10, Some(202)));
        let o = Outage::measure(&samples, t);
        assert_eq!(o.gap, Some(Duration::from_millis(2500)));
        assert_eq!(o.later_gap, Duration::ZERO);
    }

    #[test]
    fn no_real_answer_after_the_mark_is_no_service() {
        let t = Instant::now();
        let samples = vec![sample(t, 0, 10, Some(202)), sample(t, 50, 10, Some(503))];
        let o = Outage::measure(&samples, t + Duration::from_millis(20));
        assert_eq!(o.gap, None);
        assert!(o.within(Duration::from_secs(60), Duration::ZERO).is_err());
    }
}
