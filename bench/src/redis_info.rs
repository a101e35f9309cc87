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

/// The counters of the node at `url`.
pub async fn counters(url: &str) -> anyhow::Result<Counters> {
    let mut conn = connect(url).await?;
    let stats = info(&mut conn, "commandstats").await?;
    let cpu = info(&mut conn, "cpu").await?;
    let totals = info(&mut conn, "stats").await?;
    let calls = |name: &str| -> u64 {
        stats
            .lines()
            .find_map(|l| l.strip_prefix(&format!("cmdstat_{name}:calls=")))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    let seconds = |name: &str| -> f64 {
        cpu.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}:")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0)
    };
    Ok(Counters {
        script_calls: calls("evalsha") + calls("eval"),
        cpu_s: seconds("used_cpu_user") + seconds("used_cpu_sys"),
        commands: totals
            .lines()
            .find_map(|l| l.strip_prefix("total_commands_processed:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0),
    })
}
