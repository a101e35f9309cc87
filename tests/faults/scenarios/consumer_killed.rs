//! The consumer is SIGKILLed mid-batch, restarted, and killed again once it is
//! consuming: uncommitted offsets are redelivered and absorbed.

use std::time::Duration;

use futures::future::BoxFuture;

use crate::harness::{Fault, Run, Setup};

pub struct ConsumerKilled;

impl Fault for ConsumerKilled {
    fn id(&self) -> &'static str {
        "consumer_killed"
    }
    fn name(&self) -> &'static str {
        "consumer killed mid-batch, restarted"
    }
    fn prepare(&self, setup: &mut Setup) {
        setup.separate_consumer = true;
    }
    fn inject<'a>(&'a self, run: &'a mut Run) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            for round in 0..2 {
                if round == 1 {
                    // Kill the restarted consumer once it is consuming again (it
                    // has committed), not while it is joining its group.
                    let before = run.committed().await;
                    run.wait_committed_above(before).await?;
                }
                run.kill_consumers();
                tokio::time::sleep(Duration::from_millis(500)).await;
                run.start_consumer();
            }
            Ok(())
        })
    }
}
