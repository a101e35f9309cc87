//! Building and running the service. `Application::build` binds its own listener
//! (port 0 in tests) and connects to its dependencies; `run_until_stopped` serves
//! until the shutdown token is cancelled, then drains in-flight work and flushes the
//! producer.

use std::future::IntoFuture;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use secrecy::ExposeSecret;
use sqlx::migrate::MigrateDatabase;
use sqlx::mysql::MySqlPoolOptions;
use sqlx::{MySql, MySqlPool};
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::activity::{ActivityCache, ActivityRepo};
use crate::audit::AuditRepo;
use crate::auth::{Auth, UserIds};
use crate::config::{MysqlSettings, RedisSettings, ReplicasAcked, ServerSettings, Settings};
use crate::http::{self, RateLimiters};
use crate::kafka::{self, Publisher};
use crate::operators::Operators;
use crate::orders::{OrderConsumer, OrderRepo, OrderWriter, Sweeper};
use crate::periodic;
use crate::readiness::{self, Readiness};
use crate::reconcile::{Reconciler, Report};
use crate::reservation::Reservations;
use crate::state::{AppState, Inner};
use crate::stock::{Family, RedisConn, StockStore, Topology};
use crate::stocking::Stocking;
use crate::telemetry::{self, LiveFigures};
use crate::waiting_room::WaitingRoom;

pub struct Application {
    listener: TcpListener,
    port: u16,
    /// `server.ops_addr`'s listener: health, readiness and metrics only.
    ops_listener: Option<TcpListener>,
    ops_port: Option<u16>,
    state: AppState,
    limiters: RateLimiters,
    shutdown: CancellationToken,
}

/// Connects the MySQL pool.
pub async fn connect_mysql(settings: &MysqlSettings) -> anyhow::Result<MySqlPool> {
    MySqlPoolOptions::new()
        .max_connections(settings.max_connections)
        .acquire_timeout(Duration::from_millis(settings.acquire_timeout_ms))
        .connect(settings.url.expose_secret())
        .await
        .context("failed to connect to MySQL")
}

/// Creates the database if it is missing and applies `migrations/`.
pub async fn migrate(settings: &MysqlSettings) -> anyhow::Result<()> {
    let url = settings.url.expose_secret();
    if !MySql::database_exists(url)
        .await
        .context("failed to reach MySQL")?
    {
        MySql::create_database(url)
            .await
            .context("failed to create the database")?;
    }
    let pool = connect_mysql(settings).await?;
    sqlx::migrate!("./migrations")
        .run(&pool)
        .await
        .context("failed to apply migrations")?;
    pool.close().await;
    Ok(())
}

/// The reservation and dead-letter topics, when `kafka.create_topics` is on.
async fn create_topics(settings: &Settings) -> anyhow::Result<()> {
    if settings.kafka.create_topics {
        let topics = [
            settings.kafka.topic.as_str(),
            settings.kafka.dead_letter_topic.as_str(),
        ];
        kafka::ensure_topics(&settings.kafka, &topics)
            .await
            .context("failed to create the Kafka topics")?;
    }
    Ok(())
}

/// The parts over MySQL and Redis that every role uses, each built once from the
/// settings and connected to the others here, and nowhere else: `serve`,
/// `consume` and `reconcile` all start from it.
pub struct Services {
    pub pool: MySqlPool,
    /// The shared Redis connection (the stock store and the waiting room use it).
    pub redis: RedisConn,
    pub stock: StockStore,
    pub activities: ActivityRepo,
    pub orders: OrderRepo,
    /// The one decision step, over `orders` and `stock`.
    pub writer: OrderWriter,
    pub reconciler: Reconciler,
}

impl Services {
    /// MySQL, Redis and the parts over them.
    pub async fn connect(settings: &Settings) -> anyhow::Result<Self> {
        Self::connect_with(settings, false).await
    }

