//! The strategies a flash-sale design weighs, each behind the same request shape as
//! the service (`POST /flash/{sku}/reserve`, a user's bearer JWT, `202` or `409`), and
//! behind the same layers as the service's own router, so that only the reserve
//! step differs between them:
//!
//! request id → trace span → metrics → load shedding, global concurrency limit and
//! timeout → per-IP rate limit → auth (`flashsale`'s `require_user`) → per-user rate
//! limit → handler.
//!
//! | strategy | the reserve step |
//! | --- | --- |
//! | `noop` | nothing: answers `202` at once (the HTTP ceiling) |
//! | `mysql` | one transaction: no order yet? → `UPDATE … num = num - 1 WHERE … num > 0` → insert the order |
//! | `redis-decr` | `HGET` the buyer, `DECR`, `INCR` back when negative, `HSET` the buyer |
//! | `redis-lock` | `SET NX PX` a lock, then read, check, `DECR`, record, release |
//! | `service` | the real `flashsale` application (Lua + Kafka + order consumer) |
//!
//! `redis-decr` and `redis-lock` do only their Redis part: no queue hand-off, no
//! order. They are upper bounds for their approach; a hand-off to Kafka would cost
//! them what it costs the service. `mysql` writes the order synchronously, which is
//! the whole point of it.
//!
//! Besides the sale endpoint, `POST /bench/sales` opens a sale (`{"sku", "stock"}`)
//! and `GET /bench/sales/{sku}` reports its server-side state; both sit outside the
//! layers, like the service's operations endpoints.

pub mod mysql;
pub mod redis_decr;
pub mod redis_lock;
pub mod sale;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use anyhow::Context;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use flashsale::auth::User;
use flashsale::config::Settings;
use flashsale::error::{AppError, AppResult};
use flashsale::http::middleware::{require_user, RateLimiters};
use flashsale::startup::{self, Application};
use flashsale::state::AppState;
use flashsale::stock::RedisConn;
use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sqlx::migrate::MigrateDatabase;
use sqlx::mysql::MySqlPoolOptions;
use sqlx::{MySql, MySqlPool};
use tokio::io::AsyncReadExt;
use tokio::net::TcpListener;

use crate::with_database;
use sale::{Counters, Decided, Keys, Sale};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum StrategyKind {
    Noop,
    Mysql,
    RedisDecr,
    RedisLock,
    Service,
}

impl StrategyKind {
    pub fn name(self) -> &'static str {
        match self {
            StrategyKind::Noop => "noop",
            StrategyKind::Mysql => "mysql",
            StrategyKind::RedisDecr => "redis-decr",
            StrategyKind::RedisLock => "redis-lock",
            StrategyKind::Service => "service",
        }
    }

    /// One line for reports.
    pub fn describe(self) -> &'static str {
        match self {
            StrategyKind::Noop => "no-op endpoint behind the same auth and protection layers (HTTP ceiling)",
            StrategyKind::Mysql => "MySQL alone: per request, check the user's order, conditional UPDATE, insert the order, in one transaction (the seed's \"before\")",
            StrategyKind::RedisDecr => "Redis DECR, INCR back when negative; per-user check and record as separate commands",
            StrategyKind::RedisLock => "Redis lock (SET NX PX) around read, check, DECR, record; then release",
            StrategyKind::Service => "the service: Redis Lua reserve, Kafka publish awaited, order consumer into MySQL",
        }
    }
}

/// How the rate-limit layers are configured in every server of a comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RateLimitMode {
    /// Both limits off (`0`): the generator sends from one IP, as fast as it can.
    Off,
    /// Both limits on with buckets so large they never refuse: the layers run and cost
    /// what they cost, but answer nothing themselves.
    Permissive,
}

/// Options of one `bench-server`.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    pub strategy: StrategyKind,
    pub config_dir: PathBuf,
    pub env: String,
    pub rate_limits: RateLimitMode,
    /// Connections of the `mysql` strategy's pool.
    pub mysql_pool: u32,
    /// `redis-lock`: pause between two attempts at a held lock.
    pub lock_retry: Duration,
    /// `redis-lock`: give up (503) after waiting this long for the lock.
    pub lock_wait: Duration,
    /// `redis-lock`: the lock's expiry, in case its holder dies.
    pub lock_ttl: Duration,
    /// Stop when standard input closes (how `compare` stops its children).
    pub stop_on_stdin_eof: bool,
    /// Keep the database after stopping, for inspection.
    pub keep: bool,
    /// Join the running service of this run id (its database, topic and consumer
    /// group) as a second instance; the database is then left to the first.
    pub join: Option<String>,
}

