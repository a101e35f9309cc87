//! Wall-clock time as milliseconds since the Unix epoch: the one scale on which the
//! orchestrator, the load generator, the CPU sampler and the side query, each in a
//! process or thread of its own, match their samples to one another's windows.

use std::time::{SystemTime, UNIX_EPOCH};

/// `t` in milliseconds since the epoch; a clock set before 1970 reads as 0.
pub fn unix_ms(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64() * 1000.0)
        .unwrap_or(0.0)
}

/// Now, in milliseconds since the epoch.
pub fn now_unix_ms() -> f64 {
    unix_ms(SystemTime::now())
}
