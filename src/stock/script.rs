//! Running the Lua scripts, for the stock and the waiting room alike: each is sent by
//! its SHA with its code as the fallback, on whichever node owns its keys' slot.

use redis::{RedisResult, Script};

use super::conn::RedisConn;

/// One script argument, encoded as Redis would.
pub(crate) fn arg<T: redis::ToRedisArgs>(value: T) -> Vec<u8> {
    value.to_redis_args().concat()
}

/// A Lua script, called by its SHA with the code as the fallback (`invoke`).
#[derive(Clone)]
pub(crate) struct Lua {
    script: Script,
    code: &'static str,
}

impl Lua {
    pub(crate) fn new(code: &'static str) -> Self {
        Lua {
            script: Script::new(code),
            code,
        }
    }
}

/// Runs a script by its SHA; on `NOSCRIPT` (a restarted or failed-over Redis)
/// sends its code once to that same node, which loads it again. (redis-rs's own
/// `Script::invoke_async` answers `NOSCRIPT` on a Cluster by loading the script on
/// every node, which fails while any node is down: during a failover.)
pub(crate) async fn invoke<T: redis::FromRedisValue>(
    conn: &RedisConn,
    lua: &Lua,
    keys: &[&str],
    args: &[Vec<u8>],
) -> RedisResult<T> {
    let mut conn = conn.clone();
    let by_sha = redis::cmd("EVALSHA")
        .arg(lua.script.get_hash())
        .arg(keys.len())
        .arg(keys)
        .arg(args)
        .query_async(&mut conn)
        .await;
    match by_sha {
        Err(err) if err.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            metrics::counter!("flashsale_redis_script_eval_fallbacks_total").increment(1);
            redis::cmd("EVAL")
                .arg(lua.code)
                .arg(keys.len())
                .arg(keys)
                .arg(args)
                .query_async(&mut conn)
                .await
        }
        other => other,
    }
}
