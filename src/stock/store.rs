//! The store every other file of `stock` adds its methods to: the connection,
//! the scripts, and the in-memory parts (the gate, the dry-sibling cache, the
//! replica barrier).

use std::sync::Arc;

use redis::RedisResult;

use crate::clock::Clock;
use crate::config::ReplicasAcked;

use super::barrier::{ReplicaBarrier, Replication};
use super::conn::RedisConn;
use super::dry::DrySiblings;
use super::gate::SoldOutGate;
use super::script::{invoke, Lua};

#[derive(Clone)]
pub struct StockStore {
    pub(super) conn: RedisConn,
    /// The shared clock, read from this Redis (see `crate::clock`).
    clock: Clock,
    pub(super) dry: Arc<DrySiblings>,
    pub(super) gate: Arc<SoldOutGate>,
    pub(super) barrier: Option<ReplicaBarrier>,
    pub(super) reserve: Lua,
    pub(super) refund: Lua,
    pub(super) preload: Lua,
    pub(super) audit: Lua,
    pub(super) fate: Lua,
    pub(super) confirm: Lua,
    pub(super) lower: Lua,
    pub(super) lend: Lua,
    pub(super) receive: Lua,
    pub(super) loan_done: Lua,
    pub(super) filter_read: Lua,
    pub(super) view_read: Lua,
    pub(super) view_fill: Lua,
    pub(super) view_change: Lua,
    pub(super) remove: Lua,
}

impl StockStore {
    pub fn new(conn: RedisConn) -> Self {
        StockStore {
            clock: Clock::shared(conn.clone()),
            conn,
            dry: Arc::default(),
            gate: Arc::default(),
            barrier: None,
            reserve: Lua::new(include_str!("reserve.lua")),
            refund: Lua::new(include_str!("refund.lua")),
            preload: Lua::new(concat!(
                include_str!("filter.lua"),
                include_str!("preload.lua")
            )),
            audit: Lua::new(include_str!("audit.lua")),
            fate: Lua::new(include_str!("fate.lua")),
            confirm: Lua::new(concat!(
                include_str!("filter.lua"),
                include_str!("confirm.lua")
            )),
            lower: Lua::new(include_str!("lower.lua")),
            lend: Lua::new(include_str!("lend.lua")),
            receive: Lua::new(include_str!("receive.lua")),
            loan_done: Lua::new(include_str!("loan_done.lua")),
            filter_read: Lua::new(include_str!("filter_read.lua")),
            view_read: Lua::new(include_str!("view_read.lua")),
            view_fill: Lua::new(include_str!("view_fill.lua")),
            view_change: Lua::new(include_str!("view_change.lua")),
            remove: Lua::new(include_str!("remove.lua")),
        }
    }

    /// The clock every time rule follows: this Redis's, shared by every
    /// instance (see `crate::clock`).
    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    /// The same store judging time by `clock` (tests).
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    pub fn connection(&self) -> RedisConn {
        self.conn.clone()
    }

    /// Runs one of the stock's scripts on the shared connection (see [`invoke`]).
    pub(super) async fn run<T: redis::FromRedisValue>(
        &self,
        lua: &Lua,
        keys: &[&str],
        args: &[Vec<u8>],
    ) -> RedisResult<T> {
        invoke(&self.conn, lua, keys, args).await
    }

    /// Makes `replicated` wait for the replicas `acked` asks for, at most
    /// `timeout`, over `conns` (connections used for nothing else).
    pub fn with_replica_barrier(
        mut self,
        conns: Vec<RedisConn>,
        acked: ReplicasAcked,
        timeout: std::time::Duration,
    ) -> Self {
        if let Some(b) = ReplicaBarrier::new(conns, acked, timeout) {
            self.barrier = Some(b);
        }
        self
    }

    /// Whether the configured replicas hold the reservation (see
    /// `ReplicaBarrier::replicated`): `Held` at once when none are required.
    pub async fn replicated(
        &self,
        activity_id: &str,
        user_id: &str,
        reservation_id: &str,
    ) -> RedisResult<Replication> {
        match &self.barrier {
            Some(b) => b.replicated(activity_id, user_id, reservation_id).await,
            None => Ok(Replication::Held),
        }
    }

    /// Each node's `maxmemory-policy` (on a Cluster, every primary's), from
    /// `INFO memory`, which managed Redis services answer where `CONFIG` is refused.
    pub async fn memory_policies(&self) -> RedisResult<Vec<String>> {
        let mut conn = self.conn.clone();
        let info: redis::Value = redis::cmd("INFO")
            .arg("memory")
            .query_async(&mut conn)
            .await?;
        let mut policies = Vec::new();
        collect_policies(&info, &mut policies);
        Ok(policies)
    }

    pub async fn ping(&self) -> RedisResult<()> {
        let mut conn = self.conn.clone();
        let _: String = redis::cmd("PING").query_async(&mut conn).await?;
        Ok(())
    }
}

/// The `maxmemory_policy:` lines in an `INFO` answer: one text from one node, or,
/// from a Cluster, a map of each primary's.
fn collect_policies(v: &redis::Value, out: &mut Vec<String>) {
    use redis::Value;
    match v {
        Value::BulkString(b) => collect_policies_in(&String::from_utf8_lossy(b), out),
        Value::VerbatimString { text, .. } | Value::SimpleString(text) => {
            collect_policies_in(text, out)
        }
        Value::Array(items) | Value::Set(items) => {
            items.iter().for_each(|i| collect_policies(i, out))
        }
        Value::Map(pairs) => pairs.iter().for_each(|(_, v)| collect_policies(v, out)),
        _ => {}
    }
}

fn collect_policies_in(text: &str, out: &mut Vec<String>) {
    out.extend(
        text.lines()
            .filter_map(|l| l.strip_prefix("maxmemory_policy:"))
            .map(|p| p.trim().to_owned()),
    );
}
