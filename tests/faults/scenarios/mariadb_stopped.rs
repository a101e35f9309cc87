//! The database server is SIGKILLed mid-sale and restarted 1.5 s later.

use std::time::Duration;

use futures::future::BoxFuture;

use crate::harness::{Fault, Run, Setup};

pub struct MariaDbStopped;

impl Fault for MariaDbStopped {
    fn id(&self) -> &'static str {
        "mariadb_stopped"
    }
    fn name(&self) -> &'static str {
        "mariadb stopped and restarted"
    }
    fn prepare(&self, setup: &mut Setup) {
        setup.own_mariadb = true;
    }
    fn inject<'a>(&'a self, run: &'a mut Run) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let m = run
                .mariadb
                .as_mut()
                .ok_or("no database server of its own")?;
            m.kill();
            tokio::time::sleep(Duration::from_millis(1500)).await;
            tokio::task::block_in_place(|| m.start_again());
            run.fault_over();
            Ok(())
        })
    }
}
