//! The script cache is flushed every 25 ms during the sale: EVALSHA falls back to
//! EVAL, and no request fails for it.

use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::future::BoxFuture;

use crate::harness::{Fault, Run};

pub struct ScriptCacheFlushed;

impl Fault for ScriptCacheFlushed {
    fn id(&self) -> &'static str {
        "script_cache_flushed"
    }
    fn name(&self) -> &'static str {
        "script cache flushed mid-sale"
    }
    fn inject<'a>(&'a self, run: &'a mut Run) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let url = run.redis.url();
            let stop = run.stop.clone();
            run.background.push(tokio::spawn(async move {
                let Ok(client) = redis::Client::open(url) else {
                    return 0;
                };
                let Ok(mut conn) = client.get_multiplexed_async_connection().await else {
                    return 0;
                };
                let mut n = 0;
                while !stop.load(Ordering::SeqCst) {
                    let r: redis::RedisResult<String> = redis::cmd("SCRIPT")
                        .arg("FLUSH")
                        .query_async(&mut conn)
                        .await;
                    if r.is_ok() {
                        n += 1;
                    }
                    tokio::time::sleep(Duration::from_millis(25)).await;
                }
                n
            }));
            Ok(())
        })
    }
    fn expect(&self, run: &Run, f: &testkit::invariants::Figures) -> Result<(), String> {
        if run.background_counts.first().copied().unwrap_or(0) == 0 {
            return Err("the script cache was never flushed".into());
        }
        if f.refused_503 > 0 || f.lost_connections > 0 {
            return Err(format!(
                "a flushed script cache failed requests: {:?}",
                f.answers
            ));
        }
        Ok(())
    }
}