    /// The same, and the replica barrier the reservation path waits on (see
    /// `StockStore::replicated`): only a process that answers reservations needs it.
    pub async fn connect_serving(settings: &Settings) -> anyhow::Result<Self> {
        Self::connect_with(settings, true).await
    }

    async fn connect_with(settings: &Settings, barrier: bool) -> anyhow::Result<Self> {
        let pool = connect_mysql(&settings.mysql).await?;
        // The shared connection and the replica barrier's follow failovers together.
        let family = Family::default();
        let redis = RedisConn::connect_in(&settings.redis, &family).await?;
        let mut stock = StockStore::new(redis.clone());
        if barrier {
            stock = stock.with_replica_barrier(
                replica_barrier(&settings.redis, &family).await?,
                settings.redis.min_replicas_acked,
                Duration::from_millis(settings.redis.replica_ack_timeout_ms),
            );
        }
        let activities = ActivityRepo::new(pool.clone());
        let orders = OrderRepo::new(pool.clone()).with_clock(stock.clock().clone());
        let writer = OrderWriter::new(orders.clone(), stock.clone());
        let reconciler = Reconciler::new(
            activities.clone(),
            orders.clone(),
            stock.clone(),
            settings.kafka.clone(),
            Duration::from_secs(settings.reconcile.pending_deadline_secs),
            Duration::from_secs(settings.redis.retain_after_end_secs),
            Duration::from_secs(settings.waiting_room.turn_secs),
        );
        Ok(Services {
            pool,
            redis,
            stock,
            activities,
            orders,
            writer,
            reconciler,
        })
    }

    /// The activity cache over the repository, loaded once.
    async fn loaded_cache(&self) -> anyhow::Result<ActivityCache> {
        let cache = ActivityCache::new(self.activities.clone());
        cache
            .refresh()
            .await
            .context("failed to load the activities")?;
        Ok(cache)
    }
}

/// How long a start waits for its first reading of the shared clock.
const FIRST_SAMPLE_WITHIN: Duration = Duration::from_secs(2);

/// How often an instance that found MySQL's user-id columns narrow looks again.
const USER_ID_COLUMNS_EVERY: Duration = Duration::from_secs(30);

/// Whether MySQL's user-id columns hold providers' ids (the migration
/// `20261210000002_user_ids_as_bytes` applied): from the start, or, when they
/// do not yet, from the first look that finds them widened (every
/// [`USER_ID_COLUMNS_EVERY`], in the background). Until then only ids of the
/// narrow form are accepted (`auth::UserIds`).
async fn user_ids(pool: &MySqlPool) -> UserIds {
    let ids = UserIds::narrow();
    if user_id_columns_widened(pool).await {
        ids.widen();
        return ids;
    }
    tracing::warn!("MySQL's user-id columns are not widened yet (run `flashsale migrate` once every instance runs this release): only user ids of [A-Za-z0-9_-]{{1,64}} are accepted until then");
    let (pool, watched) = (pool.clone(), ids.clone());
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(USER_ID_COLUMNS_EVERY).await;
            if user_id_columns_widened(&pool).await {
                watched.widen();
                tracing::info!(
                    "MySQL's user-id columns are widened: providers' user ids are accepted"
                );
                return;
            }
        }
    });
    ids
}

async fn user_id_columns_widened(pool: &MySqlPool) -> bool {
    let found: Result<Option<String>, sqlx::Error> = sqlx::query_scalar(
        "SELECT CAST(DATA_TYPE AS CHAR) FROM information_schema.COLUMNS \
         WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'orders' AND COLUMN_NAME = 'user_id'",
    )
    .fetch_optional(pool)
    .await;
    match found {
        Ok(kind) => kind.is_some_and(|k| k.eq_ignore_ascii_case("varbinary")),
        Err(err) => {
            tracing::warn!(error = %err, "could not look at MySQL's user-id columns");
            false
        }
    }
}

