//! The broker hangs (SIGSTOP) for longer than the publish timeout, then resumes
//! (SIGCONT) and writes the produce requests it was sent meanwhile: publishes time
//! out on the client, yet their messages land. Each such reservation must be
//! decided once: an order (its message won) or a withdrawal, never both.

use std::time::Duration;

use futures::future::BoxFuture;

use crate::harness::{Fault, Run, Setup, PUBLISH_TIMEOUT_MS};

pub struct BrokerStalled;

impl Fault for BrokerStalled {
    fn id(&self) -> &'static str {
        "broker_stalled"
    }
    fn name(&self) -> &'static str {
        "broker stalled past the publish timeout"
    }
    fn prepare(&self, setup: &mut Setup) {
        setup.own_broker = true;
    }
    fn inject<'a>(&'a self, run: &'a mut Run) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let broker = run.broker.as_ref().ok_or("no broker of its own")?;
            broker.pause();
            tokio::time::sleep(Duration::from_millis(PUBLISH_TIMEOUT_MS * 3)).await;
            broker.resume();
            run.fault_over();
            Ok(())
        })
    }
    fn expect(&self, _run: &Run, f: &testkit::invariants::Figures) -> Result<(), String> {
        if f.refused_503 == 0 {
            return Err("the stall timed out no publish: the fault did not bite".into());
        }
        Ok(())
    }
}
