//! Orders with a 2-second payment window: about half are paid at times around
//! their deadline while the sweepers cancel the rest and put the units back on
//! sale.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::future::BoxFuture;
use testkit::api::Caller;

use crate::harness::{Fault, Run, Setup};

pub struct PaymentsRaceSweeper;

impl Fault for PaymentsRaceSweeper {
    fn id(&self) -> &'static str {
        "payments_race_sweeper"
    }
    fn name(&self) -> &'static str {
        "payments racing the sweeper"
    }
    fn prepare(&self, setup: &mut Setup) {
        setup.payment_timeout_secs = 2;
    }
    fn inject<'a>(&'a self, run: &'a mut Run) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let (api, mysql, activity, stop) = (
                run.api(),
                run.root_mysql_url.clone(),
                run.activity_id.clone(),
                run.stop.clone(),
            );
            run.background.push(tokio::spawn(async move {
                let Ok(pool) = sqlx::MySqlPool::connect(&mysql).await else {
                    return 0;
                };
                let mut tried = HashSet::new();
                while !stop.load(Ordering::SeqCst) {
                    let rows: Vec<(u64, String)> = sqlx::query_as(
                        "SELECT id, CAST(user_id AS CHAR) FROM orders WHERE activity_id = ? AND status = 'pending_payment'",
                    )
                    .bind(&activity)
                    .fetch_all(&pool)
                    .await
                    .unwrap_or_default();
                    for (id, user) in rows {
                        if id % 2 == 1 || !tried.insert(id) {
                            continue;
                        }
                        let request = api.pay(&id.to_string(), Caller::User(&user));
                        // Spread over the deadline: some before, some after.
                        let delay = Duration::from_millis(1500 + (id % 8) * 100);
                        tokio::spawn(async move {
                            tokio::time::sleep(delay).await;
                            let _ = request.send().await;
                        });
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                pool.close().await;
                tried.len()
            }));
            Ok(())
        })
    }
    fn expect(&self, _run: &Run, f: &testkit::invariants::Figures) -> Result<(), String> {
        if f.paid == 0 || f.cancelled == 0 {
            return Err(format!(
                "the race never happened: {} paid, {} cancelled",
                f.paid, f.cancelled
            ));
        }
        Ok(())
    }
}
