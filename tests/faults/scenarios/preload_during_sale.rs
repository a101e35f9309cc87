//! An operator rebuilds the sale's Redis state mid-sale while reservations still
//! wait in the queue: pause, preload (refused with 503 while the consumers have
//! lag, so it is retried), resume. Nothing acknowledged may be forgotten and no
//! unit counted twice.

use std::time::Duration;

use futures::future::BoxFuture;

use crate::harness::{Fault, Run, Setup};

pub struct PreloadDuringSale;

impl PreloadDuringSale {
    async fn admin(run: &Run, step: &str) -> Result<u16, String> {
        run.api()
            .admin_step(&run.activity_id, step)
            .send()
            .await
            .map(|r| r.status().as_u16())
            .map_err(|e| format!("{step}: {e}"))
    }
}

impl Fault for PreloadDuringSale {
    fn id(&self) -> &'static str {
        "preload_during_sale"
    }
    fn name(&self) -> &'static str {
        "operator preload mid-sale, messages queued"
    }
    fn prepare(&self, setup: &mut Setup) {
        setup.separate_consumer = true;
    }
    fn inject<'a>(&'a self, run: &'a mut Run) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            // Messages pile up in the queue.
            run.kill_consumers();
            tokio::time::sleep(Duration::from_millis(500)).await;
            if Self::admin(run, "pause").await? != 200 {
                return Err("pause refused".into());
            }
            let first = Self::admin(run, "preload").await?;
            run.start_consumer();
            let mut status = first;
            let deadline = std::time::Instant::now() + Duration::from_secs(60);
            while status != 200 {
                if status != 503 || std::time::Instant::now() > deadline {
                    return Err(format!("preload answered {status}"));
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
                status = Self::admin(run, "preload").await?;
            }
            if Self::admin(run, "resume").await? != 200 {
                return Err("resume refused".into());
            }
            // Paused on purpose until here: service counts from the resume.
            run.fault_over();
            run.background_counts.push(usize::from(first));
            Ok(())
        })
    }
    fn expect(&self, run: &Run, _f: &testkit::invariants::Figures) -> Result<(), String> {
        match run.background_counts.first() {
            Some(503) | Some(200) => Ok(()),
            other => Err(format!("the first preload answered {other:?}")),
        }
    }
}
