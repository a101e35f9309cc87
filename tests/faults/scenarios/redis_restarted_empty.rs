//! Redis restarts with nothing in memory mid-sale: reservations answer 503, the
//! activity is paused, rebuilt from MySQL once drained, and resumed.

use futures::future::BoxFuture;

use crate::harness::{Fault, Run, Target, REBUILD_BOUND};

pub struct RedisRestartedEmpty;

impl Fault for RedisRestartedEmpty {
    fn id(&self) -> &'static str {
        "redis_restarted_empty"
    }
    fn name(&self) -> &'static str {
        "redis restarted empty"
    }
    fn inject<'a>(&'a self, run: &'a mut Run) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            tokio::task::block_in_place(|| run.redis.restart_empty());
            Ok(())
        })
    }
    fn availability(&self) -> Target {
        Target::within(REBUILD_BOUND)
    }
}
