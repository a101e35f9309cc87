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
            // Reservations outlived the deadline with no consumer: the reconciler
            // must have honoured them, never failed them.
            let honoured = run
                .metric("flashsale_reconcile_honoured_reservations_total")
                .await;
            run.background_counts.push(honoured as usize);
            run.start_consumer();
            Ok(())
        })
    }
    fn expect(&self, run: &Run, _f: &testkit::invariants::Figures) -> Result<(), String> {
        match run.background_counts.first() {
            Some(n) if *n > 0 => Ok(()),
            _ => Err("no reservation outlived the deadline: the fault did not bite".into()),
        }
    }
}
