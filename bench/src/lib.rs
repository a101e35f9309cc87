//! Benchmarks for flashsale: the load generator, the strategies a flash-sale design
//! weighs (each behind the same HTTP request shape as the service), and the suite
//! that measures them side by side with their ceilings.
//!
//! Nothing here is linked into the `flashsale` binary. The pieces:
//! - [`client`]: one HTTP/1.1 keep-alive connection, driven by hyper directly so the
//!   generator spends as little CPU per request as possible (it shares two cores with
//!   everything it measures);
//! - [`loadgen`]: U users × C clicks against one SKU, at a fixed concurrency or a
//!   target rate, into an HDR histogram, with the sale's invariants checked after;
//! - [`server`]: the strategies (`mysql`, `redis-decr`, `redis-lock`, `noop`) behind
//!   the service's own auth and protection layers, and the real service (`service`);
//! - [`side`]: the "other business" sharing the database, a point query at a fixed rate;
//! - [`clock`]: wall-clock milliseconds, the scale on which every process's samples
//!   meet;
//! - [`machine`] and [`redis_info`]: what the machine is, where its CPU went, and
//!   Redis's own counters;
//! - [`options`] and [`model`]: what a comparison is asked to do, and what it
//!   measured (the data the report renders);
//! - [`process`] and [`context`]: the child processes, and what every section shares;
//! - the sections: [`ceiling`] (Redis and the broker alone), [`strategies`] (side
//!   by side), [`flood`] (wrk, CPU per request by phase), [`gate`] (the sold-out
//!   gate reopening), [`producer`] (the producer's settings), [`fairness`] (bots
//!   against the waiting room), [`cluster`] (the hot SKU on a Redis Cluster),
//!   [`failover`] (a sale through the loss of a Cluster primary), [`mega`] (a
//!   million users with their own tokens, open and through the waiting room,
//!   and what a bigger sale would need), [`day`] (a day in production: many
//!   sales, faults, memory and statements over time);
//! - [`suite`]: the comparison, section after section; [`report`]: its markdown.

pub mod ceiling;
pub mod client;
pub mod clock;
pub mod cluster;
pub mod context;
pub mod day;
pub mod failover;
pub mod fairness;
pub mod flood;
pub mod gate;
pub mod loadgen;
pub mod machine;
pub mod mega;
pub mod model;
pub mod options;
pub mod process;
pub mod producer;
pub mod redis_info;
pub mod report;
pub mod server;
pub mod side;
pub mod strategies;
pub mod suite;
pub mod verdict;

/// Replaces the database name at the end of a MySQL URL (`mysql://u@h:p/db?x=y`),
/// so benchmark databases inherit host, user and options from the configuration.
pub fn with_database(url: &str, database: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    // "mysql://" has two slashes; the database starts after the third one.
    let root = match base.char_indices().filter(|(_, c)| *c == '/').nth(2) {
        Some((i, _)) => &base[..i],
        None => base,
    };
    match query {
        Some(q) => format!("{root}/{database}?{q}"),
        None => format!("{root}/{database}"),
    }
}

#[cfg(test)]
mod tests {
    use super::with_database;

    #[test]
    fn database_is_replaced() {
        assert_eq!(
            with_database("mysql://root@127.0.0.1:3306/flashsale", "x"),
            "mysql://root@127.0.0.1:3306/x"
        );
        assert_eq!(
            with_database("mysql://root@127.0.0.1:3306", "x"),
            "mysql://root@127.0.0.1:3306/x"
        );
        assert_eq!(
            with_database("mysql://u:p@h/db?ssl-mode=disabled", "x"),
            "mysql://u:p@h/x?ssl-mode=disabled"
        );
    }
}
