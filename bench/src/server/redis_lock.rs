//! Strategy c: a distributed lock around read-then-decrement.
//!
//! `SET lock <token> NX PX <ttl>`; while held: has the user bought? → `GET` the
//! stock → `DECR` it → record the buyer; then release with compare-and-delete (a
//! Lua `GET == token → DEL`, so a holder whose lock expired never deletes the next
//! holder's). Correct while no holder outlives its TTL, but every request of the
//! SKU runs its critical section one after another, four round trips long, and
//! waiters poll: after a release the lock sits idle until some waiter's next try.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use flashsale::stock::RedisConn;
use redis::{RedisResult, Script};

use super::sale::{Decided, Sale};

#[derive(Debug, Clone, Copy)]
pub struct LockOptions {
    pub retry: Duration,
    pub wait: Duration,
    pub ttl: Duration,
}

/// Deletes the lock only if it still holds our token.
pub fn release_script() -> Script {
    Script::new(
        r#"if redis.call("GET", KEYS[1]) == ARGV[1] then
  return redis.call("DEL", KEYS[1])
end
return 0"#,
    )
}

pub async fn reserve(
    conn: &mut RedisConn,
    release: &Script,
    opts: &LockOptions,
    sale: &Sale,
    user: &str,
    reservation_id: &str,
) -> RedisResult<Decided> {
    // The reservation id is unique, so it doubles as the lock's owner token.
    let token = reservation_id;
    let ttl_ms = u64::try_from(opts.ttl.as_millis()).unwrap_or(u64::MAX);
    let give_up = Instant::now() + opts.wait;
    loop {
        let acquired: Option<String> = redis::cmd("SET")
            .arg(&sale.keys.lock)
            .arg(token)
            .arg("NX")
            .arg("PX")
            .arg(ttl_ms)
            .query_async(conn)
            .await?;
        if acquired.is_some() {
            break;
        }
        sale.counters.lock_waits.fetch_add(1, Ordering::Relaxed);
        if Instant::now() >= give_up {
            sale.counters.lock_timeouts.fetch_add(1, Ordering::Relaxed);
            return Ok(Decided::Busy);
        }
        tokio::time::sleep(opts.retry).await;
    }
    // Release whatever the critical section did, even on an error.
    let decided = critical_section(conn, sale, user, reservation_id).await;
    let released: i64 = release
        .key(&sale.keys.lock)
        .arg(token)
        .invoke_async(conn)
        .await?;
    if released == 0 {
        sale.counters.locks_lost.fetch_add(1, Ordering::Relaxed);
    }
    decided
}

/// Read, check, decrement, record: safe only because the lock is held.
async fn critical_section(
    conn: &mut RedisConn,
    sale: &Sale,
    user: &str,
    reservation_id: &str,
) -> RedisResult<Decided> {
    if let Some(id) = sale.buyer(conn, user).await? {
        return Ok(Decided::AlreadyReserved(id));
    }
    let left: Option<i64> = redis::cmd("GET")
        .arg(&sale.keys.stock)
        .query_async(conn)
        .await?;
    if left.unwrap_or(0) <= 0 {
        return Ok(Decided::SoldOut);
    }
    let _: i64 = redis::cmd("DECR")
        .arg(&sale.keys.stock)
        .query_async(conn)
        .await?;
    sale.record_buyer(conn, user, reservation_id).await?;
    Ok(Decided::Reserved)
}
