//! Counting the commands Redis runs for one sale: `MONITOR` on every node of the
//! test's Redis, keeping the lines that name a given string (an activity id).
//! Commands a script runs are listed too (as `[0 lua] …`), so the count is what
//! Redis executes, not only what clients send. Works on a shared Redis: other
//! tests' commands name other activities.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

/// `MONITOR` lines naming `needle`, from every node, since `start`.
pub struct RedisWatch {
    lines: Arc<Mutex<Vec<String>>>,
    tasks: Vec<JoinHandle<()>>,
}

/// The `host:port` of every node that may run a sale's commands: the one node
/// of `redis://host:port/…`, or every primary of the Cluster whose seeds
/// `redis+cluster://a,b,c` names (asked with `CLUSTER NODES`: a failover may
/// have promoted a replica).
async fn primaries(url: &str) -> Vec<String> {
    let named = nodes(url);
    if !url.starts_with("redis+cluster://") {
        return named;
    }
    let seed = named.first().expect("a seed");
    let client = redis::Client::open(format!("redis://{seed}")).expect("a seed's url");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("connect to a seed");
    let listing: String = redis::cmd("CLUSTER")
        .arg("NODES")
        .query_async(&mut conn)
        .await
        .expect("CLUSTER NODES");
    listing
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            let flags = f.get(2)?;
            (flags.contains("master") && !flags.contains("fail"))
                .then(|| f.get(1)?.split('@').next().map(str::to_owned))
                .flatten()
        })
        .collect()
}

/// The `host:port` of every node a `redis.url` names.
fn nodes(url: &str) -> Vec<String> {
    let rest = url
        .strip_prefix("redis+cluster://")
        .or_else(|| url.strip_prefix("redis://"))
        .expect("a redis:// or redis+cluster:// url");
    let rest = rest.split(['/', '?']).next().unwrap_or(rest);
    let rest = rest.rsplit('@').next().unwrap_or(rest);
    rest.split(',').map(str::to_owned).collect()
}

impl RedisWatch {
    /// Starts watching; returns once every node has accepted `MONITOR`.
    pub async fn start(redis_url: &str, needle: &str) -> Self {
        let lines = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for node in primaries(redis_url).await {
            let mut stream = TcpStream::connect(&node)
                .await
                .unwrap_or_else(|e| panic!("connect to {node} to MONITOR: {e}"));
            stream
                .write_all(b"MONITOR\r\n")
                .await
                .expect("MONITOR sent");
            let mut reader = BufReader::new(stream);
            let mut ok = String::new();
            reader.read_line(&mut ok).await.expect("MONITOR answered");
            assert_eq!(ok.trim_end(), "+OK", "{node} refused MONITOR");
            let (lines, needle) = (lines.clone(), needle.to_owned());
            tasks.push(tokio::spawn(async move {
                let mut line = String::new();
                while reader.read_line(&mut line).await.is_ok_and(|n| n > 0) {
                    if line.contains(&needle) {
                        lines
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .push(line.trim_end().to_owned());
                    }
                    line.clear();
                }
            }));
        }
        RedisWatch { lines, tasks }
    }

    /// The lines seen so far.
    pub fn seen(&self) -> Vec<String> {
        self.lines.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Waits until a line containing each of `markers` was seen (commands the
    /// caller sent after the ones it counts, one to each node that matters:
    /// every earlier command on a node is listed before its marker), then
    /// stops and returns the other lines.
    pub async fn until(self, markers: &[String]) -> Vec<String> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let seen = self.seen();
            if markers.iter().all(|m| seen.iter().any(|l| l.contains(m))) {
                for t in &self.tasks {
                    t.abort();
                }
                return seen
                    .into_iter()
                    .filter(|l| !markers.iter().any(|m| l.contains(m)))
                    .collect();
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "MONITOR never showed every one of {markers:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for RedisWatch {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::nodes;

    #[test]
    fn urls_name_their_nodes() {
        assert_eq!(nodes("redis://127.0.0.1:6379/"), ["127.0.0.1:6379"]);
        assert_eq!(nodes("redis://127.0.0.1:6379"), ["127.0.0.1:6379"]);
        assert_eq!(
            nodes("redis+cluster://127.0.0.1:7001,127.0.0.1:7002"),
            ["127.0.0.1:7001", "127.0.0.1:7002"]
        );
    }
}
