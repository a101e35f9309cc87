//! The catalogue of faults a campaign draws from (Jepsen calls them nemeses).
//! Each strikes, lasts a while, and heals; the campaign measures the time
//! without service from the heal against the kind's bound (docs/DESIGN.md,
//! Availability). A new kind is one struct here and one line in [`catalogue`].
//!
//! Not in it: a Redis Cluster primary failover (a nine-node cluster per seed
//! is too heavy for a short seed on two cores; `cluster_failover.rs` covers
//! it), and the clock nemesis, which is not an episode: in two seeds of three one
//! instance runs under a skewed clock for the whole run (`Plan::skewed`, drawn
//! apart from the schedule, so a seed's schedule, and the replay of each seed
//! kept for a defect it found, stays what it was), and every fault meets it.

use std::time::{Duration, Instant};

use futures::future::BoxFuture;

use crate::harness::{Run, Setup, BACK_BOUND, REBUILD_BOUND};

pub trait Nemesis: Send + Sync {
    /// A short name for the tables and the report.
    fn kind(&self) -> &'static str;
    /// What the run must have for this kind: a broker of its own, a separate
    /// consumer, a database user of its own…
    fn needs(&self, _setup: &mut Setup) {}
    /// How long it lasts between strike and heal, in ms (drawn in this range).
    fn hold_ms(&self) -> (u64, u64) {
        (500, 2500)
    }
    /// `target` picks among several of a kind (service instances), modulo
    /// how many there are.
    fn strike<'a>(&'a self, run: &'a mut Run, target: usize) -> BoxFuture<'a, Result<(), String>>;
    fn heal<'a>(&'a self, run: &'a mut Run, target: usize) -> BoxFuture<'a, Result<(), String>>;
    /// The time without service allowed after the heal.
    fn bound(&self) -> Duration {
        BACK_BOUND
    }
}

/// Every kind, in a fixed order (a seed's schedule indexes into it).
pub fn catalogue() -> Vec<Box<dyn Nemesis>> {
    vec![
        Box::new(ServiceKilled),
        Box::new(ServiceStopped),
        Box::new(ConsumerKilled),
        Box::new(BrokerKilled),
        Box::new(BrokerStalled),
        Box::new(RedisRestartedEmpty),
        Box::new(RedisFlushed),
        Box::new(ScriptFlushed),
        Box::new(MariaDbKilled),
        Box::new(InsertRevoked),
        Box::new(Paused),
        Box::new(Rebuilt),
    ]
}

fn done<'a>() -> BoxFuture<'a, Result<(), String>> {
    Box::pin(async { Ok(()) })
}

/// An API instance SIGKILLed (requests in flight die with it), restarted on
/// its port.
struct ServiceKilled;

impl Nemesis for ServiceKilled {
    fn kind(&self) -> &'static str {
        "service killed"
    }
    fn strike<'a>(&'a self, run: &'a mut Run, target: usize) -> BoxFuture<'a, Result<(), String>> {
        let i = target % run.services.len();
        run.services[i].kill();
        done()
    }
    fn heal<'a>(&'a self, run: &'a mut Run, target: usize) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let i = target % run.services.len();
            tokio::task::block_in_place(|| run.services[i].start_again());
            Ok(())
        })
    }
}

/// An API instance hangs (SIGSTOP) with its connections open, then goes on
/// (SIGCONT): a long GC pause or a frozen VM.
struct ServiceStopped;

impl Nemesis for ServiceStopped {
    fn kind(&self) -> &'static str {
        "service stopped"
    }
    fn strike<'a>(&'a self, run: &'a mut Run, target: usize) -> BoxFuture<'a, Result<(), String>> {
        let i = target % run.services.len();
        if let Some(p) = &run.services[i].proc {
            p.pause();
        }
        done()
    }
    fn heal<'a>(&'a self, run: &'a mut Run, target: usize) -> BoxFuture<'a, Result<(), String>> {
        let i = target % run.services.len();
        if let Some(p) = &run.services[i].proc {
            p.resume();
        }
        done()
    }
}

/// The separate consumer SIGKILLed mid-batch, restarted.
struct ConsumerKilled;

