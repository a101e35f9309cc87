//! Three API instances, each with its order consumer in one group over the
//! topic's three partitions, sell one sale together; the load spreads its
//! connections over them (as a load balancer would). Winners stay exact and one
//! per user across instances, and the orders are spread over the consumers.

use futures::future::BoxFuture;

use crate::harness::{Fault, Run, Setup};

pub struct ThreeInstances;

impl Fault for ThreeInstances {
    fn id(&self) -> &'static str {
        "three_instances"
    }
    fn name(&self) -> &'static str {
        "three services, three consumers"
    }
    fn prepare(&self, setup: &mut Setup) {
        setup.services = 3;
    }
    fn inject<'a>(&'a self, _run: &'a mut Run) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async { Ok(()) })
    }
    fn after<'a>(&'a self, run: &'a mut Run) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            // Orders each instance's consumer wrote.
            for i in 0..run.services.len() {
                let n = run.metric_of(i, "flashsale_orders_created_total").await;
                run.background_counts.push(n as usize);
            }
            println!(
                "three_instances: orders written per consumer {:?}",
                run.background_counts
            );
            Ok(())
        })
    }
    fn expect(&self, run: &Run, _f: &testkit::invariants::Figures) -> Result<(), String> {
        let writers = run.background_counts.iter().filter(|n| **n > 0).count();
        if writers < 2 {
            return Err(format!(
                "the orders were not spread over the consumers: {:?}",
                run.background_counts
            ));
        }
        Ok(())
    }
}
