//! Order consumer throughput into MariaDB, for several batch sizes.
//!
//!     scripts/bench.sh consumer               # starts the services, then this
//!     cargo bench -p flashsale-bench --bench consumer   # needs scripts/services.sh first
//!     BENCH_ORDERS=20000 scripts/bench.sh consumer
//!
//! Two figures per batch size:
//! - `writer`: the MySQL + Redis half alone (`OrderWriter`: one transaction per
//!   batch, then the pending marks cleared), fed from memory;
//! - `end to end`: messages already on a topic, consumed by the real
//!   `OrderConsumer` (Kafka fetch, parse, write, offset commit), timed from the
//!   first order's commit to the last one's, as MySQL recorded them.
//!
//! Each run uses its own database, topic and activity; nothing is asserted.

use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::Utc;
use flashsale::activity::{ActivityRepo, NewActivity};
use flashsale::config::Settings;
use flashsale::kafka::{self, Publisher, ReservationMessage};
use flashsale::orders::{Incoming, OrderConsumer, OrderRepo, OrderWriter};
use flashsale::startup;
use flashsale::stock::{RedisConn, StockStore};
use flashsale_bench::with_database;
use secrecy::{ExposeSecret, SecretString};
use tokio_util::sync::CancellationToken;

const BATCH_SIZES: [usize; 4] = [1, 10, 100, 500];

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let orders: usize = std::env::var("BENCH_ORDERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    // The service's own configuration, one folder above this crate.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("config");
    let base = Settings::load_from(&dir, "test")?;
    println!("order consumer throughput into MariaDB ({orders} orders per run, batch sizes {BATCH_SIZES:?})");
    println!("| batch size | writer orders/s | end-to-end orders/s |");
    println!("| ---: | ---: | ---: |");
    for batch in BATCH_SIZES {
        // Batch size 1 is slow by nature; a smaller run says the same.
        let n = if batch == 1 {
            orders.min(2_000)
        } else {
            orders
        };
        let writer = writer_run(&base, batch, n).await?;
        let e2e = end_to_end_run(&base, batch, n).await?;
        println!("| {batch} | {writer:.0} | {e2e:.0} |");
    }
    Ok(())
}

struct Env {
    settings: Settings,
    repo: OrderRepo,
    stock: StockStore,
    activity_id: String,
}

async fn environment(base: &Settings, tag: &str) -> anyhow::Result<Env> {
    let id = uuid::Uuid::new_v4().simple().to_string();
    let mut settings = base.clone();
    settings.mysql.url = SecretString::from(with_database(
        base.mysql.url.expose_secret(),
        &format!("flashsale_bench_{tag}_{id}"),
    ));
    settings.mysql.max_connections = 4;
    settings.kafka.topic = format!("flash.bench.{id}");
    settings.kafka.dead_letter_topic = format!("flash.bench.{id}.dlq");
    settings.kafka.group_id = format!("flashsale-bench-{id}");
    startup::migrate(&settings.mysql).await?;
    let pool = startup::connect_mysql(&settings.mysql).await?;
    let activities = ActivityRepo::new(pool.clone());
    let now = Utc::now();
    let activity = NewActivity {
        id: None,
        sku: format!("bench-{id}"),
        stock: 10_000_000,
        per_user_limit: 1,
        starts_at: now - chrono::Duration::minutes(1),
        ends_at: now + chrono::Duration::hours(1),
        payment_timeout_secs: 900,
        stock_shards: 1,
        admission: flashsale::activity::Admission::Open,
        waiting_room_secs: 600,
        price: None,
        currency: None,
    }
    .validate()
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let activity = activities
        .create(&activity)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let stock = StockStore::new(RedisConn::connect(&settings.redis).await?);
    Ok(Env {
        settings,
        repo: OrderRepo::new(pool),
        stock,
        activity_id: activity.id,
    })
}

impl Env {
    fn writer(&self) -> OrderWriter {
        OrderWriter {
            repo: self.repo.clone(),
            stock: self.stock.clone(),
        }
    }
}

async fn drop_database(env: &Env) -> anyhow::Result<()> {
    let url = env.settings.mysql.url.expose_secret().to_owned();
    env.repo.pool().close().await;
    <sqlx::MySql as sqlx::migrate::MigrateDatabase>::drop_database(&url).await?;
    Ok(())
}

fn incoming(activity_id: &str, i: usize) -> Incoming {
    Incoming {
        reservation_id: format!("r{i}"),
        activity_id: activity_id.to_owned(),
        user_id: format!("u{i}"),
        quantity: 1,
    }
}

async fn writer_run(base: &Settings, batch: usize, n: usize) -> anyhow::Result<f64> {
    let env = environment(base, "w").await?;
    let writer = env.writer();
    let all: Vec<Incoming> = (0..n).map(|i| incoming(&env.activity_id, i)).collect();
    let never = CancellationToken::new();
    let started = Instant::now();
    for chunk in all.chunks(batch) {
        let (decisions, _) = writer
            .write(chunk, &never)
            .await
            .context("writer stopped")?;
        writer.settle(chunk, &decisions).await;
    }
    let rate = n as f64 / started.elapsed().as_secs_f64();
    drop_database(&env).await?;
    Ok(rate)
}

async fn end_to_end_run(base: &Settings, batch: usize, n: usize) -> anyhow::Result<f64> {
    let mut env = environment(base, "e").await?;
    env.settings.consumer.batch_size = batch;
    env.settings.consumer.batch_wait_ms = 5;
    kafka::ensure_topics(
        &env.settings.kafka,
        &[
            &env.settings.kafka.topic,
            &env.settings.kafka.dead_letter_topic,
        ],
    )
    .await?;
    let publisher = Publisher::new(&env.settings.kafka)?;
    let sends = (0..n).map(|i| {
        let publisher = publisher.clone();
        let m = incoming(&env.activity_id, i);
        async move {
            publisher
                .publish(&ReservationMessage {
                    reservation_id: m.reservation_id,
                    activity_id: m.activity_id,
                    sku: "bench".into(),
                    user_id: m.user_id,
                    quantity: 1,
                    reserved_at: Utc::now(),
                })
                .await
        }
    });
    for r in futures::future::join_all(sends).await {
        r?;
    }
    let consumer = OrderConsumer::new(&env.settings, env.writer(), publisher)?;
    let stop = CancellationToken::new();
    let task = tokio::spawn(consumer.run(stop.clone()));
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let (count,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM orders")
            .fetch_one(env.repo.pool())
            .await?;
        if count as usize >= n {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "consumer did not finish");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.cancel();
    task.await?;
    // MySQL's own clock: from the first order's commit to the last one's.
    let (span_ms,): (i64,) = sqlx::query_as(
        "SELECT CAST(TIMESTAMPDIFF(MICROSECOND, MIN(created_at), MAX(created_at)) / 1000 AS SIGNED) FROM orders",
    )
    .fetch_one(env.repo.pool())
    .await?;
    drop_database(&env).await?;
    Ok(n as f64 / (span_ms.max(1) as f64 / 1000.0))
}
