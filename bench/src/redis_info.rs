//! What a Redis node says of itself in `INFO`: its version, and the counters
//! (commands, script calls, CPU seconds) read before and after a run to charge
//! them to it.

use anyhow::Context;
use redis::aio::MultiplexedConnection;

/// Counters read from one node.
#[derive(Debug, Clone, Copy, Default)]
pub struct Counters {
    /// EVALSHA and EVAL calls served so far.
    pub script_calls: u64,
    /// CPU seconds used so far (user + system, all threads).
    pub cpu_s: f64,
    /// Every command processed so far (`total_commands_processed`).
    pub commands: u64,
    /// Bytes the node's allocator holds (`used_memory`).
    pub used_memory: u64,
}

async fn connect(url: &str) -> anyhow::Result<MultiplexedConnection> {
    let client = redis::Client::open(url)?;
    Ok(client.get_multiplexed_async_connection().await?)
}

async fn info(conn: &mut MultiplexedConnection, section: &str) -> anyhow::Result<String> {
    Ok(redis::cmd("INFO").arg(section).query_async(conn).await?)
}

/// The version of the Redis at `url`.
pub async fn version(url: &str) -> anyhow::Result<String> {
    let mut conn = connect(url)
        .await
        .context("failed to connect to Redis (run scripts/services.sh)")?;
    Ok(info(&mut conn, "server")
        .await?
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:"))
        .map(|v| v.trim().to_owned())
        .unwrap_or_default())
}

/// The keys the node at `url` holds when it is a primary (`None` for a replica).
pub async fn primary_keys(url: &str) -> anyhow::Result<Option<u64>> {
    let mut conn = connect(url).await?;
    let role = info(&mut conn, "replication").await?;
    if !role.lines().any(|l| l.trim() == "role:master") {
        return Ok(None);
    }
    let keys: u64 = redis::cmd("DBSIZE").query_async(&mut conn).await?;
    Ok(Some(keys))
}

/// The counters of the node at `url`.
pub async fn counters(url: &str) -> anyhow::Result<Counters> {
    let mut conn = connect(url).await?;
    let mut text = info(&mut conn, "commandstats").await?;
    text.push_str(&info(&mut conn, "cpu").await?);
    text.push_str(&info(&mut conn, "stats").await?);
    text.push_str(&info(&mut conn, "memory").await?);
    Ok(parse(&text))
}

/// The counters in the text of `INFO` (any sections; the missing read as 0).
pub fn parse(info: &str) -> Counters {
    let value = |key: &str| -> Option<&str> {
        info.lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
            .map(str::trim)
    };
    let calls = |name: &str| -> u64 {
        value(&format!("cmdstat_{name}"))
            .and_then(|v| v.strip_prefix("calls="))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    let seconds = |name: &str| -> f64 { value(name).and_then(|v| v.parse().ok()).unwrap_or(0.0) };
    Counters {
        script_calls: calls("evalsha") + calls("eval"),
        cpu_s: seconds("used_cpu_user") + seconds("used_cpu_sys"),
        commands: value("total_commands_processed")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
        used_memory: value("used_memory")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
    }
}

#[cfg(test)]
mod tests {
    use super::parse;

    #[test]
    fn reads_the_counters() {
        let c = parse(
            "# Stats\r\ntotal_commands_processed:42\r\n# Memory\r\nused_memory:1000\r\nused_memory_human:1K\r\n\
             # CPU\r\nused_cpu_sys:1.5\r\nused_cpu_user:2.0\r\nused_cpu_sys_children:9\r\n\
             # Commandstats\r\ncmdstat_evalsha:calls=7,usec=10\r\ncmdstat_eval:calls=1,usec=3\r\n",
        );
        assert_eq!(c.commands, 42);
        assert_eq!(c.used_memory, 1000);
        assert_eq!(c.script_calls, 8);
        assert!((c.cpu_s - 3.5).abs() < 1e-9);
    }
}
