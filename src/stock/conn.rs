//! One Redis handle for both deployments: a single node (auto-reconnecting
//! `ConnectionManager`) or a Cluster (`ClusterConnection`, which routes each command
//! by its keys' slot). Both are cheap to clone and multiplex one socket per node.

use std::time::Duration;

use anyhow::Context;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{Cmd, FromRedisValue, Pipeline, RedisFuture, RedisResult, Value};

use crate::config::RedisSettings;

#[derive(Clone)]
pub enum RedisConn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl RedisConn {
    /// `redis://host:port` is one node; `redis+cluster://a:1,b:2` or a comma list of
    /// `redis://` URLs is a Cluster seeded with those nodes.
    pub async fn connect(settings: &RedisSettings) -> anyhow::Result<Self> {
        let connection_timeout = Duration::from_millis(settings.connection_timeout_ms);
        let response_timeout = Duration::from_millis(settings.response_timeout_ms);
        let url = settings.url.trim();
        let cluster_nodes: Option<Vec<String>> =
            if let Some(rest) = url.strip_prefix("redis+cluster://") {
                Some(
                    rest.split(',')
                        .map(|n| format!("redis://{}", n.trim()))
                        .collect(),
                )
            } else if url.contains(',') {
                Some(url.split(',').map(|n| n.trim().to_owned()).collect())
            } else {
                None
            };
        match cluster_nodes {
            Some(nodes) => {
                let client = ClusterClientBuilder::new(nodes)
                    .connection_timeout(connection_timeout)
                    .response_timeout(response_timeout)
                    .build()
                    .context("invalid redis cluster url")?;
                let conn = client
                    .get_async_connection()
                    .await
                    .context("failed to connect to the Redis cluster")?;
                Ok(RedisConn::Cluster(conn))
            }
            None => {
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

impl RedisConn {
    /// Sends a command that names no key (such as `WAIT`) to the node that holds
    /// `key`: on a Cluster, the primary owning its slot; on one node, that node
    /// over the same connection as the writes it is about.
    pub async fn route_by_key<T: FromRedisValue>(
        &mut self,
        cmd: &Cmd,
        key: &str,
    ) -> RedisResult<T> {
        let value = match self {
            RedisConn::Single(c) => c.req_packed_command(cmd).await?,
            RedisConn::Cluster(c) => {
                let route = Route::with_key(key, SlotAddr::Master);
                c.route_command(
                    cmd.clone(),
                    RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route)),
                )
                .await?
            }
        };
        Ok(redis::from_redis_value(value)?)
    }
}

impl ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            RedisConn::Single(c) => c.req_packed_command(cmd),
            RedisConn::Cluster(c) => c.req_packed_command(cmd),
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
            RedisConn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConn::Single(c) => c.get_db(),
            RedisConn::Cluster(c) => c.get_db(),
        }
    }
}
