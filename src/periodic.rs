//! The loop every background worker shares: run a task on a fixed interval until
//! shutdown.

use std::future::Future;
use std::time::Duration;

use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;

/// Runs `task` at once and then every `interval` until `shutdown` is cancelled. A
/// run that overruns delays the next one instead of bunching the missed ticks.
pub async fn every<F, Fut>(interval: Duration, shutdown: CancellationToken, mut task: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = ()>,
{
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        task().await;
    }
}