impl Nemesis for ConsumerKilled {
    fn kind(&self) -> &'static str {
        "consumer killed"
    }
    fn needs(&self, setup: &mut Setup) {
        setup.separate_consumer = true;
    }
    fn strike<'a>(&'a self, run: &'a mut Run, _: usize) -> BoxFuture<'a, Result<(), String>> {
        run.kill_consumers();
        done()
    }
    fn heal<'a>(&'a self, run: &'a mut Run, _: usize) -> BoxFuture<'a, Result<(), String>> {
        run.start_consumer();
        done()
    }
}

struct BrokerKilled;

impl Nemesis for BrokerKilled {
    fn kind(&self) -> &'static str {
        "broker killed"
    }
    fn needs(&self, setup: &mut Setup) {
        setup.own_broker = true;
    }
    fn strike<'a>(&'a self, run: &'a mut Run, _: usize) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            run.broker.as_mut().ok_or("no broker of its own")?.kill();
            Ok(())
        })
    }
    fn heal<'a>(&'a self, run: &'a mut Run, _: usize) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let broker = run.broker.as_mut().ok_or("no broker of its own")?;
            tokio::task::block_in_place(|| broker.start_again());
            Ok(())
        })
    }
}

/// The broker hangs (SIGSTOP), often past the publish timeout, and then
/// writes what it was sent meanwhile.
struct BrokerStalled;

impl Nemesis for BrokerStalled {
    fn kind(&self) -> &'static str {
        "broker stalled"
    }
    fn needs(&self, setup: &mut Setup) {
        setup.own_broker = true;
    }
    fn hold_ms(&self) -> (u64, u64) {
        (500, 4500)
    }
    fn strike<'a>(&'a self, run: &'a mut Run, _: usize) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            run.broker.as_ref().ok_or("no broker of its own")?.pause();
            Ok(())
        })
    }
    fn heal<'a>(&'a self, run: &'a mut Run, _: usize) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            run.broker.as_ref().ok_or("no broker of its own")?.resume();
            Ok(())
        })
    }
}

/// Redis restarted with nothing in memory (connections drop).
struct RedisRestartedEmpty;

impl Nemesis for RedisRestartedEmpty {
    fn kind(&self) -> &'static str {
        "redis restarted empty"
    }
    fn hold_ms(&self) -> (u64, u64) {
        (0, 0)
    }
    fn strike<'a>(&'a self, run: &'a mut Run, _: usize) -> BoxFuture<'a, Result<(), String>> {
        tokio::task::block_in_place(|| run.redis.restart_empty());
        done()
    }
    fn heal<'a>(&'a self, _: &'a mut Run, _: usize) -> BoxFuture<'a, Result<(), String>> {
        done()
    }
    fn bound(&self) -> Duration {
        REBUILD_BOUND
    }
}

/// `FLUSHALL` on the live Redis: everything gone, every connection still up.
struct RedisFlushed;

impl Nemesis for RedisFlushed {
    fn kind(&self) -> &'static str {
        "redis FLUSHALL"
    }
    fn hold_ms(&self) -> (u64, u64) {
        (0, 0)
    }
    fn strike<'a>(&'a self, run: &'a mut Run, _: usize) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(redis_command(run.redis.url(), &["FLUSHALL"]))
    }
    fn heal<'a>(&'a self, _: &'a mut Run, _: usize) -> BoxFuture<'a, Result<(), String>> {
        done()
    }
    fn bound(&self) -> Duration {
        REBUILD_BOUND
    }
}

/// `SCRIPT FLUSH`: EVALSHA answers NOSCRIPT until the scripts are loaded again.
struct ScriptFlushed;

impl Nemesis for ScriptFlushed {
    fn kind(&self) -> &'static str {
        "SCRIPT FLUSH"
    }
    fn hold_ms(&self) -> (u64, u64) {
        (0, 0)
    }
    fn strike<'a>(&'a self, run: &'a mut Run, _: usize) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(redis_command(run.redis.url(), &["SCRIPT", "FLUSH"]))
    }
    fn heal<'a>(&'a self, _: &'a mut Run, _: usize) -> BoxFuture<'a, Result<(), String>> {
        done()
    }
}