/// What a started server prints as its first line on stdout (JSON).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Announce {
    pub strategy: StrategyKind,
    pub port: u16,
    pub database: String,
    pub topic: Option<String>,
    /// The order consumers' group, for the service.
    #[serde(default)]
    pub group: Option<String>,
    /// What a second instance passes as `--join`.
    #[serde(default)]
    pub run_id: String,
}

/// The service's settings for one benchmark server: its own database, topic and
/// consumer group, port 0, and the chosen rate-limit mode.
pub fn bench_settings(opts: &ServerOptions, run_id: &str) -> anyhow::Result<(Settings, String)> {
    let mut s = Settings::load_from(&opts.config_dir, &opts.env)?;
    let database = format!("flashsale_bench_{run_id}");
    s.server.addr = "127.0.0.1:0".into();
    s.mysql.url = SecretString::from(with_database(s.mysql.url.expose_secret(), &database));
    s.kafka.topic = format!("flash.bench.{run_id}");
    s.kafka.dead_letter_topic = format!("flash.bench.{run_id}.dlq");
    s.kafka.group_id = format!("flashsale-bench-{run_id}");
    match opts.rate_limits {
        RateLimitMode::Off => {
            s.rate_limit.per_ip_per_sec = 0;
            s.rate_limit.per_user_per_sec = 0;
        }
        RateLimitMode::Permissive => {
            s.rate_limit.per_ip_per_sec = 1_000_000;
            s.rate_limit.per_ip_burst = 1_000_000;
            s.rate_limit.per_user_per_sec = 1_000_000;
            s.rate_limit.per_user_burst = 1_000_000;
        }
    }
    if opts.strategy != StrategyKind::Service {
        // Strategies a–c borrow the application's state (auth, metrics, Redis
        // connection) but never run it: no topics, no workers.
        s.kafka.create_topics = false;
        s.consumer.enabled = false;
        s.orders.sweeper_enabled = false;
        s.reconcile.enabled = false;
    }
    s.validate()?;
    Ok((s, database))
}

/// Resolves when the server should stop: SIGINT/SIGTERM, or standard input closing
/// when asked (a parent closes the pipe; a dying parent closes it too).
async fn stop_requested(stdin_eof: bool) {
    let stdin_closed = async {
        if !stdin_eof {
            return std::future::pending::<()>().await;
        }
        let mut stdin = tokio::io::stdin();
        let mut buf = [0u8; 256];
        loop {
            match stdin.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => continue,
            }
        }
    };
    tokio::select! {
        _ = startup::shutdown_signal() => {}
        _ = stdin_closed => {}
    }
}

fn announce(a: &Announce) -> anyhow::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", serde_json::to_string(a)?).context("failed to write to stdout")?;
    out.flush().context("failed to flush stdout")?;
    Ok(())
}

/// Runs one strategy until asked to stop, then removes what it created.
pub async fn serve(opts: ServerOptions) -> anyhow::Result<()> {
    let run_id = match &opts.join {
        Some(id) => id.clone(),
        None => uuid::Uuid::new_v4().simple().to_string()[..12].to_owned(),
    };
    let (settings, database) = bench_settings(&opts, &run_id)?;
    let telemetry = flashsale::telemetry::init_tracing(&settings.log, &settings.telemetry)?;
    startup::migrate(&settings.mysql)
        .await
        .context("failed to create the benchmark database")?;
    let result = match opts.strategy {
        StrategyKind::Service => serve_service(&opts, settings.clone(), &database, &run_id).await,
        _ => serve_strategy(&opts, settings.clone(), &database, &run_id).await,
    };
    if !opts.keep && opts.join.is_none() {
        cleanup(&settings).await;
    }
    telemetry.shutdown().await;
    result
}

