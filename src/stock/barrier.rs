//! The replica barrier: a reservation is answered only once the configured
//! replicas hold it, so a failover right after the answer does not lose it.
//! With `auto`, the one replica waited for is whichever the sale's primary has
//! online; a primary with none (a single node, or one just promoted whose
//! replicas have not resynchronised) is not waited on, and says so.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use redis::RedisResult;

use crate::config::ReplicasAcked;

use super::conn::RedisConn;
use super::keys::Keys;

/// The replicas online at the primary that runs it (its `INFO replication`
/// lists each with `state=online` once it has synchronised); the key only
/// routes it to the sale's primary on a Cluster.
const ONLINE_REPLICAS: &str = r"
local info = redis.call('INFO', 'replication')
local n = 0
for _ in string.gmatch(info, 'slave%d+:[^\r\n]*state=online') do n = n + 1 end
return n
";

/// What the barrier found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replication {
    /// The required replicas hold the reservation (or none are required).
    Held,
    /// `auto`, and the primary had no replica online: nothing to wait for.
    NoReplica,
    /// Not held: the replicas did not acknowledge in time, or the node asked no
    /// longer holds the reservation.
    Missing,
}

/// Connections of their own for `WAIT`, which blocks the connection it is sent on
/// until the replicas catch up: on the shared connection, one lagging replica
/// would stall every request behind it. A write on one of these connections (a
/// counter bump) follows the reservation in the primary's one replication
/// stream, so replicas that acknowledged it hold the reservation too.
#[derive(Clone)]
pub(super) struct ReplicaBarrier {
    conns: Arc<Vec<RedisConn>>,
    next: Arc<AtomicUsize>,
    acked: ReplicasAcked,
    timeout_ms: u64,
    online: Arc<Online>,
}

/// How long a look at a shard's replicas online stands (`auto`).
pub const ONLINE_FRESH: Duration = Duration::from_secs(1);

/// The replicas last seen online, by shard (its barrier key), with when.
#[derive(Default)]
struct Online(Mutex<HashMap<String, (Instant, u32)>>);

impl Online {
    /// Shards looked at longer ago than this are forgotten when the map is full.
    const MAX_SHARDS: usize = 4096;

    fn fresh(&self, shard: &str) -> Option<u32> {
        let seen = self.0.lock().unwrap_or_else(|p| p.into_inner());
        seen.get(shard)
            .filter(|(at, _)| at.elapsed() < ONLINE_FRESH)
            .map(|(_, n)| *n)
    }

    fn remember(&self, shard: &str, online: u32) {
        let mut seen = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if seen.len() >= Self::MAX_SHARDS {
            seen.retain(|_, (at, _)| at.elapsed() < ONLINE_FRESH);
        }
        seen.insert(shard.to_owned(), (Instant::now(), online));
    }
}

impl ReplicaBarrier {
    /// Waits for the replicas `acked` asks for, at most `timeout`, over `conns`
    /// (connections used for nothing else); none when no replica is required.
    pub(super) fn new(
        conns: Vec<RedisConn>,
        acked: ReplicasAcked,
        timeout: std::time::Duration,
    ) -> Option<Self> {
        (acked.waits() && !conns.is_empty()).then(|| ReplicaBarrier {
            conns: Arc::new(conns),
            next: Arc::new(AtomicUsize::new(0)),
            acked,
            timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
            online: Arc::default(),
        })
    }

    /// Whether the configured replicas hold every write made to the reservation's
    /// primary so far (the reservation among them). A bump of `…:barrier` on a
    /// barrier connection, then `WAIT` on that same connection (on a Cluster, at
    /// the primary that owns the slot of the reservation's shard).
    ///
    /// With `auto`, the replicas online at that primary are looked up (with
    /// whether it holds the reservation) at most once per [`ONLINE_FRESH`] and
    /// shard: none, and nothing is waited for; one or more, and the wait is the
    /// one for `1`. A wait that fails looks again at once, so that a replica that
    /// has gone (or a failover to a primary with none) costs one wait, not a
    /// refusal each time.
    pub(super) async fn replicated(
        &self,
        activity_id: &str,
        user_id: &str,
        reservation_id: &str,
    ) -> RedisResult<Replication> {
        let k = Keys::of_reservation(activity_id, reservation_id);
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.conns.len();
        let mut conn = self.conns[i].clone();
        let replicas = match self.acked {
            ReplicasAcked::Exactly(n) => n,
            ReplicasAcked::Auto => {
                let online = match self.online.fresh(&k.barrier) {
                    Some(n) => n,
                    None => match self.look(&mut conn, &k, user_id, reservation_id).await? {
                        Some(n) => n,
                        None => return Ok(Replication::Missing),
                    },
                };
                if online == 0 {
                    return Ok(Replication::NoReplica);
                }
                1
            }
        };
        if self
            .wait(&mut conn, &k, user_id, reservation_id, replicas)
            .await?
        {
            return Ok(Replication::Held);
        }
        if self.acked != ReplicasAcked::Auto {
            return Ok(Replication::Missing);
        }
        Ok(
            match self.look(&mut conn, &k, user_id, reservation_id).await? {
                Some(0) => Replication::NoReplica,
                _ => Replication::Missing,
            },
        )
    }

    /// The replicas online at the primary of `k`'s shard, remembered; `None` when
    /// that primary does not hold the user's right under this reservation.
    async fn look(
        &self,
        conn: &mut RedisConn,
        k: &Keys,
        user_id: &str,
        reservation_id: &str,
    ) -> RedisResult<Option<u32>> {
        let (holder, online): (Option<String>, u32) = redis::pipe()
            .hget(&k.buyers, user_id)
            .cmd("EVAL")
            .arg(ONLINE_REPLICAS)
            .arg(1)
            .arg(&k.barrier)
            .query_async(conn)
            .await?;
        self.online.remember(&k.barrier, online);
        Ok((holder.as_deref() == Some(reservation_id)).then_some(online))
    }

    /// One pipeline: the check, the bump and the `WAIT` reach the same node, the
    /// primary that owns the barrier's slot (a `WAIT` routed on its own could
    /// land on another node during a failover and count that node's replicas).
    /// The barrier's connection may know a newer primary than the one the
    /// reservation was written on: only a node that holds the user's purchase
    /// right under this reservation can vouch for it (the right stays once the
    /// order is written, unlike the reservation's details).
    async fn wait(
        &self,
        conn: &mut RedisConn,
        k: &Keys,
        user_id: &str,
        reservation_id: &str,
        replicas: u32,
    ) -> RedisResult<bool> {
        let (holder, _, acked): (Option<String>, i64, u32) = redis::pipe()
            .hget(&k.buyers, user_id)
            .incr(&k.barrier, 1)
            .cmd("WAIT")
            .arg(replicas)
            .arg(self.timeout_ms)
            .query_async(conn)
            .await?;
        Ok(holder.as_deref() == Some(reservation_id) && acked >= replicas)
    }
}
