//! The broker is SIGKILLed mid-sale and restarted 1.5 s later.

use std::time::Duration;

use futures::future::BoxFuture;

use crate::harness::{Fault, Run, Setup};

pub struct BrokerKilled;

impl Fault for BrokerKilled {
    fn id(&self) -> &'static str {
        "broker_killed"
    }
    fn name(&self) -> &'static str {
        "kafka broker killed and restarted"
    }
    fn prepare(&self, setup: &mut Setup) {
        setup.own_broker = true;
    }
    fn inject<'a>(&'a self, run: &'a mut Run) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let broker = run.broker.as_mut().ok_or("no broker of its own")?;
            broker.kill();
            tokio::time::sleep(Duration::from_millis(1500)).await;
            tokio::task::block_in_place(|| broker.start_again());
            run.fault_over();
            Ok(())
        })
    }
}
