//! The consumer's pace into MySQL: the orders are the service's, the database
//! is everyone's (the seed's "不能影响其他业务"). Two limits, each a pause after a
//! batch, so the backlog shows as consumer lag and never as a refused
//! reservation:
//! - a budget, `consumer.max_orders_per_sec` (off by default): batches of at most
//!   a tenth of a second's worth, each followed by the rest of its share of time;
//! - an adaptive limit, `consumer.adaptive_pace` (off by default until the
//!   benchmark has measured it against another service's queries): additive
//!   increase, multiplicative decrease of the share of time spent writing,
//!   judged by the time per message of batches large enough that a
//!   transaction's fixed cost does not dominate, against their usual time (a
//!   slowly moving average, so that one cheap batch, of duplicates say, does not
//!   make every later one look slow).
//!
//! No I/O here: the consumer reports each batch and sleeps what it is told.

use std::time::Duration;

/// The least share of time spent writing: the consumer never stops.
const LEAST_DUTY: f64 = 0.05;
/// Back off when a message takes this many times the usual.
const SLOWER: f64 = 2.0;
/// How much of the share of time is won back per batch that was not slow.
const RECOVER_STEP: f64 = 0.05;
/// How much of it a slow batch keeps.
const BACK_OFF: f64 = 0.7;
/// How far one batch moves the usual time: a normal one, and a slow one (a
/// slowdown that lasts becomes the usual, over a few hundred batches).
const LEARN: f64 = 0.05;
const LEARN_SLOW: f64 = 0.005;
/// Batches smaller than this are not judged (a transaction's fixed cost).
const JUDGED_FROM: usize = 20;
/// The longest pause after one batch (a consumer must keep polling its group).
const LONGEST_PAUSE: Duration = Duration::from_secs(1);

#[derive(Debug, Clone)]
pub struct Pace {
    /// Orders a second at most (`None`: no budget).
    budget: Option<f64>,
    /// Whether the adaptive limit is on.
    adaptive: bool,
    /// The share of time spent writing (1: no pause).
    duty: f64,
    /// The usual time per message, in seconds.
    usual: Option<f64>,
}

impl Pace {
    pub fn new(max_orders_per_sec: u32, adaptive: bool) -> Self {
        Pace {
            budget: (max_orders_per_sec > 0).then_some(f64::from(max_orders_per_sec)),
            adaptive,
            duty: 1.0,
            usual: None,
        }
    }

    /// The most messages a batch takes: with a budget, a tenth of a second's
    /// worth (at least one), so the pace is smooth rather than a burst and a
    /// long pause.
    pub fn batch_limit(&self, batch_size: usize) -> usize {
        match self.budget {
            Some(per_sec) => batch_size.min(((per_sec / 10.0).ceil() as usize).max(1)),
            None => batch_size,
        }
    }

    /// The share of time spent writing now.
    pub fn duty(&self) -> f64 {
        self.duty
    }

    /// The pause after a batch of `messages` whose write to MySQL took `took`.
    pub fn after(&mut self, messages: usize, took: Duration) -> Duration {
        let took_secs = took.as_secs_f64();
        let mut pause = 0.0_f64;
        if self.adaptive && messages >= JUDGED_FROM {
            let per_message = took_secs / messages as f64;
            let usual = self.usual.unwrap_or(per_message);
            let slow = per_message > usual * SLOWER;
            let learn = if slow { LEARN_SLOW } else { LEARN };
            self.usual = Some(usual + (per_message - usual) * learn);
            self.duty = if slow {
                (self.duty * BACK_OFF).max(LEAST_DUTY)
            } else {
                (self.duty + RECOVER_STEP).min(1.0)
            };
        }
        if self.adaptive {
            pause = pause.max(took_secs * (1.0 / self.duty - 1.0));
        }
        if let Some(per_sec) = self.budget {
            pause = pause.max(messages as f64 / per_sec - took_secs);
        }
        Duration::from_secs_f64(pause.max(0.0)).min(LONGEST_PAUSE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn without_budget_or_slowdown_there_is_no_pause() {
        let mut p = Pace::new(0, true);
        for _ in 0..50 {
            assert_eq!(p.after(100, ms(20)), Duration::ZERO);
        }
        assert_eq!(p.batch_limit(200), 200);
        let mut off = Pace::new(0, false);
        assert_eq!(off.after(100, ms(2_000)), Duration::ZERO);
    }

    #[test]
    fn a_budget_spreads_the_orders_over_time() {
        let mut p = Pace::new(50, false);
        assert_eq!(p.batch_limit(200), 5, "a tenth of a second's worth");
        // 5 orders at 50 a second: 100 ms each batch, the write's time included.
        assert_eq!(p.after(5, ms(20)), ms(80));
        assert_eq!(p.after(5, ms(150)), Duration::ZERO);
        // So 10 batches of 5 take a second.
        let total: Duration = (0..10).map(|_| p.after(5, ms(10)) + ms(10)).sum();
        assert!(total.abs_diff(Duration::from_secs(1)) < ms(1), "{total:?}");
        assert_eq!(Pace::new(3, false).batch_limit(200), 1);
    }

    #[test]
    fn commits_that_slow_down_make_the_consumer_back_off_and_recover_after() {
        let mut p = Pace::new(0, true);
        for _ in 0..10 {
            p.after(100, ms(20));
        }
        assert_eq!(p.duty(), 1.0);
        // MySQL slows down fivefold: the share of time writing falls, and the
        // pauses grow, batch after batch.
        let mut last = Duration::ZERO;
        for _ in 0..5 {
            let pause = p.after(100, ms(100));
            assert!(pause > last, "{pause:?} after {last:?}");
            last = pause;
        }
        assert!(p.duty() < 0.2, "{}", p.duty());
        // Never stopped: at least a twentieth of the time, at most a second.
        for _ in 0..50 {
            let pause = p.after(100, ms(100));
            assert!(pause <= LONGEST_PAUSE);
        }
        assert!(p.duty() >= LEAST_DUTY);
        // Back to normal: the share grows back step by step.
        for _ in 0..30 {
            p.after(100, ms(20));
        }
        assert_eq!(p.duty(), 1.0);
        assert_eq!(p.after(100, ms(20)), Duration::ZERO);
    }

    #[test]
    fn a_bigger_batch_is_no_slowdown() {
        let mut p = Pace::new(0, true);
        p.after(20, ms(10));
        // Five times the messages in five times the time: the same per message.
        assert_eq!(p.after(100, ms(50)), Duration::ZERO);
        assert_eq!(p.duty(), 1.0);
    }

    #[test]
    fn one_cheap_batch_does_not_make_the_usual_ones_look_slow() {
        let mut p = Pace::new(0, true);
        for _ in 0..20 {
            p.after(100, ms(20));
        }
        // A batch of duplicates: nothing written, a tenth of the time.
        p.after(100, ms(2));
        for _ in 0..20 {
            assert_eq!(p.after(100, ms(20)), Duration::ZERO);
        }
        assert_eq!(p.duty(), 1.0);
        // And small batches are not judged at all.
        assert_eq!(p.after(3, ms(500)), Duration::ZERO);
    }
}
