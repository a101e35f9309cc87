//! What every handler shares.

use std::sync::Arc;

use tokio::sync::Notify;

use metrics_exporter_prometheus::PrometheusHandle;
use sqlx::MySqlPool;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::activity::{ActivityCache, ActivityRepo};
use crate::audit::AuditRepo;
use crate::auth::Auth;
use crate::config::Settings;
use crate::kafka::Publisher;
use crate::operators::Operators;
use crate::orders::{OrderRepo, OrderWriter};
use crate::readiness::Readiness;
use crate::reconcile::Reconciler;
use crate::reservation::Reservations;
use crate::stock::StockStore;
use crate::stocking::Stocking;
use crate::telemetry::LiveFigures;
use crate::waiting_room::WaitingRoom;

#[derive(Clone)]
pub struct AppState(Arc<Inner>);

pub struct Inner {
    pub settings: Settings,
    pub pool: MySqlPool,
    pub activities: ActivityRepo,
    pub cache: ActivityCache,
    pub orders: OrderRepo,
    pub stock: StockStore,
    pub waiting_room: Arc<WaitingRoom>,
    /// The reservation protocol (Redis, Kafka, MySQL), for the reserve handler.
    pub reservations: Reservations,
    /// The one decision step, for the order consumer.
    pub writer: OrderWriter,
    /// The operators' preload and top-up.
    pub stocking: Stocking,
    pub publisher: Publisher,
    pub auth: Auth,
    /// Who is acting on `/admin/*`.
    pub operators: Operators,
    /// The operators' audit trail.
    pub audit: AuditRepo,
    pub reconciler: Reconciler,
    /// Wakes the reconciler at once (the API found an activity missing in Redis).
    pub reconcile_now: Arc<Notify>,
    pub metrics: PrometheusHandle,
    /// Work that must finish even if the request that started it is dropped (a
    /// reservation between Redis and Kafka); shutdown waits for it.
    pub critical: TaskTracker,
    /// Cancelled when the process was told to stop: `/readyz` answers `503` from
    /// then on, so load balancers stop sending before the server stops.
    pub draining: CancellationToken,
    /// The dependencies' answers to the background prober, read by `/readyz`.
    pub readiness: Readiness,
    /// When `/metrics` last read the activities' figures from Redis.
    pub live_figures: LiveFigures,
}

impl AppState {
    pub fn new(inner: Inner) -> Self {
        AppState(Arc::new(inner))
    }
}

impl std::ops::Deref for AppState {
    type Target = Inner;

    fn deref(&self) -> &Inner {
        &self.0
    }
}