/// Strategy d: the real application, built exactly as `flashsale serve` builds it.
async fn serve_service(
    opts: &ServerOptions,
    settings: Settings,
    database: &str,
    run_id: &str,
) -> anyhow::Result<()> {
    let topic = settings.kafka.topic.clone();
    let group = settings.kafka.group_id.clone();
    let app = Application::build(settings)
        .await
        .context("the service did not build")?;
    announce(&Announce {
        strategy: opts.strategy,
        port: app.port(),
        database: database.to_owned(),
        topic: Some(topic),
        group: Some(group),
        run_id: run_id.to_owned(),
    })?;
    let token = app.shutdown_token();
    let stdin_eof = opts.stop_on_stdin_eof;
    tokio::spawn(async move {
        stop_requested(stdin_eof).await;
        token.cancel();
    });
    app.run_until_stopped().await
}

/// Strategies a–c and the no-op: the service's state for auth and layers, a
/// strategy of our own behind them.
async fn serve_strategy(
    opts: &ServerOptions,
    settings: Settings,
    database: &str,
    run_id: &str,
) -> anyhow::Result<()> {
    // Building the application gives the real `AppState` that `require_user` needs
    // (auth, metrics recorder, settings, Redis connection) through public API only.
    // The application itself is never run; dropping it closes its listener.
    let app = Application::build(settings.clone())
        .await
        .context("the service's state did not build")?;
    let app_state = app.state();
    drop(app);

    let pool = if opts.strategy == StrategyKind::Mysql {
        let pool = MySqlPoolOptions::new()
            .max_connections(opts.mysql_pool)
            .min_connections(opts.mysql_pool)
            .acquire_timeout(Duration::from_millis(settings.mysql.acquire_timeout_ms))
            .connect(settings.mysql.url.expose_secret())
            .await
            .context("failed to connect the mysql strategy's pool")?;
        mysql::create_tables(&pool).await?;
        warm_up(&pool, opts.mysql_pool).await?;
        Some(pool)
    } else {
        None
    };
    let strategy = Strategy {
        kind: opts.strategy,
        prefix: format!("bench:{{{run_id}"),
        sales: Arc::new(RwLock::new(HashMap::new())),
        redis: app_state.stock.connection(),
        pool,
        lock: redis_lock::LockOptions {
            retry: opts.lock_retry,
            wait: opts.lock_wait,
            ttl: opts.lock_ttl,
        },
        release: redis_lock::release_script(),
    };
    let limiters = RateLimiters::new(&settings.rate_limit);
    let app = router(app_state, &limiters, strategy.clone());

    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .context("failed to bind")?;
    let port = listener.local_addr().context("no local address")?.port();
    announce(&Announce {
        strategy: opts.strategy,
        port,
        database: database.to_owned(),
        topic: None,
        group: None,
        run_id: run_id.to_owned(),
    })?;
    let stdin_eof = opts.stop_on_stdin_eof;
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(stop_requested(stdin_eof))
    .await
    .context("HTTP server failed")?;
    strategy.forget_keys().await;
    Ok(())
}

/// Opens every connection of the pool before the first request, as a long-running
/// service would have them.
async fn warm_up(pool: &MySqlPool, n: u32) -> anyhow::Result<()> {
    let mut held = Vec::new();
    for _ in 0..n {
        held.push(
            pool.acquire()
                .await
                .context("failed to open a connection")?,
        );
    }
    Ok(())
}

/// Drops the benchmark database; a failure is only logged.
///
/// The topics stay: tansu 0.6 (the broker on the dev machine) is shared with the
/// test suite, and deleting topics under it is not worth the risk of upsetting its
/// storage. They hold one run's reservations, a few tens of megabytes at most.
async fn cleanup(settings: &Settings) {
    let url = settings.mysql.url.expose_secret();
    if let Err(err) = MySql::drop_database(url).await {
        tracing::warn!(error = %err, "could not drop the benchmark database");
    }
}

#[derive(Clone)]
pub struct Strategy {
    kind: StrategyKind,
    /// `bench:{<run id>`: every key of this server starts with it.
    prefix: String,
    sales: Arc<RwLock<HashMap<String, Arc<Sale>>>>,
    redis: RedisConn,
    pool: Option<MySqlPool>,
    lock: redis_lock::LockOptions,
    release: redis::Script,
}

impl Strategy {
    fn sale(&self, sku: &str) -> Option<Arc<Sale>> {
        // Held only to clone an Arc, never across an await: a std lock is right.
        self.sales
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(sku)
            .cloned()
    }

