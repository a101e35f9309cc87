//! A MySQL database of one test's own, dropped when the test is done with it,
//! whether the test passed, failed or panicked (crates.io's `TestDatabase` does
//! the same for PostgreSQL).

use std::time::Duration;

use sqlx::Connection;

/// The MySQL server the tests use when they start none of their own.
pub const SERVER: &str = "mysql://root@127.0.0.1:3306";

/// A database name on a server; nothing is created here (the migrations the
/// test runs create it). Dropping the guard drops the database.
#[derive(Debug)]
pub struct TestDatabase {
    server: String,
    name: String,
}

impl TestDatabase {
    /// The database `name` on `server` (`mysql://user@host:port`, no path).
    pub fn new(server: &str, name: &str) -> TestDatabase {
        TestDatabase {
            server: server.trim_end_matches('/').to_owned(),
            name: name.to_owned(),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The URL a service connects with.
    pub fn url(&self) -> String {
        format!("{}/{}", self.server, self.name)
    }
}

impl Drop for TestDatabase {
    /// Drop runs where the test ends, often on the test's own runtime thread,
    /// where blocking on an async client would stall the very tasks it waits
    /// for. The drop runs on a thread of its own with a runtime of its own, and
    /// this waits for it, so no database outlives its test process.
    fn drop(&mut self) {
        let (server, name) = (self.server.clone(), self.name.clone());
        let dropper = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| format!("a runtime for the drop: {e}"))?;
            runtime.block_on(drop_database(&server, &name))
        });
        let result = dropper
            .join()
            .unwrap_or_else(|_| Err("the dropping thread panicked".into()));
        if let Err(e) = result {
            eprintln!("test database {} left behind: {e}", self.name);
        }
    }
}

/// Ends every session still using the database (a test that stopped early
/// leaves its app's connections open, and one of them may hold a transaction
/// whose locks `DROP DATABASE` would wait for), then drops it.
async fn drop_database(server: &str, name: &str) -> Result<(), String> {
    let mut conn = sqlx::MySqlConnection::connect(server)
        .await
        .map_err(|e| format!("connecting to {server}: {e}"))?;
    // A lock held by a session that slipped in after the kills is waited for,
    // but not for the server's default of a day.
    sqlx::query("SET SESSION lock_wait_timeout = 30")
        .execute(&mut conn)
        .await
        .map_err(|e| format!("setting the lock wait: {e}"))?;
    let sessions: Vec<i64> = sqlx::query_scalar(
        "SELECT CAST(ID AS SIGNED) FROM information_schema.PROCESSLIST \
         WHERE DB = ? AND ID <> CONNECTION_ID()",
    )
    .bind(name)
    .fetch_all(&mut conn)
    .await
    .map_err(|e| format!("listing the sessions: {e}"))?;
    for id in sessions {
        // A session that ended meanwhile is no longer there to kill.
        let _ = sqlx::query(&format!("KILL CONNECTION {id}"))
            .execute(&mut conn)
            .await;
    }
    let dropped = tokio::time::timeout(
        Duration::from_secs(40),
        sqlx::query(&format!("DROP DATABASE IF EXISTS `{name}`")).execute(&mut conn),
    )
    .await;
    let _ = conn.close().await;
    match dropped {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(format!("DROP DATABASE: {e}")),
        Err(_) => Err("DROP DATABASE took over 40 s".into()),
    }
}
