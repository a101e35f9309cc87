//! A day in production (`scripts/bench.sh day`): many sales the way a shop
//! runs them, on one deployment, for about a quarter of an hour.
//!
//! The deployment is the one `docs/operations.md` describes for a sale of
//! size: a Redis Cluster of its own (3 primaries, 2 replicas each,
//! `redis.min_replicas_acked = 1`), a broker of its own, two API instances
//! (`flashsale serve` without the consumer) and two consumers (`flashsale
//! consume`) in one group, every process with `FLASHSALE_ENV=production` and
//! the configuration's defaults but for what a short day needs shorter: the
//! retention after a sale's end ([`DayOptions::retain_secs`]) and the time to
//! pay ([`DayOptions::payment_timeout_secs`]).
//!
//! First [`pace`]: the side query's p99 with the consumers writing against the
//! consumers paused, in the same sale, for each consumer setting. Then the day
//! ([`plan`]): sales with staggered, overlapping windows, open and through a
//! waiting room, over 1 and 3 stock shards, with top-ups, a pause, unpaid orders
//! lapsing, one pool of users buying in several sales, and three faults struck
//! on one sale while others sell (its keys lost, the primary owning it killed,
//! the broker restarted). Every sale is checked against the invariants once it
//! is quiet, before its retention ends. Then the cost of a poll, and the tail:
//! until every sale's keys are gone. Throughout, [`watch`] samples memory,
//! statements, commands and lag.
//!
//! Times on two shared cores are relative: the report gives them and asserts
//! nothing but the invariants.

pub mod pace;
pub mod plan;
pub mod report;
pub mod shop;
pub mod watch;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use flashsale::auth::Auth;
use flashsale::config::{KafkaSettings, Settings};
use secrecy::{ExposeSecret, SecretString};
use serde::Serialize;
use serde_json::json;
use sqlx::migrate::MigrateDatabase;
use sqlx::MySql;
use testkit::api::{Api, Caller};
use testkit::availability::{Outage, Sample};
use testkit::database::TestDatabase;
use testkit::invariants::{Answer, Probe};
use testkit::process::{flashsale, Broker, Env, Proc, RedisCluster, Service};
use testkit::sale::{open_sale, Sale, SaleSpec};

use crate::side::SideQuery;
use crate::with_database;
use plan::{Fault, PlannedSale};
use shop::{FollowUps, Shop};
use watch::{Point, Targets, Watch};

