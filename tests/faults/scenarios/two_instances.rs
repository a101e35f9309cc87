//! Two services, each with its consumer in the same group, sell one sale together.

use futures::future::BoxFuture;

use crate::harness::{Fault, Run, Setup};

pub struct TwoInstances;

impl Fault for TwoInstances {
    fn id(&self) -> &'static str {
        "two_instances"
    }
    fn name(&self) -> &'static str {
        "two services, two consumers"
    }
    fn prepare(&self, setup: &mut Setup) {
        setup.services = 2;
    }
    fn inject<'a>(&'a self, _run: &'a mut Run) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async { Ok(()) })
    }
}
