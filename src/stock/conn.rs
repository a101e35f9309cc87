//! One Redis handle for the three deployments: a single node (auto-reconnecting
//! `ConnectionManager`), a Cluster (`ClusterConnection`, which routes each command
//! by its keys' slot), or a primary found through Sentinel. All are cheap to clone
//! and multiplex one socket per node.
//!
//! **Following a failover.** A flash sale lasts seconds, so a promoted replica
//! must be served within about a second of its promotion. redis-rs's Cluster
//! client does not get there by itself: a connection error to a dead primary only
//! makes it redial that same address in the background (its slot map is refreshed
//! on `MOVED`, never on a connection error), its default retry waits start at
//! 1.28 s (longer than our whole response budget), and it has no periodic topology
//! check. A connection found through Sentinel is tied to the address it resolved.
//! So both sit in a [`Healing`] handle: a call that fails in a way that says "the
//! topology moved" (connection lost or refused, a timeout, `CLUSTERDOWN`,
//! `TRYAGAIN`, `MASTERDOWN`, `LOADING`, `READONLY`, `MOVED`) starts one rebuild
//! in the background (a new Cluster connection, which reads the slot map afresh,
//! or a new lookup through the sentinels), at most one at a time and one per
//! [`REBUILD_EVERY`]; the next calls use the new connection. The call that failed
//! is not retried here: it answers `503` and gives its unit back, as any Redis
//! failure does.

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use anyhow::Context;
use redis::aio::{
    ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection,
};
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::sentinel::{SentinelClient, SentinelServerType};
use redis::{
    AsyncConnectionConfig, Cmd, ErrorKind, Pipeline, RedisError, RedisFuture, RedisResult,
    ServerErrorKind, Value,
};

use crate::config::RedisSettings;

/// The fastest a handle rebuilds its connection again while errors go on.
pub const REBUILD_EVERY: Duration = Duration::from_millis(250);

#[derive(Clone)]
pub enum RedisConn {
    Single(ConnectionManager),
    Cluster(Healing),
    Sentinel(Healing),
}

/// Where `redis.url` points.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Topology {
    Single(String),
    /// Seed nodes, as `redis://host:port`.
    Cluster(Vec<String>),
    /// Sentinels, as `redis://host:port`, and the monitored master's name.
    Sentinel {
        sentinels: Vec<String>,
        master: String,
    },
}

impl Topology {
    /// `redis://host:port` is one node; `redis+cluster://a:1,b:2` or a comma list
    /// of `redis://` URLs is a Cluster seeded with those nodes;
    /// `redis+sentinel://a:1,b:2/<master-name>` is the primary those sentinels
    /// monitor under that name.
    pub fn parse(url: &str) -> anyhow::Result<Topology> {
        let url = url.trim();
        let hosts = |list: &str| -> Vec<String> {
            list.split(',')
                .map(str::trim)
                .filter(|h| !h.is_empty())
                .map(|h| format!("redis://{h}"))
                .collect()
        };
        if let Some(rest) = url.strip_prefix("redis+sentinel://") {
            let (list, master) = rest
                .split_once('/')
                .context("redis+sentinel:// needs /<master-name> after the sentinels")?;
            let master = master.trim_end_matches('/');
            let sentinels = hosts(list);
            if sentinels.is_empty() || master.is_empty() || master.contains('/') {
                anyhow::bail!("redis+sentinel://host:port[,host:port…]/<master-name> expected");
            }
            return Ok(Topology::Sentinel {
                sentinels,
                master: master.to_owned(),
            });
        }
        if let Some(rest) = url.strip_prefix("redis+cluster://") {
            let seeds = hosts(rest);
            if seeds.is_empty() {
                anyhow::bail!("redis+cluster:// needs at least one host:port");
            }
            return Ok(Topology::Cluster(seeds));
        }
        if url.contains(',') {
            return Ok(Topology::Cluster(
                url.split(',').map(|n| n.trim().to_owned()).collect(),
            ));
        }
        Ok(Topology::Single(url.to_owned()))
    }
}

/// Handles that follow a failover together: when one rebuilds its connection,
/// the others rebuild theirs at once instead of each waiting for an error of its
/// own (the replica barrier's connections beside the shared one).
#[derive(Clone, Default)]
pub struct Family(Arc<Mutex<Vec<Weak<Heal>>>>);

impl Family {
    fn join(&self, heal: &Arc<Heal>) {
        let mut members = self.0.lock().unwrap_or_else(|e| e.into_inner());
        members.retain(|m| m.strong_count() > 0);
        members.push(Arc::downgrade(heal));
    }

    fn rebuild_all_but(&self, rebuilt: &Arc<Heal>) {
        let members: Vec<Arc<Heal>> = self
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|m| !Arc::ptr_eq(m, rebuilt))
            .collect();
        for m in members {
            // Not passed on again: one error, one round of rebuilds.
            Heal::rebuild(
                &m,
                "another connection to the same Redis was rebuilt",
                false,
            );
        }
    }
}

