//! Redis restarts empty mid-sale under two service instances, each with its
//! reconciler (and the CLI's, and the admin endpoint's on both, hammered):
//! one of them rebuilds the sale, the other resumes as soon as the build is in
//! Redis, and exactly one build is written for the one loss. A second build
//! would mean a second pause, answered `503` to buyers.

use futures::future::BoxFuture;

use crate::harness::{Fault, Run, Setup, Target, REBUILD_BOUND};

pub struct RedisRestartedEmptyTwo;

impl Fault for RedisRestartedEmptyTwo {
    fn id(&self) -> &'static str {
        "redis_restarted_empty_two"
    }
    fn name(&self) -> &'static str {
        "redis restarted empty, two services"
    }
    fn prepare(&self, setup: &mut Setup) {
        setup.services = 2;
    }
    fn inject<'a>(&'a self, run: &'a mut Run) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            tokio::task::block_in_place(|| run.redis.restart_empty());
            Ok(())
        })
    }
    fn after<'a>(&'a self, run: &'a mut Run) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            // Summed over both instances (their reconcilers and admin endpoints).
            for name in [
                "flashsale_activity_rebuilt_total",
                "flashsale_activity_auto_paused_total",
                "flashsale_redis_stale_state_total",
            ] {
                let mut sum = 0.0;
                for i in 0..run.services.len() {
                    sum += run.metric_of(i, name).await;
                }
                run.background_counts.push(sum as usize);
            }
            Ok(())
        })
    }
    fn expect(&self, run: &Run, _f: &testkit::invariants::Figures) -> Result<(), String> {
        // One build for the one loss (none here if the CLI's pass built it), one
        // automatic pause at most, and never a forced rebuild over a state taken
        // for stale: each of those would be a second pause.
        match run.background_counts[..] {
            [rebuilt, paused, stale] if rebuilt <= 1 && paused <= 1 && stale == 0 => Ok(()),
            ref counts => Err(format!(
                "for one loss: rebuilds, automatic pauses, stale states = {counts:?} (at most 1, 1, 0)"
            )),
        }
    }
    fn availability(&self) -> Target {
        Target::within(REBUILD_BOUND)
    }
}
