//! One module per fault, each with its whole behaviour.

mod broker_killed;
mod broker_stalled;
mod clock_skewed;
mod cluster_failover;
mod consumer_down;
mod consumer_killed;
mod every_message_twice;
mod mariadb_stopped;
mod mysql_privileges_revoked;
mod payments_race_sweeper;
mod preload_during_sale;
mod redis_failover;
mod redis_restarted_empty;
mod redis_restarted_empty_two;
mod sale_lost_beside_busy;
mod script_cache_flushed;
mod sentinel_failover;
mod service_killed;
mod three_instances;
mod two_instances;

use std::sync::Arc;

use crate::harness::Fault;

pub fn all() -> Vec<Arc<dyn Fault>> {
    vec![
        Arc::new(broker_killed::BrokerKilled),
        Arc::new(mariadb_stopped::MariaDbStopped),
        Arc::new(consumer_killed::ConsumerKilled),
        Arc::new(service_killed::ServiceKilled),
        Arc::new(redis_restarted_empty::RedisRestartedEmpty),
        Arc::new(redis_restarted_empty_two::RedisRestartedEmptyTwo),
        Arc::new(sale_lost_beside_busy::SaleLostBesideBusy { held_back: false }),
        Arc::new(sale_lost_beside_busy::SaleLostBesideBusy { held_back: true }),
        Arc::new(every_message_twice::EveryMessageTwice),
        Arc::new(payments_race_sweeper::PaymentsRaceSweeper),
        Arc::new(two_instances::TwoInstances),
        Arc::new(three_instances::ThreeInstances),
        Arc::new(clock_skewed::ClockSkewed),
        Arc::new(script_cache_flushed::ScriptCacheFlushed),
        Arc::new(broker_stalled::BrokerStalled),
        Arc::new(consumer_down::ConsumerDown),
        Arc::new(mysql_privileges_revoked::MysqlPrivilegesRevoked),
        Arc::new(redis_failover::RedisFailover),
        Arc::new(preload_during_sale::PreloadDuringSale),
        Arc::new(cluster_failover::ClusterFailover { shards: 1 }),
        Arc::new(cluster_failover::ClusterFailover { shards: 3 }),
        Arc::new(sentinel_failover::SentinelFailover),
    ]
}
