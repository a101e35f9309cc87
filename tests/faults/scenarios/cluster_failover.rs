//! On a Redis Cluster of its own (3 primaries, 2 replicas each), the primary
//! that owns the sale's slot is SIGKILLed mid-sale; the cluster promotes one of
//! its replicas, the other follows it, and the sale goes on. With the default
//! `redis.min_replicas_acked = auto` every `202` was on a replica first.
//!
//! Its second form sells a sale split over 3 stock shards (one per primary) and
//! kills the primary of shard 1 mid-sale: the other shards keep selling and
//! lending, and nothing is lost.

use std::time::Duration;

use futures::future::BoxFuture;

use crate::harness::{Fault, Run, Setup, Target, FAILOVER_BOUND, NONE_BOUND, PROMOTED_BOUND};

pub struct ClusterFailover {
    /// The sale's stock shards; the primary of the last one is killed.
    pub shards: u8,
}

impl Fault for ClusterFailover {
    fn id(&self) -> &'static str {
        if self.shards > 1 {
            "cluster_shard_failover"
        } else {
            "cluster_failover"
        }
    }
    fn name(&self) -> &'static str {
        if self.shards > 1 {
            "3 stock shards, one shard's primary killed"
        } else {
            "redis cluster primary killed, replica promoted"
        }
    }
    fn prepare(&self, setup: &mut Setup) {
        setup.redis_cluster = true;
        setup.stock_shards = self.shards;
        // Above a fresh replica's first acknowledgement interval (1 s).
        setup.set("FLASHSALE__REDIS__REPLICA_ACK_TIMEOUT_MS", 1000);
    }
    fn inject<'a>(&'a self, run: &'a mut Run) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let key =
                flashsale::stock::Keys::shard(&run.activity_id, run.shards, run.shards - 1).stock;
            let cluster = run.cluster.as_mut().ok_or("no cluster")?;
            let primary = cluster.primary_for(&key).ok_or("no primary for the sale")?;
            cluster.kill(primary);
            // The cluster notices (node timeout 2 s) and promotes a replica.
            let cluster = run.cluster.as_ref().ok_or("no cluster")?;
            testkit::within(
                Duration::from_secs(30),
                "the replica's promotion",
                || async {
                    let now = tokio::task::block_in_place(|| cluster.primary_for(&key));
                    now.filter(|p| *p != primary)
                },
            )
            .await?;
            // Redis's part of the fault is over: from here on it is the service's.
            run.fault_over();
            // Its supervisor restarts the dead node on its old address: it comes
            // back empty, learns it was failed over and rejoins as a replica.
            // The sale must not notice.
            let cluster = run.cluster.as_mut().ok_or("no cluster")?;
            tokio::task::block_in_place(|| cluster.restart(primary));
            let cluster = run.cluster.as_ref().ok_or("no cluster")?;
            tokio::task::block_in_place(|| cluster.wait_healthy(Duration::from_secs(30)))?;
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
