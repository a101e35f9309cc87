//! The "other business" that must not suffer: a client of the same MariaDB server
//! that reads a table of its own at a fixed, modest rate.
//!
//! It runs for the whole comparison on its own thread and runtime (so the
//! orchestrator's other work cannot delay it) and keeps every sample with its
//! wall-clock time; each run's figures are the samples inside that run's window.
//! The query is a primary-key point read on a table of 10,000 rows in a database of
//! its own, fully cached by InnoDB: on an idle server it takes a fraction of a
//! millisecond, so what it measures is how long the server makes it wait.

use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::{Deserialize, Serialize};
use sqlx::mysql::MySqlPoolOptions;
use sqlx::MySqlPool;
use tokio_util::sync::CancellationToken;

use crate::clock::now_unix_ms;
use crate::loadgen::{cdf_points, new_histogram, Latency};

const ROWS: i64 = 10_000;

/// One side query: when it was due (unix ms) and how long it took (µs), or that it
/// failed.
#[derive(Debug, Clone, Copy)]
struct Sample {
    due_unix_ms: f64,
    micros: Option<u64>,
}

/// Latency of the side query within one window.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SideStats {
    pub queries: u64,
    pub failed: u64,
    pub latency: Latency,
    pub cdf: Vec<(f64, f64)>,
}

pub struct SideQuery {
    stop: CancellationToken,
    samples: Arc<Mutex<Vec<Sample>>>,
    thread: Option<JoinHandle<()>>,
    pub rate: f64,
}

/// Creates the side table and fills it (idempotent).
async fn prepare(pool: &MySqlPool) -> anyhow::Result<()> {
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS customers (
             id         INT NOT NULL,
             name       VARCHAR(64) NOT NULL,
             balance    DECIMAL(12, 2) NOT NULL,
             updated_at DATETIME(3) NOT NULL DEFAULT CURRENT_TIMESTAMP(3),
             PRIMARY KEY (id)
         ) ENGINE = InnoDB",
    )
    .execute(pool)
    .await
    .context("failed to create the side table")?;
    let have: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM customers")
        .fetch_one(pool)
        .await?;
    if have >= ROWS {
        return Ok(());
    }
    for chunk_start in (0..ROWS).step_by(1000) {
        let mut q = sqlx::QueryBuilder::new("INSERT IGNORE INTO customers (id, name, balance) ");
        q.push_values(chunk_start..(chunk_start + 1000).min(ROWS), |mut b, i| {
            b.push_bind(i)
                .push_bind(format!("customer-{i}"))
                .push_bind((i % 997) as f64 * 3.25);
        });
        q.build()
            .execute(pool)
            .await
            .context("failed to fill the side table")?;
    }
    Ok(())
}

impl SideQuery {
    /// Prepares the table at `url` (a database the caller created) and starts
    /// querying it `rate` times per second until [`SideQuery::stop`].
    pub async fn start(url: &str, rate: f64) -> anyhow::Result<SideQuery> {
        anyhow::ensure!(rate > 0.0, "the side query rate must be positive");
        // A small pool of its own, opened up front, as another service would have.
        let setup = MySqlPoolOptions::new()
            .max_connections(1)
            .connect(url)
            .await
            .context("failed to connect the side client")?;
        prepare(&setup).await?;
        setup.close().await;

        let stop = CancellationToken::new();
        let samples = Arc::new(Mutex::new(Vec::new()));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<anyhow::Result<()>>();
        let thread = {
            let stop = stop.clone();
            let samples = samples.clone();
            let url = url.to_owned();
            std::thread::Builder::new()
                .name("side-query".into())
                .spawn(move || {
                    let runtime = match tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                    {
                        Ok(rt) => rt,
                        Err(err) => {
                            let _ = ready_tx.send(Err(err.into()));
                            return;
                        }
                    };
                    runtime.block_on(run(url, rate, stop, samples, ready_tx));
                })
                .context("failed to start the side-query thread")?
        };
        // The thread reports once its pool is open.
        ready_rx
            .recv_timeout(Duration::from_secs(15))
            .context("the side client did not start")??;
        Ok(SideQuery {
            stop,
            samples,
            thread: Some(thread),
            rate,
        })
    }

    /// The side query's latency for requests due within `[from, to]` (unix ms).
    pub fn window(&self, from_unix_ms: f64, to_unix_ms: f64) -> anyhow::Result<SideStats> {
        self.windows(&[(from_unix_ms, to_unix_ms)])
    }

    /// The side query's latency for requests due within any of `windows`
    /// (`[from, to]`, unix ms), pooled.
    pub fn windows(&self, windows: &[(f64, f64)]) -> anyhow::Result<SideStats> {
        let samples = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        let mut hist = new_histogram()?;
        let mut failed = 0;
        let mut queries = 0;
        for s in samples.iter().filter(|s| {
            windows
                .iter()
                .any(|(from, to)| s.due_unix_ms >= *from && s.due_unix_ms <= *to)
        }) {
            queries += 1;
            match s.micros {
                Some(us) => hist.saturating_record(us.max(1)),
                None => failed += 1,
            }
        }
        Ok(SideStats {
            queries,
            failed,
            latency: Latency::of(&hist),
            cdf: cdf_points(&hist),
        })
    }

    /// Side queries sent so far.
    pub fn sent(&self) -> u64 {
        self.samples.lock().unwrap_or_else(|p| p.into_inner()).len() as u64
    }

    pub fn stop(mut self) {
        self.stop.cancel();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn run(
    url: String,
    rate: f64,
    stop: CancellationToken,
    samples: Arc<Mutex<Vec<Sample>>>,
    ready: std::sync::mpsc::Sender<anyhow::Result<()>>,
) {
    let pool = match MySqlPoolOptions::new()
        .max_connections(4)
        .min_connections(4)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&url)
        .await
    {
        Ok(p) => p,
        Err(err) => {
            let _ = ready.send(Err(anyhow::Error::new(err).context("side pool")));
            return;
        }
    };
    let _ = ready.send(Ok(()));
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    // A late tick is sent at once, not skipped: the rate stays what was asked.
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut n: i64 = 0;
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tick.tick() => {}
        }
        n += 1;
        // Spread the reads over the table (a multiplicative hash of the counter).
        let id = (n.wrapping_mul(7919)).rem_euclid(ROWS);
        let pool = pool.clone();
        let samples = samples.clone();
        // Each query is its own task, so one slow answer does not delay the next
        // query's start; waiting for a free connection counts in its latency.
        tokio::spawn(async move {
            let due_unix_ms = now_unix_ms();
            let started = Instant::now();
            let result: Result<Option<(String, f64)>, sqlx::Error> =
                sqlx::query_as("SELECT name, CAST(balance AS DOUBLE) FROM customers WHERE id = ?")
                    .bind(id)
                    .fetch_optional(&pool)
                    .await;
            let micros = result
                .ok()
                .map(|_| u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX));
            samples
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(Sample {
                    due_unix_ms,
                    micros,
                });
        });
    }
    pool.close().await;
}
