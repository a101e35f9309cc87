//! Redis restarts empty mid-sale under two service instances, each with its
//! reconciler (and the CLI's, and the admin endpoint's on both, hammered):
//! one of them rebuilds the sale, the other resumes as soon as the build is in
//! Redis, and exactly one build is written for the one loss. A second build
//! would mean a second pause, answered `503` to buyers.

use futures::future::BoxFuture;

use crate::harness::{Fault, Run, Setup, Target, REBUILD_BOUND};

pub struct RedisRestartedEmptyTwo;

impl Fault for RedisRestartedEmptyTwo {
    fn id(&self) -> &'static str {
        "redis_restarted_empty_two"
    }
    fn name(&self) -> &'static str {
        "redis restarted empty, two services"
    }
    fn prepare(&self, setup: &mut Setup) {
        setup.services = 2;
    }
    fn inject<'a>(&'a self, run: &'a mut Run) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            tokio::task::block_in_place(|| run.redis.restart_empty());
            Ok(())
        })
    }
    fn after<'a>(&'a self, run: &'a mut Run) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let pool = sqlx::MySqlPool::connect(&run.root_mysql_url)
                .await
                .map_err(|e| e.to_string())?;
            let (built,): (u32,) =
                sqlx::query_as("SELECT redis_built_epoch FROM activities WHERE id = ?")
                    .bind(&run.activity_id)
                    .fetch_one(&pool)
                    .await
                    .map_err(|e| e.to_string())?;
            pool.close().await;
            run.background_counts.push(built as usize);
            Ok(())
        })
    }
    fn expect(&self, run: &Run, _f: &testkit::invariants::Figures) -> Result<(), String> {
        // The first load, then one rebuild for the one loss.
        match run.background_counts.first() {
            Some(2) => Ok(()),
            other => Err(format!(
                "builds written for one loss: {other:?} (the first load and one rebuild expected, 2)"
            )),
        }
    }
    fn availability(&self) -> Target {
        Target::within(REBUILD_BOUND)
    }
}
