//! Where one machine ends: from a mega-sale's measured costs, how many of each
//! part a sale of `target_users` users in `target_seconds` needs.
//!
//! Each resource gets the time this machine's measured capacity of it would
//! need for the whole target sale (CPU seconds on one core for the API and for
//! Redis, whose primary runs the scripts on one thread; the broker's
//! acknowledged publishes per second per partition; the order consumer's
//! orders per second). The count needed is that time over the target's
//! seconds, at [`HEADROOM`] of each one's capacity, rounded up; the resource
//! with the longest time bounds the sale on one machine.

use serde::{Deserialize, Serialize};

/// The share of a measured capacity a plan counts on: a part run at its
/// saturation has no room for a burst or a slow neighbour.
pub const HEADROOM: f64 = 0.7;

/// What the plan is computed from, each from the run.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ScaleInputs {
    /// The measured sale: users, requests, units sold.
    pub users: u64,
    pub requests: u64,
    pub units: u64,
    pub stock_shards: u8,
    /// CPU seconds of the service process and of Redis during the sale.
    pub service_cpu_s: f64,
    pub redis_cpu_s: f64,
    /// Acknowledged publishes per second of the broker ceiling, and the topic's
    /// partitions it was measured on.
    pub broker_rps: f64,
    pub broker_partitions: u32,
    /// Orders per second one consumer wrote to MySQL in the sale.
    pub consumer_orders_per_s: f64,
    /// The target: users (each sending requests in the measured ratio) and the
    /// seconds their sale may take.
    pub target_users: u64,
    pub target_seconds: f64,
}

/// One resource's line of the plan.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ScaleRow {
    pub resource: String,
    /// The measured cost, as words with its figure (`21.3 µs CPU / request`).
    pub measured: String,
    /// Seconds this machine's one unit of the resource needs for the target sale.
    pub one_unit_s: f64,
    /// How many are needed at [`HEADROOM`].
    pub needed: u64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ScalePlan {
    pub inputs: ScaleInputs,
    pub target_requests: u64,
    pub target_units: u64,
    pub rows: Vec<ScaleRow>,
    /// The resource with the longest one-unit time.
    pub bound_by: String,
    /// stock_shards the sale needs so that each Redis primary holds a shard of
    /// the hot SKU (a shard is one hash tag, on one primary).
    pub stock_shards_needed: u64,
}

fn count(one_unit_s: f64, target_s: f64) -> u64 {
    if !one_unit_s.is_finite() || one_unit_s <= 0.0 {
        return 1;
    }
    ((one_unit_s / (target_s * HEADROOM)).ceil() as u64).max(1)
}

pub fn plan(inputs: ScaleInputs) -> ScalePlan {
    let scale = inputs.target_users as f64 / inputs.users.max(1) as f64;
    let target_requests = (inputs.requests as f64 * scale).round() as u64;
    // The units sold grow with the crowd: as many per user as measured.
    let target_units = (inputs.units as f64 * scale).round() as u64;
    let t = inputs.target_seconds;
    let per_request = |s: f64| s / inputs.requests.max(1) as f64;
    let api_s = per_request(inputs.service_cpu_s) * target_requests as f64;
    let redis_s = per_request(inputs.redis_cpu_s) * target_requests as f64;
    let per_partition = inputs.broker_rps / f64::from(inputs.broker_partitions.max(1));
    let broker_s = target_units as f64 / per_partition.max(1e-9);
    let consumer_s = target_units as f64 / inputs.consumer_orders_per_s.max(1e-9);
    let mut rows = vec![
        ScaleRow {
            resource: "API instances (one core each)".into(),
            measured: format!(
                "{:.1} µs service CPU / request",
                per_request(inputs.service_cpu_s) * 1e6
            ),
            one_unit_s: api_s,
            needed: count(api_s, t),
        },
        ScaleRow {
            resource: "Redis primaries".into(),
            measured: format!(
                "{:.1} µs Redis CPU / request",
                per_request(inputs.redis_cpu_s) * 1e6
            ),
            one_unit_s: redis_s,
            needed: count(redis_s, t),
        },
        ScaleRow {
            resource: "topic partitions".into(),
            measured: format!(
                "{:.0} acknowledged publishes / s per partition",
                per_partition
            ),
            one_unit_s: broker_s,
            needed: count(broker_s, t),
        },
        ScaleRow {
            resource: "order consumers".into(),
            measured: format!(
                "{:.0} orders / s into MySQL per consumer",
                inputs.consumer_orders_per_s
            ),
            one_unit_s: consumer_s,
            needed: count(consumer_s, t),
        },
    ];
    // A consumer reads at least one partition of its own.
    let consumers = rows[3].needed;
    if rows[2].needed < consumers {
        rows[2].needed = consumers;
        rows[2].measured.push_str(" (at least one per consumer)");
    }
    let bound_by = rows
        .iter()
        .max_by(|a, b| a.one_unit_s.total_cmp(&b.one_unit_s))
        .map(|r| r.resource.clone())
        .unwrap_or_default();
    let stock_shards_needed = rows[1].needed;
    ScalePlan {
        inputs,
        target_requests,
        target_units,
        rows,
        bound_by,
        stock_shards_needed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_follow_the_measured_costs() {
        let p = plan(ScaleInputs {
            users: 10_000,
            requests: 20_000,
            units: 1_000,
            stock_shards: 1,
            // 20 µs / request service, 5 µs / request Redis.
            service_cpu_s: 0.4,
            redis_cpu_s: 0.1,
            broker_rps: 9_000.0,
            broker_partitions: 3,
            consumer_orders_per_s: 2_000.0,
            target_users: 1_000_000,
            target_seconds: 10.0,
        });
        assert_eq!(p.target_requests, 2_000_000);
        assert_eq!(p.target_units, 100_000);
        // 2M × 20 µs = 40 s of one core; / (10 s × 0.7) → 6.
        assert_eq!(p.rows[0].needed, 6);
        // 2M × 5 µs = 10 s; / 7 → 2.
        assert_eq!(p.rows[1].needed, 2);
        assert_eq!(p.stock_shards_needed, 2);
        // 100k / 2k = 50 s → 8 consumers; 100k / 3k = 33 s → 5 partitions, raised to 8.
        assert_eq!(p.rows[3].needed, 8);
        assert_eq!(p.rows[2].needed, 8);
        assert_eq!(p.bound_by, "order consumers");
    }

    #[test]
    fn a_missing_figure_never_divides_by_zero() {
        let p = plan(ScaleInputs {
            target_users: 1_000_000,
            target_seconds: 10.0,
            ..ScaleInputs::default()
        });
        assert!(p.rows.iter().all(|r| r.needed >= 1));
    }
}
