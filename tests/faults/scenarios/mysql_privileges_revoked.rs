//! MySQL answers an error the code has never seen: the services' own user loses
//! its INSERT privilege mid-sale for a few seconds (ER_TABLEACCESS_DENIED_ERROR).
//! Unknown errors are transient: retried with backoff, never refunded, never
//! dead-lettered, and every order lands once the privilege is back.

use std::time::Duration;

use futures::future::BoxFuture;

use crate::harness::{Fault, Run, Setup};

pub struct MysqlPrivilegesRevoked;

impl Fault for MysqlPrivilegesRevoked {
    fn id(&self) -> &'static str {
        "mysql_privileges_revoked"
    }
    fn name(&self) -> &'static str {
        "mysql errors never seen (INSERT revoked)"
    }
    fn prepare(&self, setup: &mut Setup) {
        setup.own_mysql_user = true;
    }
    fn inject<'a>(&'a self, run: &'a mut Run) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let user = run.mysql_user.clone().ok_or("no user of its own")?;
            let on = format!("`{}`.`orders`", run.db);
            let before = run
                .metric("flashsale_consumer_transient_errors_total")
                .await;
            run.as_root(&format!("REVOKE INSERT ON {on} FROM '{user}'@'127.0.0.1'"))
                .await?;
            tokio::time::sleep(Duration::from_secs(4)).await;
            let during = run
                .metric("flashsale_consumer_transient_errors_total")
                .await;
            run.as_root(&format!("GRANT INSERT ON {on} TO '{user}'@'127.0.0.1'"))
                .await?;
            run.background_counts
                .push((during - before).max(0.0) as usize);
            Ok(())
        })
    }
    fn expect(&self, run: &Run, _f: &testkit::invariants::Figures) -> Result<(), String> {
        match run.background_counts.first() {
            Some(n) if *n > 0 => Ok(()),
            _ => Err("the revoked privilege caused no error: the fault did not bite".into()),
        }
    }
}
