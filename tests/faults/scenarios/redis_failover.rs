//! The Redis primary fails over to a replica that missed writes: the replica is
//! stalled (SIGSTOP) so it falls behind, the primary is SIGKILLed, the replica is
//! resumed and promoted, and the address the services use (a relay, as a virtual
//! IP would be) moves to it; a new replica joins it. With the default
//! configuration (`redis.min_replicas_acked = auto`, a 200 ms wait), no `202`
//! was answered without the replica holding it while it was connected;
//! reservations the replica missed were never acknowledged, and any order one
//! became anyway is adopted back into Redis by the consumer. Until the new
//! replica has synchronised, the promoted primary answers without waiting.

use std::time::Duration;

use futures::future::BoxFuture;

use testkit::process::Redis;

use crate::harness::{Fault, Run, Setup, Target, REBUILD_BOUND};

pub struct RedisFailover;

impl Fault for RedisFailover {
    fn id(&self) -> &'static str {
        "redis_failover"
    }
    fn name(&self) -> &'static str {
        "redis primary fails over to a lagging replica"
    }
    fn prepare(&self, setup: &mut Setup) {
        setup.redis_replica = true;
    }
    fn inject<'a>(&'a self, run: &'a mut Run) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let replica = run.replica.as_mut().ok_or("no replica")?;
            replica.pause();
            tokio::time::sleep(Duration::from_millis(800)).await;
            run.redis.kill();
            let mut promoted = run.replica.take().ok_or("no replica")?;
            promoted.resume();
            promoted.promote().await?;
            let to = format!("127.0.0.1:{}", promoted.port);
            run.redis_relay.as_ref().ok_or("no relay")?.retarget(&to);
            // The failover is done: service counts from here.
            run.fault_over();
            // The new primary gets a replica of its own, so the sale goes on.
            let dir = run.dir.path().to_owned();
            let port = promoted.port;
            run.replica = Some(tokio::task::block_in_place(|| {
                Redis::start_replica(&dir, port)
            }));
            run.redis = promoted;
            Ok(())
        })
    }
    /// A promoted replica that missed writes is rebuilt like a Redis that
    /// restarted empty: the wait for publishes in flight, then the build.
    fn availability(&self) -> Target {
        Target::within(REBUILD_BOUND)
    }
    fn expect(&self, _run: &Run, f: &testkit::invariants::Figures) -> Result<(), String> {
        // The sale goes on after the failover: every unit is sold.
        if f.live_orders < i64::from(crate::harness::STOCK) {
            return Err(format!(
                "the sale stopped after the failover: {} units sold, answers {:?}",
                f.live_orders, f.answers
            ));
        }
        Ok(())
    }
}