impl RedisConn {
    pub async fn connect(settings: &RedisSettings) -> anyhow::Result<Self> {
        Self::connect_in(settings, &Family::default()).await
    }

    /// Connects, as one of `family`.
    pub async fn connect_in(settings: &RedisSettings, family: &Family) -> anyhow::Result<Self> {
        let connection_timeout = Duration::from_millis(settings.connection_timeout_ms);
        let response_timeout = Duration::from_millis(settings.response_timeout_ms);
        match Topology::parse(&settings.url)? {
            Topology::Cluster(nodes) => {
                let client = ClusterClientBuilder::new(nodes)
                    // A dead node is found out fast; each attempt and the whole
                    // call are bounded by the response timeout.
                    .connection_timeout(connection_timeout.min(Duration::from_millis(300)))
                    .response_timeout(response_timeout)
                    .overall_response_timeout(Some(response_timeout))
                    // Redirections (MOVED, ASK) are followed at once; the few
                    // retries that wait, wait tens of milliseconds, not seconds.
                    .retries(3)
                    .min_retry_wait(10)
                    .max_retry_wait(100)
                    .retry_wait_formula(10, 2)
                    // A node that stays away is dropped, not redialled forever:
                    // the rebuild finds who serves its slots now.
                    .max_connection_attempts(NonZeroUsize::MIN.saturating_add(2))
                    .build()
                    .context("invalid redis cluster url")?;
                let conn = client
                    .get_async_connection()
                    .await
                    .context("failed to connect to the Redis cluster")?;
                Ok(RedisConn::Cluster(Healing::new(
                    Live::Cluster(conn),
                    Source::Cluster(Box::new(client)),
                    family,
                )))
            }
            Topology::Sentinel { sentinels, master } => {
                let config = AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(connection_timeout))
                    .set_response_timeout(Some(response_timeout));
                let mut client =
                    SentinelClient::build(sentinels, master, None, SentinelServerType::Master)
                        .context("invalid redis sentinel url")?;
                let conn = client
                    .get_async_connection_with_config(&config)
                    .await
                    .context("failed to reach the primary through the sentinels")?;
                Ok(RedisConn::Sentinel(Healing::new(
                    Live::Sentinel(conn),
                    Source::Sentinel(Box::new(tokio::sync::Mutex::new(client)), config),
                    family,
                )))
            }
            Topology::Single(url) => {
                let client = redis::Client::open(url).context("invalid redis url")?;
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(connection_timeout))
                    .set_response_timeout(Some(response_timeout))
                    .set_number_of_retries(2)
                    .set_max_delay(Duration::from_millis(500));
                let conn = ConnectionManager::new_with_config(client, config)
                    .await
                    .context("failed to connect to Redis")?;
                Ok(RedisConn::Single(conn))
            }
        }
    }
}

impl ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            RedisConn::Single(c) => c.req_packed_command(cmd),
            RedisConn::Cluster(h) | RedisConn::Sentinel(h) => h.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            RedisConn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            RedisConn::Cluster(h) | RedisConn::Sentinel(h) => {
                h.req_packed_commands(pipeline, offset, count)
            }
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConn::Single(c) => c.get_db(),
            RedisConn::Cluster(_) | RedisConn::Sentinel(_) => 0,
        }
    }
}

/// A connection that is replaced by a freshly built one when a call says the
/// topology moved (see the module's doc).
#[derive(Clone)]
pub struct Healing(Arc<Heal>);

struct Heal {
    /// The connection in use and its generation (bumped by each rebuild).
    live: RwLock<(u64, Live)>,
    source: Source,
    family: Family,
    rebuilding: AtomicBool,
    last_rebuild: Mutex<Option<Instant>>,
}

#[derive(Clone)]
enum Live {
    Cluster(ClusterConnection),
    Sentinel(MultiplexedConnection),
}

enum Source {
    Cluster(Box<ClusterClient>),
    Sentinel(
        Box<tokio::sync::Mutex<SentinelClient>>,
        AsyncConnectionConfig,
    ),
}

impl Healing {
    fn new(live: Live, source: Source, family: &Family) -> Self {
        let heal = Arc::new(Heal {
            live: RwLock::new((0, live)),
            source,
            family: family.clone(),
            rebuilding: AtomicBool::new(false),
            last_rebuild: Mutex::new(None),
        });
        family.join(&heal);
        Healing(heal)
    }

