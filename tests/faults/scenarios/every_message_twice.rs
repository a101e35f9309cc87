//! A second consumer group reads the same topic: every message is processed twice.

use futures::future::BoxFuture;

use crate::harness::{Fault, Run, Setup};

pub struct EveryMessageTwice;

impl Fault for EveryMessageTwice {
    fn id(&self) -> &'static str {
        "every_message_twice"
    }
    fn name(&self) -> &'static str {
        "every message delivered twice"
    }
    fn prepare(&self, setup: &mut Setup) {
        setup.twin_consumer = true;
    }
    fn inject<'a>(&'a self, _run: &'a mut Run) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async { Ok(()) })
    }
}
