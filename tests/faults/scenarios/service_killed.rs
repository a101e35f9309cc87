//! One of two service instances is SIGKILLed mid-sale (reservations between
//! Redis and the broker die with it) and restarted on the same port; the other
//! goes on serving, as it would behind a load balancer.

use std::time::Duration;

use futures::future::BoxFuture;

use crate::harness::{Fault, Run, Setup, Target, NONE_BOUND};

pub struct ServiceKilled;

impl Fault for ServiceKilled {
    fn id(&self) -> &'static str {
        "service_killed"
    }
    fn name(&self) -> &'static str {
        "one of two services SIGKILLed mid-sale, restarted"
    }
    fn prepare(&self, setup: &mut Setup) {
        setup.services = 2;
    }
    fn inject<'a>(&'a self, run: &'a mut Run) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            run.services[0].kill();
            tokio::time::sleep(Duration::from_millis(500)).await;
            tokio::task::block_in_place(|| run.services[0].start_again());
            Ok(())
        })
    }
    fn availability(&self) -> Target {
        Target::within(NONE_BOUND)
    }
    /// The survivor: a load balancer routes around the killed instance.
    fn measured_on(&self) -> Option<usize> {
        Some(1)
    }
}
