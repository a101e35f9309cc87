//! Counters read from a Redis node's `INFO`: commands, script calls and CPU
//! seconds, read before and after a run to charge them to it.

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

/// The counters of the node at `url`.
pub async fn counters(url: &str) -> anyhow::Result<Counters> {
    let client = redis::Client::open(url)?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn)
        .await?;
    let cpu: String = redis::cmd("INFO").arg("cpu").query_async(&mut conn).await?;
    let totals: String = redis::cmd("INFO")
        .arg("stats")
        .query_async(&mut conn)
        .await?;
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
