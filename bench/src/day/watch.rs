//! What the day looks like from outside, every few seconds: Redis's memory and
//! keys on the Cluster's primaries, each process's resident memory, MySQL's
//! statement counter, Redis's command counter, the requests the buyers sent and
//! the consumer group's lag.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use flashsale::config::KafkaSettings;
use serde::Serialize;
use sqlx::{Connection, MySqlConnection};

use super::shop::Sent;
use crate::clock::now_unix_ms;
use crate::side::SideQuery;

/// One look.
#[derive(Debug, Clone, Serialize)]
pub struct Point {
    /// Seconds from the day's start.
    pub t_s: f64,
    pub unix_ms: f64,
    /// `used_memory` summed over the primaries.
    pub redis_bytes: u64,
    /// Keys summed over the primaries.
    pub redis_keys: u64,
    /// `total_commands_processed` of every live node, by port (cumulative; a
    /// restarted node starts again from 0).
    pub redis_commands: Vec<(u16, u64)>,
    /// Resident memory of each process, by name.
    pub rss_bytes: Vec<(String, u64)>,
    /// MariaDB's `Questions` (cumulative, every client's statements); `None`
    /// when the look failed.
    pub mysql_questions: Option<u64>,
    /// Statements this watch sent itself (cumulative), to take off.
    pub own_statements: u64,
    /// Side queries sent (cumulative), to take off.
    pub side_queries: u64,
    /// Requests the buyers sent (cumulative).
    pub requests: u64,
    pub consumer_lag: Option<i64>,
    /// Each API instance's reconciler: (seconds its passes took, passes,
    /// sales its last pass went through), cumulative but the last.
    pub reconcile: Vec<(f64, f64, f64)>,
}

pub struct Watch {
    pub points: Arc<Mutex<Vec<Point>>>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

/// Where to look.
#[derive(Clone)]
pub struct Targets {
    /// Every node of the Cluster (a dead one is skipped).
    pub redis_ports: Vec<u16>,
    pub processes: Vec<(String, u32)>,
    pub mysql_url: String,
    pub kafka: KafkaSettings,
    pub sent: Arc<Sent>,
    pub side: Arc<SideQuery>,
    /// The API instances' doors (their `/metrics`).
    pub apis: Vec<testkit::api::Api>,
}

impl Watch {
    pub fn start(targets: Targets, t0: Instant, every: Duration) -> Watch {
        let points = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let task = {
            let (points, stop) = (points.clone(), stop.clone());
            tokio::spawn(async move {
                let mut own = 0u64;
                let mut conn = None;
                let mut tick = tokio::time::interval(every);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                while !stop.load(Ordering::SeqCst) {
                    tick.tick().await;
                    let point = look(&targets, t0, &mut conn, &mut own).await;
                    points.lock().unwrap_or_else(|e| e.into_inner()).push(point);
                }
            })
        };
        Watch { points, stop, task }
    }

    /// The points so far.
    pub fn points(&self) -> Vec<Point> {
        self.points
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub async fn stop(self) -> Vec<Point> {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.task.await;
        self.points
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// One look at everything, MySQL's counter on `conn` (kept open, so each look
/// costs one statement of its own; a connection opened again costs a few
/// more, not counted).
pub async fn look(
    targets: &Targets,
    t0: Instant,
    conn: &mut Option<MySqlConnection>,
    own: &mut u64,
) -> Point {
    let unix_ms = now_unix_ms();
    let t_s = t0.elapsed().as_secs_f64();
    let side_queries = targets.side.sent();
    let redis = redis_figures(&targets.redis_ports).await;
    if conn.is_none() {
        *conn = MySqlConnection::connect(&targets.mysql_url).await.ok();
    }
    let mysql_questions = match conn.as_mut() {
        Some(c) => questions_on(c).await,
        None => None,
    };
    *own += 1;
    if mysql_questions.is_none() {
        *conn = None;
    }
    let consumer_lag = tokio::time::timeout(
        Duration::from_secs(3),
        flashsale::kafka::consumer_lag(&targets.kafka),
    )
    .await
    .ok()
    .and_then(Result::ok);
    let mut reconcile = Vec::new();
    for api in &targets.apis {
        reconcile.push(reconcile_figures(api).await.unwrap_or((0.0, 0.0, 0.0)));
    }
    Point {
        reconcile,
        t_s,
        unix_ms,
        redis_bytes: redis.0,
        redis_keys: redis.1,
        redis_commands: redis.2,
        rss_bytes: targets
            .processes
            .iter()
            .map(|(name, pid)| (name.clone(), rss_of(*pid).unwrap_or(0)))
            .collect(),
        mysql_questions,
        own_statements: *own,
        side_queries,
        requests: targets.sent.total(),
        consumer_lag,
    }
}

/// The reconciler's figures on one instance's `/metrics`: its passes' total
/// seconds and count, and the sales its last pass went through.
async fn reconcile_figures(api: &testkit::api::Api) -> Option<(f64, f64, f64)> {
    let text = tokio::time::timeout(Duration::from_secs(2), async {
        api.metrics().send().await.ok()?.text().await.ok()
    })
    .await
    .ok()??;
    let value = |name: &str| -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
    };
    Some((
        value("flashsale_reconcile_pass_seconds_sum")?,
        value("flashsale_reconcile_pass_seconds_count")?,
        value("flashsale_reconcile_pass_activities")?,
    ))
}

/// MariaDB's `Questions`: statements from every client (this one included).
pub async fn questions_on(conn: &mut MySqlConnection) -> Option<u64> {
    let row: Option<(String, String)> =
        sqlx::query_as("SHOW GLOBAL STATUS WHERE Variable_name = 'Questions'")
            .fetch_optional(conn)
            .await
            .ok()?;
    row.and_then(|(_, v)| v.parse().ok())
}

/// Commands processed between two looks, summed over nodes: a node whose
/// counter went back was restarted, and counts from 0.
pub fn commands_between(a: &[(u16, u64)], b: &[(u16, u64)]) -> u64 {
    b.iter()
        .map(|(port, now)| match a.iter().find(|(p, _)| p == port) {
            Some((_, before)) if now >= before => now - before,
            _ => *now,
        })
        .sum()
}

/// (used memory, keys) summed over the primaries, and commands processed by
/// every live node; a node that does not answer within half a second (a dead
/// one) is skipped.
pub async fn redis_figures(ports: &[u16]) -> (u64, u64, Vec<(u16, u64)>) {
    let (mut bytes, mut keys, mut commands) = (0, 0, Vec::new());
    let half = Duration::from_millis(500);
    for port in ports {
        let url = format!("redis://127.0.0.1:{port}");
        let Ok(Ok(c)) = tokio::time::timeout(half, crate::redis_info::counters(&url)).await else {
            continue;
        };
        commands.push((*port, c.commands));
        if let Ok(Ok(Some(n))) =
            tokio::time::timeout(half, crate::redis_info::primary_keys(&url)).await
        {
            bytes += c.used_memory;
            keys += n;
        }
    }
    (bytes, keys, commands)
}

/// `VmRSS` of a process, in bytes.
pub fn rss_of(pid: u32) -> Option<u64> {
    crate::machine::process_memory_kib(pid).map(|(now, _)| now * 1024)
}
