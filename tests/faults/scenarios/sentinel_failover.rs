//! Redis under Sentinel (a primary, two replicas, three sentinels): the primary
//! is SIGKILLed mid-sale; the sentinels promote a replica and the services find
//! it through them. Its supervisor then restarts the dead node on its old
//! address, empty, and the sentinels turn it into a replica. With the default
//! `redis.min_replicas_acked = auto` every `202` was on a replica first.

use std::time::Duration;

use futures::future::BoxFuture;

use crate::harness::{Fault, Run, Setup, Target, FAILOVER_BOUND, NONE_BOUND, PROMOTED_BOUND};

pub struct SentinelFailover;

impl Fault for SentinelFailover {
    fn id(&self) -> &'static str {
        "sentinel_failover"
    }
    fn name(&self) -> &'static str {
        "redis sentinel primary killed, replica promoted"
    }
    fn prepare(&self, setup: &mut Setup) {
        setup.redis_sentinel = true;
        setup.set("FLASHSALE__REDIS__REPLICA_ACK_TIMEOUT_MS", 1000);
    }
    fn inject<'a>(&'a self, run: &'a mut Run) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let sentinel = run.sentinel.as_mut().ok_or("no sentinels")?;
            let primary = tokio::task::block_in_place(|| sentinel.primary())
                .ok_or("the sentinels name no primary")?;
            sentinel.kill(primary);
            let sentinel = run.sentinel.as_ref().ok_or("no sentinels")?;
            testkit::within(
                Duration::from_secs(30),
                "the sentinels to promote a replica",
                || async {
                    let moved = tokio::task::block_in_place(|| sentinel.switched_from(primary));
                    moved.then_some(())
                },
            )
            .await?;
            // Redis's part of the fault is over: from here on it is the service's.
            run.fault_over();
            let sentinel = run.sentinel.as_mut().ok_or("no sentinels")?;
            tokio::task::block_in_place(|| sentinel.restart(primary));
            let sentinel = run.sentinel.as_ref().ok_or("no sentinels")?;
            tokio::task::block_in_place(|| sentinel.wait_healthy(Duration::from_secs(30)))?;
            Ok(())
        })
    }
    /// Counted from the promotion and from the kill, with no second gap when
    /// the node comes back.
    fn availability(&self) -> Target {
        Target {
            bound: PROMOTED_BOUND,
            later: NONE_BOUND,
            from_fault: Some(FAILOVER_BOUND),
        }
    }
}