/// What the day is asked to do.
#[derive(clap::Args, Debug, Clone, Serialize)]
pub struct DayOptions {
    /// Where report.md, day.json and the plots go.
    #[arg(long, default_value = "results/day")]
    pub out: PathBuf,
    /// The repository (its `config/`).
    #[arg(long, default_value = ".")]
    pub repo: PathBuf,
    /// Sales over the day.
    #[arg(long, default_value_t = 24)]
    pub sales: usize,
    /// Minutes from the first sale's creation to the last sale's end.
    #[arg(long, default_value_t = 15.0)]
    pub minutes: f64,
    /// Clicks a second on each open sale.
    #[arg(long, default_value_t = 30.0)]
    pub clicks_per_s: f64,
    /// Users joining each waiting room.
    #[arg(long, default_value_t = 300)]
    pub joiners: usize,
    /// The pool of users every sale draws its buyers from.
    #[arg(long, default_value_t = 3000)]
    pub users: usize,
    /// Of the winners, the share who pay; the others' orders lapse.
    #[arg(long, default_value_t = 0.6)]
    pub pay_share: f64,
    #[arg(long, default_value_t = 20)]
    pub payment_timeout_secs: u32,
    /// `redis.retain_after_end_secs` for the day (the default is a day).
    #[arg(long, default_value_t = 150)]
    pub retain_secs: u64,
    /// The side query's rate (queries a second), for the whole run.
    #[arg(long, default_value_t = 50.0)]
    pub side_rate: f64,
    /// The pace phase: clicks a second (each a `202`), and windows of each kind.
    #[arg(long, default_value_t = 200.0)]
    pub pace_clicks_per_s: f64,
    #[arg(long, default_value_t = 10)]
    pub pace_cycles: u32,
    /// The budget variant's `consumer.max_orders_per_sec`.
    #[arg(long, default_value_t = 300)]
    pub pace_budget: u32,
    /// Seconds between two looks of the watch.
    #[arg(long, default_value_t = 5.0)]
    pub every_s: f64,
    /// Polls of each kind in the poll-cost measurement.
    #[arg(long, default_value_t = 2000)]
    pub polls: usize,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// The deployment the day runs on.
pub struct Deployment {
    dir: PathBuf,
    pub cluster: RedisCluster,
    pub broker: Broker,
    env: Env,
    pub apis: Vec<Service>,
    consumers: Vec<Proc>,
    pub kafka: KafkaSettings,
    /// The service's database (root).
    pub mysql_url: String,
    /// Dropped with the deployment.
    _db: TestDatabase,
    pub admin: String,
    pub auth: Auth,
    pub client: reqwest::Client,
}

/// Buyers stop this long before a sale's end: a click answered after it is
/// refused by the window, which is no answer of the sale's.
const BEFORE_END: Duration = Duration::from_millis(2500);

/// Two API instances and two consumers.
const INSTANCES: usize = 2;
const CONSUMERS: usize = 2;

impl Deployment {
    async fn start(opts: &DayOptions, settings: &Settings, dir: &Path) -> anyhow::Result<Self> {
        eprintln!("== day: a Redis Cluster (9 nodes) and a broker of the day's own");
        let cluster = tokio::task::block_in_place(|| RedisCluster::start(dir));
        let broker = tokio::task::block_in_place(|| Broker::start(dir));
        let db_name = testkit::unique("flashsale_day_");
        let mysql_url = with_database(settings.mysql.url.expose_secret(), &db_name);
        let server = mysql_url
            .rsplit_once('/')
            .map(|(s, _)| s.to_owned())
            .context("the MySQL URL has no database")?;
        let db = TestDatabase::new(&server, &db_name);
        let kafka = KafkaSettings {
            brokers: broker.brokers(),
            topic: testkit::unique("flash.day."),
            group_id: testkit::unique("flashsale-day-"),
            ..settings.kafka.clone()
        };
        // Secrets of the day's own, as production requires.
        let admin = format!(
            "{}{}",
            uuid::Uuid::new_v4().simple(),
            uuid::Uuid::new_v4().simple()
        );
        let user_secret = SecretString::from(format!(
            "{}{}",
            uuid::Uuid::new_v4().simple(),
            uuid::Uuid::new_v4().simple()
        ));
        let auth = Auth::new(SecretString::from(admin.clone()), &user_secret)?;
        let bin = crate::process::sibling("flashsale").context(
            "the day runs the service's own binary: cargo build --release --bin flashsale",
        )?;
        let mut env = Env::new(bin, opts.repo.join("config"));
        for (k, v) in [
            ("FLASHSALE_ENV", "production".to_owned()),
            // Its buyers mark their own orders paid (payments.provider = none),
            // which production refuses unless told it is meant.
            ("FLASHSALE__PAYMENTS__ALLOW_UNVERIFIED", "true".to_owned()),
            ("FLASHSALE__AUTH__ADMIN_TOKEN", admin.clone()),
            (
                "FLASHSALE__AUTH__USER_TOKEN_SECRET",
                user_secret.expose_secret().to_owned(),
            ),
            ("FLASHSALE__REDIS__URL", cluster.url()),
            ("FLASHSALE__REDIS__MIN_REPLICAS_ACKED", "1".into()),
            (
                "FLASHSALE__REDIS__RETAIN_AFTER_END_SECS",
                opts.retain_secs.to_string(),
            ),
            ("FLASHSALE__MYSQL__URL", mysql_url.clone()),
            ("FLASHSALE__KAFKA__BROKERS", kafka.brokers.clone()),
            ("FLASHSALE__KAFKA__TOPIC", kafka.topic.clone()),
            (
                "FLASHSALE__KAFKA__DEAD_LETTER_TOPIC",
                format!("{}.dlq", kafka.topic),
            ),
            ("FLASHSALE__KAFKA__GROUP_ID", kafka.group_id.clone()),
            // The broker here is tansu 0.6: its known defects worked around
            // (the producer without idempotence); real Kafka runs with "none".
            ("FLASHSALE__KAFKA__BROKER_QUIRKS", "tansu-0.6".into()),
            // Every buyer comes from one loopback address, one process.
            ("FLASHSALE__RATE_LIMIT__PER_IP_PER_SEC", "0".into()),
            ("FLASHSALE__RATE_LIMIT__PER_USER_PER_SEC", "0".into()),
            ("FLASHSALE__SERVER__DRAIN_DELAY_SECS", "0".into()),
            ("FLASHSALE__CONSUMER__ENABLED", "false".into()),
        ] {
            env.set(k, v);
        }
        let mut migrate = flashsale(&["migrate"], &env, dir.join("migrate.log"), "migrate");
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            match migrate.try_wait() {
                Some(true) => break,
                Some(false) => anyhow::bail!("migrate failed:\n{}", migrate.log_tail(20)),
                None if Instant::now() > deadline => anyhow::bail!("migrate did not finish"),
                None => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        let apis = tokio::task::block_in_place(|| {
            (0..INSTANCES)
                .map(|i| Service::start(&format!("api-{}", (b'a' + i as u8) as char), &env, dir))
                .collect()
        });
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .pool_max_idle_per_host(256)
            .build()
            .context("the HTTP client")?;
        let mut dep = Deployment {
            dir: dir.to_owned(),
            cluster,
            broker,
            env,
            apis,
            consumers: Vec::new(),
            kafka,
            mysql_url,
            _db: db,
            admin,
            auth,
            client,
        };
        dep.restart_consumers(&[]);
        Ok(dep)
    }

    /// Stops the consumers (gracefully) and starts them again with `extra`.
    pub fn restart_consumers(&mut self, extra: &[(&str, String)]) {
        for mut c in self.consumers.drain(..) {
            c.terminate();
        }
        let mut env = self.env.clone();
        for (k, v) in extra {
            env.set(k, v);
        }
        for i in 0..CONSUMERS {
            let name = format!("consumer-{}", i + 1);
            self.consumers.push(flashsale(
                &["consume"],
                &env,
                self.dir.join(format!("{name}.log")),
                &name,
            ));
        }
    }

    pub fn pause_consumers(&self) {
        for c in &self.consumers {
            c.pause();
        }
    }

    pub fn resume_consumers(&self) {
        for c in &self.consumers {
            c.resume();
        }
    }

    /// The doors of each instance, with user tokens.
    pub fn apis_of_users(&self) -> Vec<Api> {
        self.apis
            .iter()
            .map(|s| {
                Api::new(self.client.clone(), s.base(), &self.admin).with_users(self.auth.clone())
            })
            .collect()
    }

    pub fn probe(&self, activity_id: &str) -> Probe {
        Probe {
            mysql_url: self.mysql_url.clone(),
            redis_url: self.cluster.url(),
            activity_id: activity_id.to_owned(),
            kafka: self.kafka.clone(),
        }
    }

    async fn scalar(&self, sql: &str, bind: Option<&str>) -> anyhow::Result<i64> {
        let pool = sqlx::MySqlPool::connect(&self.mysql_url).await?;
        let mut q = sqlx::query_scalar::<_, i64>(sql);
        if let Some(b) = bind {
            q = q.bind(b);
        }
        let n = q.fetch_one(&pool).await;
        pool.close().await;
        Ok(n?)
    }

    pub async fn order_count(&self) -> anyhow::Result<i64> {
        self.scalar("SELECT COUNT(*) FROM orders", None).await
    }

    pub async fn orders_of(&self, activity_id: &str) -> anyhow::Result<i64> {
        self.scalar(
            "SELECT COUNT(*) FROM orders WHERE activity_id = ?",
            Some(activity_id),
        )
        .await
    }

    /// Every node's URL that is a primary now.
    fn primary_urls(&self) -> Vec<String> {
        self.cluster
            .primaries()
            .into_iter()
            .map(|p| format!("redis://127.0.0.1:{p}"))
            .collect()
    }

    fn processes(&self) -> Vec<(String, u32)> {
        let apis = self.apis.iter().enumerate().filter_map(|(i, s)| {
            Some((
                format!("api-{}", (b'a' + i as u8) as char),
                s.proc.as_ref()?.id()?,
            ))
        });
        let consumers = self
            .consumers
            .iter()
            .filter_map(|c| Some((c.name.clone(), c.id()?)));
        apis.chain(consumers).collect()
    }
}

/// What happened to one sale, and what its check found.
#[derive(Debug, Serialize)]
pub struct SaleResult {
    pub plan: PlannedSale,
    pub activity_id: String,
    /// Reservation answers by status and code (`"202"`, `"409 sold_out"`, `"lost"`).
    pub answers: BTreeMap<String, usize>,
    pub room_answers: usize,
    pub joined: usize,
    pub follow: FollowUps,
    pub orders: i64,
    pub paid: i64,
    pub cancelled: i64,
    /// The longest a buyer of this sale waited for a real answer (not a `5xx`,
    /// not a lost connection), the operator's pause left out.
    pub longest_without_service_s: f64,
    /// From the fault struck on this sale to its first real answer.
    pub after_fault_s: Option<f64>,
    pub invariants: Result<(), String>,
}

/// A step the day takes on a sale at a set time.
#[derive(Debug, Clone, Copy)]
enum Step {
    Create,
    TopUp(u32),
    Pause,
    Resume,
    Strike(Fault),
    /// Once its last lapse is past: wait for it to be quiet, and check it.
    Check,
}

/// When something was done, seconds from the day's start.
#[derive(Debug, Clone, Serialize)]
pub struct Done {
    pub sale: usize,
    pub what: String,
    pub at_s: f64,
    pub until_s: Option<f64>,
}

/// The whole run, as day.json keeps it.
#[derive(Debug, Serialize)]
pub struct DayRun {
    pub options: DayOptions,
    pub started_at: String,
    pub seconds: f64,
    pub pace: Vec<pace::PaceRun>,
    pub side_idle: crate::side::SideStats,
    pub sales: Vec<SaleResult>,
    pub done: Vec<Done>,
    pub polls: Option<report::PollCosts>,
    pub removed_after_s: Option<f64>,
    pub points: Vec<Point>,
    /// Side-query samples are not kept; the day's windows are, for the plots.
    pub day_starts_unix_ms: f64,
}

pub async fn run(opts: DayOptions) -> anyhow::Result<DayRun> {
    let started_at = chrono::Utc::now().to_rfc3339();
    let t_run = Instant::now();
    std::fs::create_dir_all(&opts.out)
        .with_context(|| format!("failed to create {}", opts.out.display()))?;
    let work = opts.out.join("run");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work)?;
    let settings = Settings::load_from(&opts.repo.join("config"), "production")?;
    let side_db = testkit::unique("flashsale_day_side_");
    let side_url = with_database(settings.mysql.url.expose_secret(), &side_db);
    MySql::create_database(&side_url)
        .await
        .context("failed to create the side database")?;
    let side = Arc::new(SideQuery::start(&side_url, opts.side_rate).await?);
    let outcome = async {
        let mut dep = Deployment::start(&opts, &settings, &work).await?;
        let idle_from = crate::clock::now_unix_ms();
        tokio::time::sleep(Duration::from_secs(10)).await;
        let side_idle = side.window(idle_from, crate::clock::now_unix_ms())?;
        let mut paces = Vec::new();
        for variant in pace::variants(opts.pace_budget) {
            paces.push(
                pace::run(
                    &mut dep,
                    &side,
                    &variant,
                    opts.pace_clicks_per_s,
                    opts.pace_cycles,
                )
                .await?,
            );
        }
        dep.restart_consumers(&[]);
        let day = the_day(&opts, &mut dep, &side).await;
        for s in &mut dep.apis {
            s.stop();
        }
        for c in &mut dep.consumers {
            c.terminate();
        }
        let (sales, done, polls, removed_after_s, points, day_starts_unix_ms) = day?;
        drop(dep);
        anyhow::Ok(DayRun {
            options: opts.clone(),
            started_at,
            seconds: t_run.elapsed().as_secs_f64(),
            pace: paces,
            side_idle,
            sales,
            done,
            polls,
            removed_after_s,
            points,
            day_starts_unix_ms,
        })
    }
    .await;
    // The watch that shared it has stopped.
    if let Ok(side) = Arc::try_unwrap(side) {
        side.stop();
    }
    let _ = MySql::drop_database(&side_url).await;
    let day = outcome?;
    let json = opts.out.join("day.json");
    std::fs::write(&json, serde_json::to_vec_pretty(&day)?)
        .with_context(|| format!("failed to write {}", json.display()))?;
    let md = opts.out.join("report.md");
    std::fs::write(&md, report::render(&day))
        .with_context(|| format!("failed to write {}", md.display()))?;
    Ok(day)
}

type DayOutcome = (
    Vec<SaleResult>,
    Vec<Done>,
    Option<report::PollCosts>,
    Option<f64>,
    Vec<Point>,
    f64,
);

/// The sales, the poll costs and the tail.
async fn the_day(
    opts: &DayOptions,
    dep: &mut Deployment,
    side: &Arc<SideQuery>,
) -> anyhow::Result<DayOutcome> {
    let planned = plan::plan(opts.sales, opts.minutes, opts.clicks_per_s, opts.joiners);
    let users: Vec<String> = (0..opts.users).map(|i| format!("day-{i}")).collect();
    let shop = Shop {
        apis: Arc::new(dep.apis_of_users()),
        users: Arc::new(users),
        sent: Arc::new(shop::Sent::default()),
        pay_share: opts.pay_share,
    };
    let t0 = Instant::now();
    let day_starts_unix_ms = crate::clock::now_unix_ms();
    let ports: Vec<u16> = dep.cluster.nodes.iter().map(|n| n.port).collect();
    let watch = Watch::start(
        Targets {
            redis_ports: ports.clone(),
            processes: dep.processes(),
            mysql_url: dep.mysql_url.clone(),
            kafka: dep.kafka.clone(),
            sent: shop.sent.clone(),
            side: side.clone(),
            apis: dep.apis_of_users(),
        },
        t0,
        Duration::from_secs_f64(opts.every_s),
    );
    let mut steps: Vec<(f64, usize, Step)> = Vec::new();
    for s in &planned {
        steps.push((s.starts_at_s - plan::LEAD_S, s.index, Step::Create));
        if let Some((at, units)) = s.top_up {
            steps.push((s.starts_at_s + at, s.index, Step::TopUp(units)));
        }
        if let Some((at, secs)) = s.pause {
            steps.push((s.starts_at_s + at, s.index, Step::Pause));
            steps.push((s.starts_at_s + at + secs, s.index, Step::Resume));
        }
        if let Some((at, fault)) = s.fault {
            steps.push((s.starts_at_s + at, s.index, Step::Strike(fault)));
        }
        let lapsed = f64::from(opts.payment_timeout_secs) + 8.0;
        steps.push((s.ends_at_s() + lapsed, s.index, Step::Check));
    }
    steps.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut sales: BTreeMap<usize, Sale> = BTreeMap::new();
    let mut tasks: BTreeMap<usize, tokio::task::JoinHandle<shop::Took>> = BTreeMap::new();
    let mut done: Vec<Done> = Vec::new();
    let mut marks: BTreeMap<usize, Instant> = BTreeMap::new();
    let mut checks: Vec<tokio::task::JoinHandle<(SaleResult, Vec<String>)>> = Vec::new();
    let admin_api = dep.apis_of_users()[0].clone();
    for (at, i, step) in steps {
        tokio::time::sleep_until((t0 + Duration::from_secs_f64(at.max(0.0))).into()).await;
        let p = &planned[i];
        let at_s = t0.elapsed().as_secs_f64();
        match step {
            Step::Create => {
                let spec = SaleSpec {
                    stock: p.stock,
                    stock_shards: p.stock_shards,
                    waiting_room: p.waiting_room,
                    payment_timeout_secs: opts.payment_timeout_secs,
                    starts_in_secs: (t0 + Duration::from_secs_f64(p.starts_at_s))
                        .saturating_duration_since(Instant::now())
                        .as_secs() as i64,
                    open_secs: p.open_s as i64,
                    ..SaleSpec::new(p.stock)
                };
                let sale = open_sale(&dep.client, &dep.apis[0].base(), &dep.admin, &spec)
                    .await
                    .map_err(|e| anyhow::anyhow!("{}: {e}", p.name()))?;
                eprintln!(
                    "== day +{at_s:.0} s: {} created ({} units, {} shard(s), {})",
                    p.name(),
                    p.stock,
                    p.stock_shards,
                    if p.waiting_room {
                        "waiting room"
                    } else {
                        "open"
                    }
                );
                // The sale's window is whole seconds, at most one before the
                // day's: its buyers start on time and stop short of its end.
                let start = t0 + Duration::from_secs_f64(p.starts_at_s);
                let end = t0 + Duration::from_secs_f64(p.ends_at_s()) - BEFORE_END;
                let seed = opts.seed.wrapping_mul(1000).wrapping_add(i as u64);
                let (shop, sku, p) = (shop.clone(), sale.sku.clone(), p.clone());
                tasks.insert(
                    i,
                    tokio::spawn(async move {
                        if p.waiting_room {
                            shop.waiting_room(sku, p.joiners, start, end, seed).await
                        } else {
                            shop.open_sale(sku, p.clicks_per_s, start, end, seed).await
                        }
                    }),
                );
                sales.insert(i, sale);
            }
            Step::TopUp(units) => {
                let id = &sales[&i].id;
                let r = admin_api.top_up(id, &json!({ "add": units })).send().await;
                let ok = r.as_ref().is_ok_and(|r| r.status().is_success());
                done.push(Done {
                    sale: i,
                    what: format!("top-up +{units}{}", if ok { "" } else { " (refused)" }),
                    at_s,
                    until_s: None,
                });
            }
            Step::Pause => {
                let _ = admin_api.pause(&sales[&i].id).send().await;
                done.push(Done {
                    sale: i,
                    what: "paused".into(),
                    at_s,
                    until_s: None,
                });
            }
            Step::Resume => {
                let _ = admin_api.resume(&sales[&i].id).send().await;
                if let Some(d) = done
                    .iter_mut()
                    .rev()
                    .find(|d| d.sale == i && d.what == "paused")
                {
                    d.until_s = Some(at_s);
                }
            }
            Step::Check => {
                let Some(task) = tasks.remove(&i) else {
                    continue;
                };
                let took = task.await.context("a sale's buyers failed")?;
                let ctx = Checking {
                    probe: dep.probe(&sales[&i].id),
                    apis: dep.apis_of_users(),
                    plan: p.clone(),
                    sale: sales[&i].clone(),
                    done: done.clone(),
                    fault_mark: marks.get(&i).copied(),
                    t0,
                };
                checks.push(tokio::spawn(async move {
                    let joined = took.joined.clone();
                    let result = ctx.check(&took).await;
                    eprintln!(
                        "== day +{:.0} s: {} checked: {}",
                        t0.elapsed().as_secs_f64(),
                        result.plan.name(),
                        match &result.invariants {
                            Ok(()) => "invariants hold".to_owned(),
                            Err(e) => format!("INVARIANT BROKEN: {e}"),
                        }
                    );
                    (result, joined)
                }));
            }
            Step::Strike(fault) => {
                eprintln!("== day +{at_s:.0} s: {} on {}", fault.label(), p.name());
                let (mark, until) = strike(dep, &sales[&i], fault).await?;
                marks.insert(i, mark);
                done.push(Done {
                    sale: i,
                    what: fault.label().into(),
                    at_s: mark.duration_since(t0).as_secs_f64(),
                    until_s: Some(until.duration_since(t0).as_secs_f64()),
                });
            }
        }
    }
    let mut results = Vec::new();
    let mut last_room: Option<(usize, Vec<String>)> = None;
    for check in checks {
        let (result, joined) = check.await.context("a sale's check failed")?;
        if result.plan.waiting_room {
            last_room = Some((result.plan.index, joined));
        }
        results.push(result);
    }
    // The cost of a poll, on the last waiting room's sale (its state still held).
    let polls = match last_room {
        Some((i, joined)) => Some(
            report::poll_costs(dep, &shop, side, &sales[&i], &joined, &ports, opts.polls).await?,
        ),
        None => None,
    };
    // The tail: until every sale's keys are gone.
    let last_end = planned
        .iter()
        .map(PlannedSale::ends_at_s)
        .fold(0.0, f64::max);
    let limit = t0 + Duration::from_secs_f64(last_end + opts.retain_secs as f64 + 120.0);
    let mut removed_after_s = None;
    while Instant::now() < limit {
        let left = dep
            .scalar(
                "SELECT COUNT(*) FROM activities WHERE redis_removed_at IS NULL",
                None,
            )
            .await
            .unwrap_or(-1);
        if left == 0 {
            removed_after_s = Some(t0.elapsed().as_secs_f64() - last_end);
            break;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    // A few more looks once everything is gone.
    tokio::time::sleep(Duration::from_secs_f64(opts.every_s * 3.0)).await;
    let points = watch.stop().await;
    Ok((
        results,
        done,
        polls,
        removed_after_s,
        points,
        day_starts_unix_ms,
    ))
}

/// Strikes `fault` on `sale`; returns when it struck and when it was healed.
async fn strike(
    dep: &mut Deployment,
    sale: &Sale,
    fault: Fault,
) -> anyhow::Result<(Instant, Instant)> {
    match fault {
        Fault::KeysLost => {
            let mark = Instant::now();
            let n = testkit::sale::forget_in_redis(&dep.primary_urls(), &sale.id)
                .await
                .map_err(anyhow::Error::msg)?;
            eprintln!("== day: {n} keys deleted");
            Ok((mark, Instant::now()))
        }
        Fault::PrimaryKilled => {
            let key = flashsale::stock::Keys::new(&sale.id).stock;
            let port = dep
                .cluster
                .primary_for(&key)
                .context("no primary owns the sale's slot")?;
            let mark = Instant::now();
            dep.cluster.kill(port);
            let promoted = testkit::within(Duration::from_secs(30), "a replica promoted", || {
                let now = dep.cluster.primary_for(&key);
                async move { now.filter(|p| *p != port) }
            })
            .await
            .map_err(anyhow::Error::msg)?;
            eprintln!("== day: primary {port} killed, {promoted} promoted");
            tokio::time::sleep(Duration::from_secs(5)).await;
            tokio::task::block_in_place(|| dep.cluster.restart(port));
            tokio::task::block_in_place(|| dep.cluster.wait_healthy(Duration::from_secs(60)))
                .map_err(anyhow::Error::msg)?;
            Ok((mark, Instant::now()))
        }
        Fault::BrokerRestarted => {
            let mark = Instant::now();
            dep.broker.kill();
            tokio::time::sleep(Duration::from_secs(3)).await;
            tokio::task::block_in_place(|| dep.broker.start_again());
            Ok((mark, Instant::now()))
        }
    }
}

/// What a sale's check needs, apart from the deployment (which the day's
/// faults change meanwhile).
struct Checking {
    probe: Probe,
    apis: Vec<Api>,
    plan: PlannedSale,
    sale: Sale,
    done: Vec<Done>,
    fault_mark: Option<Instant>,
    t0: Instant,
}

impl Checking {
    /// Waits for the sale to be quiet, checks the invariants, and sums up.
    async fn check(self, took: &shop::Took) -> SaleResult {
        let Checking {
            probe,
            apis,
            plan: p,
            sale,
            done,
            fault_mark,
            t0,
        } = self;
        let p = &p;
        let answers: Vec<Answer> = took.reserves.iter().map(|s| s.answer.clone()).collect();
        let mut invariants = probe.wait_quiet(Duration::from_secs(120)).await;
        let mut figures = None;
        if invariants.is_ok() {
            match probe.check(&answers).await {
                Ok(f) => figures = Some(f),
                Err(e) => invariants = Err(e),
            }
        }
        if invariants.is_ok() && p.waiting_room {
            let mut places = Vec::new();
            for (k, user) in took.joined.iter().enumerate() {
                // What the service answers the user now: `200` with a state,
                // or `404` ("none"); anything else is asked again.
                let mut state = "none".to_owned();
                for attempt in 0..5 {
                    let answer = apis[(k + attempt) % apis.len()]
                        .queue_place(&sale.sku, Caller::User(user))
                        .send()
                        .await;
                    if let Ok(r) = answer {
                        if r.status().as_u16() == 404 {
                            break;
                        }
                        if r.status().is_success() {
                            if let Some(s) = r
                                .json::<serde_json::Value>()
                                .await
                                .ok()
                                .and_then(|b| b["state"].as_str().map(str::to_owned))
                            {
                                state = s;
                                break;
                            }
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                places.push((user.clone(), state));
            }
            invariants = probe.room_outcomes(&places).await;
        }
        // The operator's pause is no outage: its answers are left out.
        let paused: Vec<(Instant, Instant)> = done
            .iter()
            .filter(|d| d.sale == p.index && d.what == "paused")
            .map(|d| {
                let from = t0 + Duration::from_secs_f64(d.at_s);
                let to = t0 + Duration::from_secs_f64(d.until_s.unwrap_or(d.at_s) + 1.0);
                (from, to)
            })
            .collect();
        let samples: Vec<Sample> = took
            .reserves
            .iter()
            .chain(took.room.iter())
            .filter(|s| !paused.iter().any(|(f, t)| s.sent >= *f && s.sent <= *t))
            .cloned()
            .collect();
        let start = t0 + Duration::from_secs_f64(p.starts_at_s);
        let first = samples.iter().map(|s| s.sent).min().unwrap_or(start);
        let outage = Outage::measure(&samples, first);
        let longest = outage
            .gap
            .unwrap_or(Duration::ZERO)
            .max(outage.later_gap)
            .as_secs_f64();
        let after_fault_s =
            fault_mark.and_then(|m| Outage::measure(&samples, m).gap.map(|g| g.as_secs_f64()));
        let mut by_answer = BTreeMap::new();
        for a in &answers {
            let key = match (a.status, a.code.as_deref()) {
                (None, _) => "lost".to_owned(),
                (Some(s), Some(c)) => format!("{s} {c}"),
                (Some(s), None) => s.to_string(),
            };
            *by_answer.entry(key).or_default() += 1;
        }
        let f = figures.unwrap_or_default();
        SaleResult {
            plan: p.clone(),
            activity_id: sale.id.clone(),
            answers: by_answer,
            room_answers: took.room.len(),
            joined: took.joined.len(),
            follow: took.follow.clone(),
            orders: f.live_orders + f.cancelled,
            paid: f.paid,
            cancelled: f.cancelled,
            longest_without_service_s: longest,
            after_fault_s,
            invariants,
        }
    }
}
