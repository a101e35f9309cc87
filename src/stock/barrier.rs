//! The replica barrier: a reservation is answered only once the configured
//! replicas hold it, so a failover right after the answer does not lose it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use redis::RedisResult;

use super::conn::RedisConn;
use super::keys::Keys;

/// Connections of their own for `WAIT`, which blocks the connection it is sent on
/// until the replicas catch up: on the shared connection, one lagging replica
/// would stall every request behind it. A write on one of these connections (a
/// counter bump) follows the reservation in the primary's one replication
/// stream, so replicas that acknowledged it hold the reservation too.
#[derive(Clone)]
pub(super) struct ReplicaBarrier {
    conns: Arc<Vec<RedisConn>>,
    next: Arc<AtomicUsize>,
    replicas: u32,
    timeout_ms: u64,
}

impl ReplicaBarrier {
    /// Waits for `replicas` replicas, at most `timeout`, over `conns`
    /// (connections used for nothing else); none when no replica is required.
    pub(super) fn new(
        conns: Vec<RedisConn>,
        replicas: u32,
        timeout: std::time::Duration,
    ) -> Option<Self> {
        (replicas > 0 && !conns.is_empty()).then(|| ReplicaBarrier {
            conns: Arc::new(conns),
            next: Arc::new(AtomicUsize::new(0)),
            replicas,
            timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
        })
    }

    /// Whether the configured replicas hold every write made to the reservation's
    /// primary so far (the reservation among them). A bump of `…:barrier` on a barrier connection, then
    /// `WAIT` on that same connection (on a Cluster, at the primary that owns the
    /// slot of the reservation's shard).
    pub(super) async fn replicated(
        &self,
        activity_id: &str,
        user_id: &str,
        reservation_id: &str,
    ) -> RedisResult<bool> {
        let b = self;
        let k = Keys::of_reservation(activity_id, reservation_id);
        let i = b.next.fetch_add(1, Ordering::Relaxed) % b.conns.len();
        let mut conn = b.conns[i].clone();
        // One pipeline: the check, the bump and the `WAIT` reach the same node,
        // the primary that owns the barrier's slot (a `WAIT` routed on its own
        // could land on another node during a failover and count that node's
        // replicas). The barrier's connection may know a newer primary than the
        // one the reservation was written on: only a node that holds the user's
        // purchase right under this reservation can vouch for it (the right
        // stays once the order is written, unlike the reservation's details).
        let (holder, _, acked): (Option<String>, i64, u32) = redis::pipe()
            .hget(&k.buyers, user_id)
            .incr(&k.barrier, 1)
            .cmd("WAIT")
            .arg(b.replicas)
            .arg(b.timeout_ms)
            .query_async(&mut conn)
            .await?;
        Ok(holder.as_deref() == Some(reservation_id) && acked >= b.replicas)
    }
}