    fn pool(&self) -> AppResult<&MySqlPool> {
        self.pool
            .as_ref()
            .ok_or_else(|| AppError::Internal(anyhow::anyhow!("the mysql strategy has no pool")))
    }

    fn keys(&self, sku: &str) -> Keys {
        Keys {
            stock: format!("{}:{sku}}}:stock", self.prefix),
            buyers: format!("{}:{sku}}}:buyers", self.prefix),
            lock: format!("{}:{sku}}}:lock", self.prefix),
        }
    }

    /// Deletes every key this server created.
    async fn forget_keys(&self) {
        let keys: Vec<String> = {
            let sales = self.sales.read().unwrap_or_else(|p| p.into_inner());
            sales
                .values()
                .flat_map(|s| {
                    [
                        s.keys.stock.clone(),
                        s.keys.buyers.clone(),
                        s.keys.lock.clone(),
                    ]
                })
                .collect()
        };
        if keys.is_empty() {
            return;
        }
        let mut conn = self.redis.clone();
        let deleted: redis::RedisResult<i64> =
            redis::cmd("UNLINK").arg(&keys).query_async(&mut conn).await;
        if let Err(err) = deleted {
            tracing::warn!(error = %err, "could not delete the benchmark keys");
        }
    }
}

/// The service's router, layer for layer (see `flashsale::http::router`), with the
/// strategy's handler in place of the real one.
fn router(app_state: AppState, limiters: &RateLimiters, strategy: Strategy) -> Router {
    let server = app_state.settings.server.clone();

    let mut user_routes: Router<Strategy> =
        Router::new().route("/flash/{sku}/reserve", post(reserve));
    if let Some(per_user) = limiters.per_user_layer() {
        user_routes = user_routes.layer(per_user);
    }
    let user_routes = user_routes.layer(axum::middleware::from_fn_with_state(
        app_state.clone(),
        require_user,
    ));

    let mut app = Router::new()
        .merge(user_routes)
        .fallback(|| async { AppError::not_found("no such endpoint") })
        .method_not_allowed_fallback(|| async { AppError::MethodNotAllowed });
    if let Some(per_ip) = limiters.per_ip_layer() {
        app = app.layer(per_ip);
    }
    let extra = Router::new()
        .route("/bench/sales", post(open_sale))
        .route("/bench/sales/{sku}", get(sale_state))
        .route("/healthz", get(|| async { "ok" }));
    // The service's own protection and observation layers, shared, not copied.
    flashsale::http::observe(flashsale::http::protect(app, &server).merge(extra), &server)
        .with_state(strategy)
}

/// The `202` body, shaped like the service's.
#[derive(Debug, Serialize)]
struct Reserved {
    reservation_id: String,
    activity_id: &'static str,
    sku: String,
    quantity: u32,
    status: &'static str,
}

fn redis_down(err: redis::RedisError) -> AppError {
    tracing::warn!(error = %err, "redis call failed");
    AppError::Unavailable("stock store unreachable")
}

/// `POST /flash/{sku}/reserve` for strategies a–c and the no-op.
async fn reserve(
    State(s): State<Strategy>,
    Path(sku): Path<String>,
    Extension(user): Extension<User>,
) -> AppResult<(StatusCode, Json<Reserved>)> {
    let reservation_id = uuid::Uuid::now_v7().simple().to_string();
    let activity_id = s.kind.name();
    if s.kind != StrategyKind::Noop {
        let sale = s
            .sale(&sku)
            .ok_or_else(|| AppError::not_found("no sale for this sku"))?;
        let decided = match s.kind {
            StrategyKind::Mysql => {
                mysql::reserve(s.pool()?, &sku, &user.id, &reservation_id).await?
            }
            StrategyKind::RedisDecr => {
                let mut conn = s.redis.clone();
                redis_decr::reserve(&mut conn, &sale, &user.id, &reservation_id)
                    .await
                    .map_err(redis_down)?
            }
            StrategyKind::RedisLock => {
                let mut conn = s.redis.clone();
                redis_lock::reserve(
                    &mut conn,
                    &s.release,
                    &s.lock,
                    &sale,
                    &user.id,
                    &reservation_id,
                )
                .await
                .map_err(redis_down)?
            }
            StrategyKind::Noop | StrategyKind::Service => Decided::Reserved,
        };
        match decided {
            Decided::Reserved => {}
            Decided::AlreadyReserved(reservation_id) => {
                return Err(AppError::AlreadyReserved { reservation_id })
            }
            Decided::SoldOut => return Err(AppError::SoldOut),
            Decided::Busy => return Err(AppError::Unavailable("the stock lock is busy")),
        }
    }
    Ok((
        StatusCode::ACCEPTED,
        Json(Reserved {
            reservation_id,
            activity_id,
            sku,
            quantity: 1,
            status: "pending",
        }),
    ))
}

