//! The only consumer is down for several pending deadlines while the sale goes on:
//! every `202` must still become an order (the reconciler honours acknowledged
//! reservations; it never fails them for being slow).

use std::time::Duration;

use futures::future::BoxFuture;

use crate::harness::{Fault, Run, Setup, PENDING_DEADLINE_SECS};

pub struct ConsumerDown;

impl Fault for ConsumerDown {
    fn id(&self) -> &'static str {
        "consumer_down"
    }
    fn name(&self) -> &'static str {
        "consumer down past the pending deadline"
    }
    fn prepare(&self, setup: &mut Setup) {
        setup.separate_consumer = true;
    }
    fn inject<'a>(&'a self, run: &'a mut Run) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            run.kill_consumers();
            tokio::time::sleep(Duration::from_secs(PENDING_DEADLINE_SECS * 4)).await;
            run.start_consumer();
            Ok(())
        })
    }
}
