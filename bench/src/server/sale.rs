//! What the strategy servers share below their handlers: one open sale (its
//! keys and its counters of what went wrong) and what a strategy decided for one
//! request. The strategies and the router both use these; neither owns them.

use std::sync::atomic::{AtomicI64, AtomicU64};

use flashsale::stock::RedisConn;
use redis::RedisResult;

/// Counters of what went wrong, or nearly, in one sale.
#[derive(Debug)]
pub struct Counters {
    /// `redis-decr`: a user recorded twice (their second win overwrote the first).
    pub double_wins: AtomicU64,
    /// `redis-decr`: `DECR` answers below zero, each a moment where any reader saw
    /// negative stock.
    pub negative_decrements: AtomicU64,
    pub lowest_stock_seen: AtomicI64,
    /// `redis-lock`: attempts that found the lock held.
    pub lock_waits: AtomicU64,
    /// `redis-lock`: requests that gave up waiting (answered 503).
    pub lock_timeouts: AtomicU64,
    /// `redis-lock`: releases that found the lock gone or someone else's (it expired
    /// while held: the critical section was not exclusive any more).
    pub locks_lost: AtomicU64,
}

impl Counters {
    pub fn new(stock: i64) -> Self {
        Counters {
            double_wins: AtomicU64::new(0),
            negative_decrements: AtomicU64::new(0),
            lowest_stock_seen: AtomicI64::new(stock),
            lock_waits: AtomicU64::new(0),
            lock_timeouts: AtomicU64::new(0),
            locks_lost: AtomicU64::new(0),
        }
    }
}

/// One open sale of a strategy server.
#[derive(Debug)]
pub struct Sale {
    pub sku: String,
    pub stock: i64,
    pub keys: Keys,
    pub counters: Counters,
}

impl Sale {
    /// The reservation id `user` already holds in this sale, if any (the Redis
    /// strategies' per-user check).
    pub async fn buyer(&self, conn: &mut RedisConn, user: &str) -> RedisResult<Option<String>> {
        redis::cmd("HGET")
            .arg(&self.keys.buyers)
            .arg(user)
            .query_async(conn)
            .await
    }

    /// Records `user`'s reservation; answers 0 when the user was already recorded.
    pub async fn record_buyer(
        &self,
        conn: &mut RedisConn,
        user: &str,
        reservation_id: &str,
    ) -> RedisResult<i64> {
        redis::cmd("HSET")
            .arg(&self.keys.buyers)
            .arg(user)
            .arg(reservation_id)
            .query_async(conn)
            .await
    }
}

/// The Redis keys of one sale, under one hash tag like the service's.
#[derive(Debug, Clone)]
pub struct Keys {
    pub stock: String,
    pub buyers: String,
    pub lock: String,
}

/// What a strategy decided for one request.
#[derive(Debug)]
pub enum Decided {
    Reserved,
    AlreadyReserved(String),
    SoldOut,
    /// `redis-lock` only: the lock could not be had in time.
    Busy,
}