#[derive(Debug, Deserialize)]
pub struct NewSale {
    pub sku: String,
    pub stock: i64,
}

/// `POST /bench/sales`: opens a sale (or reopens it with fresh stock and no buyers).
async fn open_sale(
    State(s): State<Strategy>,
    Json(new): Json<NewSale>,
) -> AppResult<(StatusCode, Json<Value>)> {
    if !flashsale::input::is_valid_sku(&new.sku) || new.stock < 1 {
        return Err(AppError::invalid(
            "a valid sku and a positive stock are needed",
        ));
    }
    let keys = s.keys(&new.sku);
    match s.kind {
        StrategyKind::Mysql => mysql::open_sale(s.pool()?, &new.sku, new.stock).await?,
        StrategyKind::RedisDecr | StrategyKind::RedisLock => {
            let mut conn = s.redis.clone();
            let _: () = redis::pipe()
                .atomic()
                .set(&keys.stock, new.stock)
                .ignore()
                .del(&keys.buyers)
                .ignore()
                .del(&keys.lock)
                .ignore()
                .query_async(&mut conn)
                .await
                .map_err(redis_down)?;
        }
        StrategyKind::Noop | StrategyKind::Service => {}
    }
    let sale = Arc::new(Sale {
        sku: new.sku.clone(),
        stock: new.stock,
        keys,
        counters: Counters::new(new.stock),
    });
    s.sales
        .write()
        .unwrap_or_else(|p| p.into_inner())
        .insert(new.sku.clone(), sale);
    Ok((
        StatusCode::CREATED,
        Json(json!({ "sku": new.sku, "stock": new.stock })),
    ))
}

/// `GET /bench/sales/{sku}`: the sale as the server holds it, and what went wrong.
async fn sale_state(State(s): State<Strategy>, Path(sku): Path<String>) -> AppResult<Json<Value>> {
    let sale = s
        .sale(&sku)
        .ok_or_else(|| AppError::not_found("no sale for this sku"))?;
    let (stock_left, buyers) = match s.kind {
        StrategyKind::Mysql => {
            let (left, orders, distinct) = mysql::state(s.pool()?, &sku).await?;
            (
                Some(left),
                json!({ "orders": orders, "distinct_buyers": distinct }),
            )
        }
        StrategyKind::RedisDecr | StrategyKind::RedisLock => {
            let mut conn = s.redis.clone();
            let (left, recorded): (Option<i64>, i64) = redis::pipe()
                .get(&sale.keys.stock)
                .hlen(&sale.keys.buyers)
                .query_async(&mut conn)
                .await
                .map_err(redis_down)?;
            (left, json!({ "distinct_buyers": recorded }))
        }
        StrategyKind::Noop | StrategyKind::Service => (None, Value::Null),
    };
    let c = &sale.counters;
    let units_sold = stock_left.map(|left| sale.stock - left);
    Ok(Json(json!({
        "strategy": s.kind.name(),
        "sku": sku,
        "stock": sale.stock,
        "stock_left": stock_left,
        "units_sold": units_sold,
        "buyers": buyers,
        "double_wins": c.double_wins.load(Ordering::Relaxed),
        "negative_decrements": c.negative_decrements.load(Ordering::Relaxed),
        "lowest_stock_seen": c.lowest_stock_seen.load(Ordering::Relaxed),
        "lock_waits": c.lock_waits.load(Ordering::Relaxed),
        "lock_timeouts": c.lock_timeouts.load(Ordering::Relaxed),
        "locks_lost": c.locks_lost.load(Ordering::Relaxed),
    })))
}