    fn current(&self) -> (u64, Live) {
        // A poisoned lock still holds a usable connection.
        self.0
            .live
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn req_packed_command<'a>(&'a self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let (generation, live) = self.current();
            let result = match live {
                Live::Cluster(mut c) => c.req_packed_command(cmd).await,
                Live::Sentinel(mut c) => c.req_packed_command(cmd).await,
            };
            let reply_error = match &result {
                Ok(Value::ServerError(e)) => Some(RedisError::from(e.clone())),
                _ => None,
            };
            self.after(generation, result.as_ref().err().or(reply_error.as_ref()));
            result
        })
    }

    fn req_packed_commands<'a>(
        &'a self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let (generation, live) = self.current();
            let result = match live {
                Live::Cluster(mut c) => c.req_packed_commands(pipeline, offset, count).await,
                Live::Sentinel(mut c) => c.req_packed_commands(pipeline, offset, count).await,
            };
            let reply_error = match &result {
                Ok(values) => values.iter().find_map(|v| match v {
                    Value::ServerError(e) => Some(RedisError::from(e.clone())),
                    _ => None,
                }),
                Err(_) => None,
            };
            self.after(generation, result.as_ref().err().or(reply_error.as_ref()));
            result
        })
    }

    /// After a call on connection `generation`: a topology error starts a rebuild.
    fn after(&self, generation: u64, error: Option<&RedisError>) {
        let Some(error) = error else { return };
        if !topology_moved(error) {
            return;
        }
        if self.0.live.read().unwrap_or_else(|e| e.into_inner()).0 != generation {
            return; // already replaced since this call began
        }
        if self
            .0
            .last_rebuild
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some_and(|t| t.elapsed() < REBUILD_EVERY)
        {
            return;
        }
        Heal::rebuild(&self.0, &error.to_string(), true);
    }
}

impl Heal {
    /// Starts one rebuild in the background, unless one is under way. A rebuild
    /// started by an error of its own (`lead`) has the others of its family
    /// follow once it succeeds; theirs lead nobody.
    fn rebuild(heal: &Arc<Heal>, why: &str, lead: bool) {
        if heal.rebuilding.swap(true, Ordering::AcqRel) {
            return;
        }
        *heal.last_rebuild.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
        tracing::warn!(why, "Redis topology moved; reconnecting");
        let heal = heal.clone();
        tokio::spawn(async move {
            let began = Instant::now();
            match heal.build().await {
                Ok(live) => {
                    tracing::info!(
                        took_ms = began.elapsed().as_millis() as u64,
                        "Redis connection rebuilt"
                    );
                    {
                        let mut slot = heal.live.write().unwrap_or_else(|e| e.into_inner());
                        *slot = (slot.0 + 1, live);
                    }
                    metrics::counter!("flashsale_redis_reconnects_total").increment(1);
                    heal.rebuilding.store(false, Ordering::Release);
                    if lead {
                        heal.family.rebuild_all_but(&heal);
                    }
                }
                Err(err) => {
                    tracing::warn!(error = %err, "Redis reconnect failed; the next error tries again");
                    heal.rebuilding.store(false, Ordering::Release);
                }
            }
        });
    }

    async fn build(&self) -> RedisResult<Live> {
        match &self.source {
            Source::Cluster(client) => client.get_async_connection().await.map(Live::Cluster),
            Source::Sentinel(client, config) => client
                .lock()
                .await
                .get_async_connection_with_config(config)
                .await
                .map(Live::Sentinel),
        }
    }
}

/// Whether an error says the node answering is not (or no longer) the one that
/// serves the keys: the connection is lost or hangs, or the node says so.
fn topology_moved(e: &RedisError) -> bool {
    if e.is_io_error() || e.is_timeout() || e.is_connection_dropped() || e.is_connection_refusal() {
        return true;
    }
    match e.kind() {
        ErrorKind::ClusterConnectionNotFound => true,
        ErrorKind::Server(kind) => matches!(
            kind,
            ServerErrorKind::ClusterDown
                | ServerErrorKind::TryAgain
                | ServerErrorKind::MasterDown
                | ServerErrorKind::BusyLoading
                | ServerErrorKind::ReadOnly
                | ServerErrorKind::Moved
        ),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_name_their_topology() {
        assert_eq!(
            Topology::parse("redis://127.0.0.1:6379").ok(),
            Some(Topology::Single("redis://127.0.0.1:6379".into()))
        );
        assert_eq!(
            Topology::parse("redis+cluster://a:1, b:2").ok(),
            Some(Topology::Cluster(vec![
                "redis://a:1".into(),
                "redis://b:2".into()
            ]))
        );
        assert_eq!(
            Topology::parse("redis://a:1,redis://b:2").ok(),
            Some(Topology::Cluster(vec![
                "redis://a:1".into(),
                "redis://b:2".into()
            ]))
        );
        assert_eq!(
            Topology::parse("redis+sentinel://s1:26379,s2:26380/mymaster").ok(),
            Some(Topology::Sentinel {
                sentinels: vec!["redis://s1:26379".into(), "redis://s2:26380".into()],
                master: "mymaster".into()
            })
        );
        for bad in [
            "redis+sentinel://s1:26379",
            "redis+sentinel:///mymaster",
            "redis+sentinel://s1:1/a/b",
            "redis+cluster://",
        ] {
            assert!(Topology::parse(bad).is_err(), "{bad} accepted");
        }
    }
}
