//! Strategy b: Redis `DECR`, then `INCR` back when the answer is negative; the
//! per-user limit as separate commands around it.
//!
//! No Lua, and no oversell: `DECR` is atomic, so at most `stock` callers see an
//! answer ≥ 0. What it costs, and what this module counts:
//! - transient negatives: every `DECR` past zero leaves the stock below zero until
//!   its `INCR` lands; anyone reading the stock then (a status page, a reconciler)
//!   sees a negative count;
//! - the per-user limit is not atomic with the decrement: between `HGET` (has this
//!   user bought?) and `HSET` (record the purchase) the same user's second click can
//!   pass the same check, and both take a unit. `HSET` answering 0 (the field was
//!   already there) is that double win, caught after the fact.

use redis::RedisResult;

use super::sale::{Decided, Sale};
use flashsale::stock::RedisConn;
use std::sync::atomic::Ordering;

pub async fn reserve(
    conn: &mut RedisConn,
    sale: &Sale,
    user: &str,
    reservation_id: &str,
) -> RedisResult<Decided> {
    // 1. The per-user check, on its own.
    if let Some(id) = sale.buyer(conn, user).await? {
        return Ok(Decided::AlreadyReserved(id));
    }
    // 2. Take a unit; give it back if there was none.
    let left: i64 = redis::cmd("DECR")
        .arg(&sale.keys.stock)
        .query_async(conn)
        .await?;
    if left < 0 {
        let c = &sale.counters;
        c.negative_decrements.fetch_add(1, Ordering::Relaxed);
        c.lowest_stock_seen.fetch_min(left, Ordering::Relaxed);
        let _: i64 = redis::cmd("INCR")
            .arg(&sale.keys.stock)
            .query_async(conn)
            .await?;
        return Ok(Decided::SoldOut);
    }
    // 3. Record the buyer. 0 new fields means another click of this user got here
    //    first: the user now holds two units and the first reservation id is lost.
    let added = sale.record_buyer(conn, user, reservation_id).await?;
    if added == 0 {
        sale.counters.double_wins.fetch_add(1, Ordering::Relaxed);
    }
    Ok(Decided::Reserved)
}
