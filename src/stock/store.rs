//! The store every other file of `stock` adds its methods to: the connection,
//! the scripts, and the in-memory parts (the gate, the dry-sibling cache, the
//! replica barrier).

use std::sync::Arc;

use redis::RedisResult;

use super::barrier::ReplicaBarrier;
use super::conn::RedisConn;
use super::dry::DrySiblings;
use super::gate::SoldOutGate;
use super::script::{invoke, Lua};

#[derive(Clone)]
pub struct StockStore {
    pub(super) conn: RedisConn,
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

    /// Makes `replicated` wait for `replicas` replicas, at most `timeout`, over
    /// `conns` (connections used for nothing else).
    pub fn with_replica_barrier(
        mut self,
        conns: Vec<RedisConn>,
        replicas: u32,
        timeout: std::time::Duration,
    ) -> Self {
        if let Some(b) = ReplicaBarrier::new(conns, replicas, timeout) {
            self.barrier = Some(b);
        }
        self
    }

    /// Whether the configured replicas hold the reservation (see
    /// `ReplicaBarrier::replicated`): `true` at once when none are required.
    pub async fn replicated(
        &self,
        activity_id: &str,
        user_id: &str,
        reservation_id: &str,
    ) -> RedisResult<bool> {
        match &self.barrier {
            Some(b) => b.replicated(activity_id, user_id, reservation_id).await,
            None => Ok(true),
        }
    }

    pub async fn ping(&self) -> RedisResult<()> {
        let mut conn = self.conn.clone();
        let _: String = redis::cmd("PING").query_async(&mut conn).await?;
        Ok(())
    }
}