/// The API's listener and, when `server.ops_addr` is set, the operations one.
async fn bind_listeners(
    settings: &ServerSettings,
) -> anyhow::Result<(TcpListener, Option<TcpListener>)> {
    let listener = TcpListener::bind(&settings.addr)
        .await
        .with_context(|| format!("failed to bind {}", settings.addr))?;
    let ops_listener = match &settings.ops_addr {
        Some(addr) => Some(
            TcpListener::bind(addr)
                .await
                .with_context(|| format!("failed to bind server.ops_addr {addr}"))?,
        ),
        None => None,
    };
    Ok((listener, ops_listener))
}

impl Application {
    pub async fn build(settings: Settings) -> anyhow::Result<Self> {
        let metrics = telemetry::metrics_handle()?;
        let services = Services::connect_serving(&settings).await?;
        services
            .stock
            .clock()
            .first_sample(FIRST_SAMPLE_WITHIN)
            .await;
        let readiness = Readiness::default();
        for warning in redis_durability(&settings.redis, &services.stock).await {
            readiness.warn(warning);
        }
        let publisher = Publisher::new(&settings.kafka)?;
        create_topics(&settings).await?;
        let cache = services.loaded_cache().await?;
        let user_ids = user_ids(&services.pool).await;
        let auth = Auth::from_settings(&settings.auth)?
            .with_clock(services.stock.clock().clone())
            .with_user_ids(user_ids);
        let operators = Operators::from_settings(&settings.auth)?;
        let (listener, ops_listener) = bind_listeners(&settings.server).await?;
        let port = listener.local_addr().context("no local address")?.port();
        let ops_port = match &ops_listener {
            Some(l) => Some(l.local_addr().context("no local address")?.port()),
            None => None,
        };
        let limiters = RateLimiters::new(&settings.rate_limit);
        let Services {
            pool,
            redis,
            stock,
            activities,
            orders,
            writer,
            reconciler,
        } = services;
        let waiting_room = Arc::new(WaitingRoom::new(
            redis,
            pool.clone(),
            stock.clone(),
            orders.clone(),
            settings.waiting_room.clone(),
        ));
        let reconcile_now = Arc::new(Notify::new());
        let reservations = Reservations::new(
            stock.clone(),
            publisher.clone(),
            writer.clone(),
            reconcile_now.clone(),
        );
        let stocking = Stocking::new(
            activities.clone(),
            stock.clone(),
            reconciler.clone(),
            reconcile_now.clone(),
        );
        let audit = AuditRepo::new(pool.clone());
        let state = AppState::new(Inner {
            settings,
            pool,
            activities,
            cache,
            orders,
            stock,
            waiting_room,
            reservations,
            writer,
            stocking,
            publisher,
            auth,
            operators,
            audit,
            reconciler,
            reconcile_now,
            metrics,
            critical: TaskTracker::new(),
            draining: CancellationToken::new(),
            readiness,
            live_figures: LiveFigures::new(),
        });
        Ok(Application {
            listener,
            port,
            ops_listener,
            ops_port,
            state,
            limiters,
            shutdown: CancellationToken::new(),
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The port of `server.ops_addr`'s listener, when it is set.
    pub fn ops_port(&self) -> Option<u16> {
        self.ops_port
    }

    pub fn state(&self) -> AppState {
        self.state.clone()
    }

    /// Cancel this token to stop the application gracefully, at once.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Cancel this token to stop the way an orchestrator expects (SIGTERM):
    /// `/readyz` turns `503` at once, the server keeps serving for
    /// `server.drain_delay_secs` while load balancers notice, then stops taking
    /// requests and finishes those in flight within `server.shutdown_grace_secs`.
    pub fn drain_token(&self) -> CancellationToken {
        self.state.draining.clone()
    }

    pub async fn run_until_stopped(self) -> anyhow::Result<()> {
        let Application {
            listener,
            ops_listener,
            state,
            limiters,
            shutdown,
            ..
        } = self;
        let background = TaskTracker::new();
        spawn_upkeep(&state, &limiters, &background, &shutdown);
        spawn_workers(&state, &background, &shutdown)?;

        let app = http::router(state.clone(), &limiters);
        tracing::info!(addr = %listener.local_addr()?, "serving");
        if let Some(ops_listener) = ops_listener {
            spawn_ops_listener(ops_listener, &state, &background, &shutdown)?;
        }
        spawn_drain(&state, &background, &shutdown);
        let grace = Duration::from_secs(state.settings.server.shutdown_grace_secs);
        let stop = shutdown.clone();
        let server = axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .with_graceful_shutdown(async move { stop.cancelled().await })
        .into_future();
        // Requests in flight get the grace period; connections still open after
        // it are closed.
        tokio::select! {
            served = server => served.context("HTTP server failed")?,
            _ = async {
                shutdown.cancelled().await;
                tokio::time::sleep(grace).await;
            } => tracing::warn!("requests still open at the end of the grace period; closing them"),
        }

        // In-flight reservations finish (publish or refund) before the producer is
        // flushed and the process exits.
        state.critical.close();
        if tokio::time::timeout(grace, state.critical.wait())
            .await
            .is_err()
        {
            tracing::error!("reservations still in flight at the end of the grace period");
        }
        shutdown.cancel();
        background.close();
        let _ = tokio::time::timeout(grace, background.wait()).await;
        let publisher = state.publisher.clone();
        tokio::task::spawn_blocking(move || publisher.flush(grace))
            .await
            .context("producer flush task failed")?;
        state.pool.close().await;
        tracing::info!("stopped");
        Ok(())
    }
}

/// The background work every serving instance runs: the activity cache's
/// refresh, the readiness prober, the rate limiters' and metrics' upkeep, the
/// sold-out gate and the waiting rooms.
fn spawn_upkeep(
    state: &AppState,
    limiters: &RateLimiters,
    background: &TaskTracker,
    shutdown: &CancellationToken,
) {
    background.spawn(state.cache.clone().run_refresher(
        Duration::from_millis(state.settings.activities.refresh_interval_ms.max(100)),
        shutdown.clone(),
    ));
    background.spawn(readiness::run(
        state.readiness.clone(),
        state.stock.clone(),
        state.pool.clone(),
        state.publisher.clone(),
        shutdown.clone(),
    ));
    background.spawn(state.stock.clock().clone().run(shutdown.clone()));
    background.spawn(prune_rate_limiters(limiters.clone(), shutdown.clone()));
    // The identity provider's JWKS (when configured): fetched now and kept fresh.
    background.spawn(state.auth.clone().run_key_refresher(shutdown.clone()));
    background.spawn(metrics_upkeep(state.clone(), shutdown.clone()));
    background.spawn(state.stock.clone().run_sold_out_gate(shutdown.clone()));
    background.spawn(crate::waiting_room::run(
        state.waiting_room.clone(),
        state.cache.clone(),
        shutdown.clone(),
    ));
}

/// Serves `server.ops_addr`'s listener until `shutdown`.
fn spawn_ops_listener(
    ops_listener: TcpListener,
    state: &AppState,
    background: &TaskTracker,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    tracing::info!(addr = %ops_listener.local_addr()?, "serving health, readiness and metrics");
    let ops = http::ops_router(state.clone());
    let stop = shutdown.clone();
    background.spawn(async move {
        let served = axum::serve(
            ops_listener,
            ops.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .with_graceful_shutdown(stop.cancelled_owned())
        .await;
        if let Err(err) = served {
            tracing::error!(error = %err, "the operations listener failed");
        }
    });
    Ok(())
}

/// Draining: not ready first, then, after `server.drain_delay_secs`, the server
/// stops.
fn spawn_drain(state: &AppState, background: &TaskTracker, shutdown: &CancellationToken) {
    let drain_delay = Duration::from_secs(state.settings.server.drain_delay_secs);
    let (draining, shutdown) = (state.draining.clone(), shutdown.clone());
    background.spawn(async move {
        tokio::select! {
            _ = draining.cancelled() => {
                tracing::info!(?drain_delay, "draining: not ready; stopping after the delay");
                tokio::select! {
                    _ = tokio::time::sleep(drain_delay) => shutdown.cancel(),
                    _ = shutdown.cancelled() => {}
                }
            }
            _ = shutdown.cancelled() => {}
        }
    });
}

/// The order consumer and the sweeper, each switchable in the configuration, so
/// one binary scales by role.
fn spawn_workers(
    state: &AppState,
    tracker: &TaskTracker,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    let settings = &state.settings;
    if settings.consumer.enabled {
        let consumer = OrderConsumer::new(settings, state.writer.clone(), state.publisher.clone())?;
        tracker.spawn(consumer.run(shutdown.clone()));
    }
    if settings.reconcile.enabled {
        tracker.spawn(state.reconciler.clone().run(
            state.cache.clone(),
            Duration::from_secs(settings.reconcile.interval_secs),
            state.reconcile_now.clone(),
            shutdown.clone(),
        ));
    }
    if settings.orders.sweeper_enabled {
        let sweeper = Sweeper {
            repo: state.orders.clone(),
            stock: state.stock.clone(),
        };
        tracker.spawn(sweeper.run(
            Duration::from_secs(settings.orders.sweep_interval_secs),
            shutdown.clone(),
        ));
    }
    Ok(())
}

/// `flashsale consume`: the order consumer alone, without the HTTP API.
pub async fn run_consumer(settings: Settings, shutdown: CancellationToken) -> anyhow::Result<()> {
    let ops = serve_consumer_ops(&settings.consumer.metrics_addr, shutdown.clone()).await?;
    let services = Services::connect(&settings).await?;
    services
        .stock
        .clock()
        .first_sample(FIRST_SAMPLE_WITHIN)
        .await;
    let clock = tokio::spawn(services.stock.clock().clone().run(shutdown.clone()));
    let publisher = Publisher::new(&settings.kafka)?;
    create_topics(&settings).await?;
    let consumer = OrderConsumer::new(&settings, services.writer, publisher.clone())?;
    consumer.run(shutdown).await;
    clock.await.context("the clock's task failed")?;
    tokio::task::spawn_blocking(move || publisher.flush(Duration::from_secs(5)))
        .await
        .context("producer flush task failed")?;
    services.pool.close().await;
    ops.await.context("the metrics server task failed")??;
    Ok(())
}

/// `/metrics` and `/healthz` of `flashsale consume`, on an address of its own,
/// until `shutdown`.
async fn serve_consumer_ops(
    addr: &str,
    shutdown: CancellationToken,
) -> anyhow::Result<tokio::task::JoinHandle<anyhow::Result<()>>> {
    let handle = telemetry::metrics_handle()?;
    let listener = TcpListener::bind(addr)
        .await
        .with_context(|| format!("failed to bind consumer.metrics_addr {addr}"))?;
    tracing::info!(addr = %listener.local_addr()?, "consumer metrics and health");
    let router = axum::Router::new()
        .route("/healthz", axum::routing::get(http::healthz))
        .route(
            "/metrics",
            axum::routing::get(move || {
                let handle = handle.clone();
                async move { telemetry::prometheus_text(&handle) }
            }),
        );
    Ok(tokio::spawn(async move {
        axum::serve(listener, router)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await
            .context("the consumer's metrics server failed")
    }))
}

/// What can lose a sale's Redis state without the service noticing at once,
/// logged at start: `redis.min_replicas_acked = 0` where a failover can happen (a
/// warning), and a `maxmemory-policy` that evicts keys (an error, also shown by
/// `/readyz`, which this returns). A Redis that refuses `INFO` is logged, not fatal.
async fn redis_durability(settings: &RedisSettings, stock: &StockStore) -> Vec<String> {
    let failover = !matches!(Topology::parse(&settings.url), Ok(Topology::Single(_)));
    if failover && settings.min_replicas_acked == ReplicasAcked::Exactly(0) {
        tracing::warn!("redis.min_replicas_acked = 0 on a Sentinel or Cluster deployment: a failover to a replica that missed the last writes forgets reservations already answered 202; leave it at auto");
    }
    let policies = match stock.memory_policies().await {
        Ok(p) => p,
        Err(err) => {
            tracing::warn!(error = %err, "could not read Redis's maxmemory-policy (INFO memory)");
            return Vec::new();
        }
    };
    let mut evicting: Vec<String> = policies.into_iter().filter(|p| p != "noeviction").collect();
    evicting.sort();
    evicting.dedup();
    if evicting.is_empty() {
        return Vec::new();
    }
    let warning = format!(
        "Redis maxmemory-policy {} can evict a sale's keys: set noeviction (a sale whose keys are evicted is rebuilt from MySQL, unavailable meanwhile)",
        evicting.join(", ")
    );
    tracing::error!("{warning}");
    vec![warning]
}

/// Connections of their own for the replica barrier (see `StockStore::replicated`),
/// when replicas are required: a few, so a lagging replica blocks only a few
/// winners at a time and never the shared connection.
async fn replica_barrier(
    settings: &RedisSettings,
    family: &Family,
) -> anyhow::Result<Vec<RedisConn>> {
    const BARRIER_CONNECTIONS: usize = 8;
    let mut conns = Vec::new();
    // A `WAIT` may take the whole ack timeout: the call's own bound is above it.
    let settings = RedisSettings {
        response_timeout_ms: settings
            .response_timeout_ms
            .max(settings.replica_ack_timeout_ms + 300),
        ..settings.clone()
    };
    if settings.min_replicas_acked.waits() {
        for _ in 0..BARRIER_CONNECTIONS {
            conns.push(RedisConn::connect_in(&settings, family).await?);
        }
    }
    Ok(conns)
}

/// `flashsale reconcile`: one pass over one activity, or over every current one.
pub async fn reconcile_once(
    settings: &Settings,
    activity: Option<&str>,
) -> anyhow::Result<Vec<Report>> {
    let services = Services::connect(settings).await?;
    services
        .stock
        .clock()
        .first_sample(FIRST_SAMPLE_WITHIN)
        .await;
    let reconciler = &services.reconciler;
    let mut reports = Vec::new();
    match activity {
        Some(id) => reports.push(reconciler.reconcile(id).await?),
        None => {
            let cache = services.loaded_cache().await?;
            for a in cache.current_activities(services.stock.clock().now()) {
                reports.push(reconciler.reconcile_activity(&a).await?);
            }
        }
    }
    services.pool.close().await;
    Ok(reports)
}

/// Prunes off the async workers: at a million keys a pruning takes tens of
/// milliseconds, which would stall every request scheduled on that worker. The
/// loop awaits each pruning, so two never overlap.
async fn prune_rate_limiters(limiters: RateLimiters, shutdown: CancellationToken) {
    periodic::every(limiters.prune_every(), shutdown, || {
        let limiters = limiters.clone();
        async move {
            if let Err(err) = tokio::task::spawn_blocking(move || limiters.prune()).await {
                tracing::error!(error = %err, "pruning the rate limiters failed");
            }
        }
    })
    .await;
}

/// Histograms are summarised lazily; upkeep keeps memory flat between scrapes.
async fn metrics_upkeep(state: AppState, shutdown: CancellationToken) {
    periodic::every(Duration::from_secs(5), shutdown, || async {
        state.metrics.run_upkeep()
    })
    .await;
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(err) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %err, "cannot listen for SIGINT");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(err) => {
                tracing::error!(error = %err, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = terminate => {},
    }
    tracing::info!("shutdown signal received");
}