async fn redis_command(url: String, args: &[&str]) -> Result<(), String> {
    let client = redis::Client::open(url).map_err(|e| e.to_string())?;
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| e.to_string())?;
    let mut cmd = redis::cmd(args[0]);
    for a in &args[1..] {
        cmd.arg(*a);
    }
    cmd.query_async::<()>(&mut conn)
        .await
        .map_err(|e| format!("{}: {e}", args.join(" ")))
}

/// The run's own database server SIGKILLed, restarted (crash recovery).
struct MariaDbKilled;

impl Nemesis for MariaDbKilled {
    fn kind(&self) -> &'static str {
        "mariadb killed"
    }
    fn needs(&self, setup: &mut Setup) {
        setup.own_mariadb = true;
    }
    fn strike<'a>(&'a self, run: &'a mut Run, _: usize) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            run.mariadb
                .as_mut()
                .ok_or("no database server of its own")?
                .kill();
            Ok(())
        })
    }
    fn heal<'a>(&'a self, run: &'a mut Run, _: usize) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            let m = run
                .mariadb
                .as_mut()
                .ok_or("no database server of its own")?;
            tokio::task::block_in_place(|| m.start_again());
            Ok(())
        })
    }
}

/// An error MySQL answers that the code has never seen: the services' user
/// loses INSERT on `orders`, then gets it back.
struct InsertRevoked;

impl InsertRevoked {
    async fn set(run: &Run, grant: bool) -> Result<(), String> {
        let user = run
            .mysql_user
            .clone()
            .ok_or("no database user of its own")?;
        let on = format!("`{}`.`orders`", run.db);
        let sql = match grant {
            true => format!("GRANT INSERT ON {on} TO '{user}'@'127.0.0.1'"),
            false => format!("REVOKE INSERT ON {on} FROM '{user}'@'127.0.0.1'"),
        };
        run.as_root(&sql).await
    }
}

impl Nemesis for InsertRevoked {
    fn kind(&self) -> &'static str {
        "INSERT revoked"
    }
    fn needs(&self, setup: &mut Setup) {
        setup.own_mysql_user = true;
    }
    fn hold_ms(&self) -> (u64, u64) {
        (1000, 4000)
    }
    fn strike<'a>(&'a self, run: &'a mut Run, _: usize) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(Self::set(run, false))
    }
    fn heal<'a>(&'a self, run: &'a mut Run, _: usize) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(Self::set(run, true))
    }
}

/// An operator's admin call on the sale, through instance `target`, retried
/// while it answers `503` (a preload waits for the consumers' lag to drain).
async fn admin(run: &Run, target: usize, step: &str) -> Result<(), String> {
    let api = run.api_of(target % run.services.len());
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let status = api
            .admin_step(&run.activity_id, step)
            .send()
            .await
            .map(|r| r.status().as_u16());
        match status {
            Ok(200) => return Ok(()),
            // Refused for now (lag, a dependency down) or the instance is away.
            Ok(503) | Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            other => return Err(format!("the operator's {step} answered {other:?}")),
        }
    }
}

/// An operator pauses the sale and resumes it.
struct Paused;

impl Nemesis for Paused {
    fn kind(&self) -> &'static str {
        "operator pause"
    }
    fn strike<'a>(&'a self, run: &'a mut Run, target: usize) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(admin(run, target, "pause"))
    }
    fn heal<'a>(&'a self, run: &'a mut Run, target: usize) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(admin(run, target, "resume"))
    }
}

/// An operator rebuilds the sale's Redis state: pause, preload, resume.
struct Rebuilt;

impl Nemesis for Rebuilt {
    fn kind(&self) -> &'static str {
        "operator preload"
    }
    fn strike<'a>(&'a self, run: &'a mut Run, target: usize) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(admin(run, target, "pause"))
    }
    fn heal<'a>(&'a self, run: &'a mut Run, target: usize) -> BoxFuture<'a, Result<(), String>> {
        Box::pin(async move {
            admin(run, target, "preload").await?;
            admin(run, target, "resume").await
        })
    }
}
