//! The fault-injection suite: real processes, real kills, on loopback.
//!
//! Every scenario runs a sale of 1,200 requests (600 users clicking twice) against
//! 100 units on `flashsale` processes while one fault is injected, and the
//! reconciler is run over and over, concurrently, from the admin endpoint and the
//! CLI. When everything is quiet again (the consumers drained, nothing pending in
//! Redis, every failed or cancelled order's units returned), a checker reads MySQL,
//! Redis and the recorded HTTP answers and asserts the four invariants:
//!
//! 1. no oversell: live units in MySQL ≤ stock, Redis stock ≥ 0;
//! 2. at most one order per user;
//! 3. every `202` ended as an order, or as a failed reservation whose units were
//!    returned;
//! 4. stock is conserved: Redis stock + live units = stock = MySQL available + live.
//!
//! It prints a table and ends with `N passed, M failed`. Run it alone with
//! `cargo test --test faults`; extra arguments select scenarios by name.

mod cluster;

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cluster::{flashsale, Broker, Env, MariaDb, Proc, Redis, Service};
use flashsale::auth::Auth;
use flashsale::config::{KafkaSettings, Settings};
use secrecy::ExposeSecret;
use serde_json::{json, Value};

const USERS: usize = 600;
const CLICKS: usize = 2;
const STOCK: i64 = 100;
const RATE_PER_SEC: u64 = 250;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    BrokerKilled,
    MariaDbStopped,
    ConsumerKilled,
    ServiceKilled,
    RedisRestartedEmpty,
    EveryMessageTwice,
    PaymentsRaceSweeper,
    TwoInstances,
    ScriptCacheFlushed,
}

const ALL: [(Fault, &str); 9] = [
    (Fault::BrokerKilled, "kafka broker killed and restarted"),
    (Fault::MariaDbStopped, "mariadb stopped and restarted"),
    (
        Fault::ConsumerKilled,
        "consumer killed mid-batch, restarted",
    ),
    (
        Fault::ServiceKilled,
        "service SIGKILLed mid-sale, restarted",
    ),
    (Fault::RedisRestartedEmpty, "redis restarted empty"),
    (Fault::EveryMessageTwice, "every message delivered twice"),
    (Fault::PaymentsRaceSweeper, "payments racing the sweeper"),
    (Fault::TwoInstances, "two services, two consumers"),
    (Fault::ScriptCacheFlushed, "script cache flushed mid-sale"),
];

#[derive(Debug, Clone)]
struct Answer {
    status: Option<u16>,
    code: Option<String>,
    reservation_id: Option<String>,
}

#[derive(Debug, Default)]
struct Row {
    requests: usize,
    accepted: usize,
    refused_503: usize,
    lost_connections: usize,
    live_orders: i64,
    paid: i64,
    cancelled: i64,
    failed_refunded: i64,
    reconcile_calls: usize,
    seconds: f64,
}

fn main() {
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let selected: Vec<(Fault, &str)> = ALL
        .iter()
        .copied()
        .filter(|(f, name)| {
            let id = format!("{f:?}").to_lowercase();
            filters.is_empty()
                || filters.iter().any(|x| {
                    id.contains(&x.to_lowercase())
                        || name.contains(x.as_str())
                        || "faults".contains(x.as_str())
                })
        })
        .collect();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("faults: cannot start a runtime: {e}");
            std::process::exit(2);
        }
    };
    let results = runtime.block_on(async {
        // Two at a time: enough to overlap the waits on a 2-core machine.
        let gate = Arc::new(tokio::sync::Semaphore::new(2));
        let mut tasks = Vec::new();
        for (fault, name) in selected {
            let gate = gate.clone();
            tasks.push(tokio::spawn(async move {
                let _permit = gate.acquire_owned().await;
                let started = Instant::now();
                let result = tokio::spawn(scenario(fault)).await;
                let result = match result {
                    Ok(r) => r,
                    Err(panic) => Err(format!("panicked: {panic}")),
                };
                (name, result, started.elapsed())
            }));
        }
        let mut out = Vec::new();
        for t in tasks {
            match t.await {
                Ok(r) => out.push(r),
                Err(e) => out.push(("?", Err(format!("task failed: {e}")), Duration::ZERO)),
            }
        }
        out
    });

    println!();
    println!("| scenario | requests | 202 | 503 | conn. lost | live orders (paid) | cancelled | failed + refunded | reconcile runs | invariants | s |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |");
    let mut passed = 0;
    let mut failed = 0;
    for (name, result, elapsed) in &results {
        match result {
            Ok(r) => {
                passed += 1;
                println!(
                    "| {name} | {} | {} | {} | {} | {} ({}) | {} | {} | {} | hold | {:.0} |",
                    r.requests,
                    r.accepted,
                    r.refused_503,
                    r.lost_connections,
                    r.live_orders,
                    r.paid,
                    r.cancelled,
                    r.failed_refunded,
                    r.reconcile_calls,
                    elapsed.as_secs_f64()
                );
            }
            Err(e) => {
                failed += 1;
                println!(
                    "| {name} | | | | | | | | | BROKEN | {:.0} |",
                    elapsed.as_secs_f64()
                );
                eprintln!("\n--- {name} failed:\n{e}\n");
            }
        }
    }
    println!();
    println!("faults: {passed} passed, {failed} failed");
    if failed > 0 {
        std::process::exit(1);
    }
}

fn unique(prefix: &str) -> String {
    format!("{prefix}{}", uuid::Uuid::new_v4().simple())
}

fn base_settings() -> Settings {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    Settings::load_from(&dir, "test").expect("config loads")
}

async fn scenario(fault: Fault) -> Result<Row, String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let started = Instant::now();
    let settings = base_settings();
    let auth = Auth::new(
        settings.auth.admin_token.clone(),
        &settings.auth.user_token_secret,
    )
    .map_err(|e| e.to_string())?;
    let admin = settings.auth.admin_token.expose_secret().to_owned();

    // The scenario's own Redis, database, topic and groups.
    let mut redis = Redis::start(dir.path());
    let db = unique("flashsale_f_");
    let mut mariadb = (fault == Fault::MariaDbStopped).then(|| MariaDb::start(dir.path()));
    let mysql_url = match &mariadb {
        Some(m) => m.url(&db),
        None => format!("mysql://root@127.0.0.1:3306/{db}"),
    };
    let mut broker = (fault == Fault::BrokerKilled).then(|| Broker::start(dir.path()));
    let brokers = broker.as_ref().map(Broker::brokers).unwrap_or_else(|| {
        std::env::var("FLASHSALE_TEST_KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into())
    });
    let topic = unique("flash.f.");
    let group = unique("flashsale-f-");

    let mut env = Env { vars: Vec::new() };
    env.set("FLASHSALE__REDIS__URL", redis.url());
    env.set("FLASHSALE__MYSQL__URL", &mysql_url);
    env.set("FLASHSALE__MYSQL__ACQUIRE_TIMEOUT_MS", 1000);
    env.set("FLASHSALE__KAFKA__BROKERS", &brokers);
    env.set("FLASHSALE__KAFKA__TOPIC", &topic);
    env.set(
        "FLASHSALE__KAFKA__DEAD_LETTER_TOPIC",
        format!("{topic}.dlq"),
    );
    env.set("FLASHSALE__KAFKA__GROUP_ID", &group);
    env.set("FLASHSALE__KAFKA__PUBLISH_TIMEOUT_MS", 1500);
    env.set("FLASHSALE__RATE_LIMIT__PER_IP_PER_SEC", 0);
    env.set("FLASHSALE__RATE_LIMIT__PER_USER_PER_SEC", 0);
    env.set("FLASHSALE__CONSUMER__BATCH_WAIT_MS", 10);
    env.set("FLASHSALE__ORDERS__SWEEP_INTERVAL_SECS", 1);
    env.set("FLASHSALE__RECONCILE__INTERVAL_SECS", 1);
    // Above the time a consumer group needs to hand a dead member's partitions
    // to a live one, so reservations are decided by the reconciler only when
    // they truly never reached the topic.
    env.set("FLASHSALE__RECONCILE__PENDING_DEADLINE_SECS", 15);
    env.set("FLASHSALE__ACTIVITIES__REFRESH_INTERVAL_MS", 200);
    env.set("FLASHSALE__SERVER__SHUTDOWN_GRACE_SECS", 3);
    if fault == Fault::ConsumerKilled {
        env.set("FLASHSALE__CONSUMER__ENABLED", false);
    }
    // FAULTS_LOG=debug (an EnvFilter) makes the processes' logs talkative.
    if let Ok(filter) = std::env::var("FAULTS_LOG") {
        env.set("FLASHSALE__LOG__FILTER", filter);
    }

    let mut migrate = flashsale(
        &["migrate"],
        &env,
        dir.path().join("migrate.log"),
        "migrate",
    );
    wait_exit(&mut migrate, Duration::from_secs(60))?;

    let mut services = vec![Service::start("service-a", &env, dir.path())];
    if fault == Fault::TwoInstances {
        services.push(Service::start("service-b", &env, dir.path()));
    }
    let mut consumers: Vec<Proc> = Vec::new();
    if fault == Fault::ConsumerKilled {
        consumers.push(flashsale(
            &["consume"],
            &env,
            dir.path().join("consumer.log"),
            "consumer",
        ));
    }
    if fault == Fault::EveryMessageTwice {
        // A second group consumes the same topic: every message is processed twice.
        let mut twin = env.clone();
        twin.set("FLASHSALE__KAFKA__GROUP_ID", unique("flashsale-twin-"));
        consumers.push(flashsale(
            &["consume"],
            &twin,
            dir.path().join("twin.log"),
            "twin consumer",
        ));
    }

    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .pool_max_idle_per_host(64)
        .build()
        .map_err(|e| e.to_string())?;
    let first = services[0].base();
    let payment_timeout = if fault == Fault::PaymentsRaceSweeper {
        2
    } else {
        900
    };
    let (activity_id, sku) = open_sale(&client, &first, &admin, payment_timeout).await?;
    let targets: Arc<Vec<String>> = Arc::new(services.iter().map(Service::base).collect());
    // Every instance learns of a new sale on its next cache refresh; the sale
    // starts once all of them answer for it.
    for base in targets.iter() {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let ok = client
                .get(format!("{base}/flash/{sku}"))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ok {
                break;
            }
            if Instant::now() > deadline {
                return Err(format!("{base} never saw the sale"));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    // One reservation first, through to MySQL: every consumer has joined its group
    // and is consuming before the sale and the fault begin.
    let warmup = warm_up(&client, &first, &sku, &auth, &mysql_url).await?;

    // The reconciler, run over and over, concurrently, on every instance.
    let stop = Arc::new(AtomicBool::new(false));
    let reconcile_calls = Arc::new(AtomicUsize::new(0));
    let mut hammers = Vec::new();
    for _ in 0..2 {
        hammers.push(tokio::spawn(hammer_reconcile(
            client.clone(),
            targets.clone(),
            admin.clone(),
            activity_id.clone(),
            stop.clone(),
            reconcile_calls.clone(),
        )));
    }
    let payer = (fault == Fault::PaymentsRaceSweeper).then(|| {
        tokio::spawn(pay_some(
            client.clone(),
            first.clone(),
            mysql_url.clone(),
            activity_id.clone(),
            auth.clone(),
            stop.clone(),
        ))
    });
    let flusher = (fault == Fault::ScriptCacheFlushed).then(|| {
        let url = redis.url();
        let stop = stop.clone();
        tokio::spawn(async move {
            let Ok(client) = redis::Client::open(url) else {
                return 0;
            };
            let Ok(mut conn) = client.get_multiplexed_async_connection().await else {
                return 0;
            };
            let mut n = 0;
            while !stop.load(Ordering::SeqCst) {
                let r: redis::RedisResult<String> = redis::cmd("SCRIPT")
                    .arg("FLUSH")
                    .query_async(&mut conn)
                    .await;
                if r.is_ok() {
                    n += 1;
                }
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            n
        })
    });

    let sent = Arc::new(AtomicUsize::new(0));
    let load = tokio::spawn(run_load(
        client.clone(),
        targets.clone(),
        sku.clone(),
        auth.clone(),
        sent.clone(),
    ));
    let total = USERS * CLICKS;
    let at = |fraction: f64| (total as f64 * fraction) as usize;

    // The fault, mid-sale: 600 users take 100 units within the first few hundred
    // requests, so the fault comes early, while units are still being sold.
    wait_sent(&sent, at(0.05)).await;
    match fault {
        Fault::BrokerKilled => {
            if let Some(b) = broker.as_mut() {
                b.kill();
                tokio::time::sleep(Duration::from_millis(1500)).await;
                b.start_again();
            }
        }
        Fault::MariaDbStopped => {
            if let Some(m) = mariadb.as_mut() {
                m.kill();
                tokio::time::sleep(Duration::from_millis(1500)).await;
                m.start_again();
            }
        }
        Fault::ConsumerKilled => {
            for round in 0..2 {
                if round == 1 {
                    // Kill the restarted consumer once it is consuming again.
                    let before = order_count(&mysql_url, &activity_id).await;
                    wait_orders_above(&mysql_url, &activity_id, before).await?;
                }
                for c in consumers.iter_mut() {
                    c.kill();
                }
                consumers.clear();
                tokio::time::sleep(Duration::from_millis(500)).await;
                consumers.push(flashsale(
                    &["consume"],
                    &env,
                    dir.path().join("consumer.log"),
                    "consumer",
                ));
            }
        }
        Fault::ServiceKilled => {
            services[0].kill();
            tokio::time::sleep(Duration::from_millis(500)).await;
            services[0].start_again();
        }
        Fault::RedisRestartedEmpty => {
            redis.restart_empty();
        }
        Fault::EveryMessageTwice
        | Fault::PaymentsRaceSweeper
        | Fault::TwoInstances
        | Fault::ScriptCacheFlushed => {}
    }
    // The CLI's reconciler too, mid-sale.
    let mut cli = flashsale(
        &["reconcile", "--activity", &activity_id],
        &env,
        dir.path().join("reconcile-cli.log"),
        "reconcile cli",
    );
    wait_exit(&mut cli, Duration::from_secs(60))?;
    reconcile_calls.fetch_add(1, Ordering::SeqCst);

    let mut answers = load.await.map_err(|e| format!("load task: {e}"))?;
    answers.push(warmup);
    let quiet = wait_quiet(
        &mysql_url,
        &redis.url(),
        &activity_id,
        &brokers,
        &topic,
        &group,
    )
    .await;
    stop.store(true, Ordering::SeqCst);
    for h in hammers {
        let _ = h.await;
    }
    if let Some(p) = payer {
        let _ = p.await;
    }
    let flushes = match flusher {
        Some(f) => f.await.unwrap_or(0),
        None => 0,
    };
    let checked = match quiet {
        Ok(()) => check(&mysql_url, &redis.url(), &activity_id, &answers, fault).await,
        Err(e) => Err(e),
    };
    let row = checked.map(|mut row| {
        row.reconcile_calls = reconcile_calls.load(Ordering::SeqCst);
        row.seconds = started.elapsed().as_secs_f64();
        row
    });
    let row = match row {
        Ok(r) if fault == Fault::ScriptCacheFlushed && flushes == 0 => {
            Err(format!("the script cache was never flushed ({r:?})"))
        }
        other => other,
    };
    if row.is_err() {
        for s in &services {
            eprintln!("--- {} log:\n{}", s.port, s.log_tail());
        }
        if std::env::var_os("FAULTS_KEEP").is_some() {
            eprintln!("--- logs kept in {}", dir.path().display());
            std::mem::forget(dir);
        }
    }
    for s in services.iter_mut() {
        s.stop();
    }
    drop(consumers);
    drop_database(&mysql_url).await;
    row
}

async fn order_count(mysql_url: &str, activity_id: &str) -> i64 {
    let Ok(pool) = sqlx::MySqlPool::connect(mysql_url).await else {
        return 0;
    };
    let n: (i64,) = sqlx::query_as("SELECT COUNT(*) FROM orders WHERE activity_id = ?")
        .bind(activity_id)
        .fetch_one(&pool)
        .await
        .unwrap_or((0,));
    pool.close().await;
    n.0
}

async fn wait_orders_above(mysql_url: &str, activity_id: &str, n: i64) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while order_count(mysql_url, activity_id).await <= n {
        if Instant::now() > deadline {
            return Err(format!("no order beyond {n} within a minute"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

async fn warm_up(
    client: &reqwest::Client,
    base: &str,
    sku: &str,
    auth: &Auth,
    mysql_url: &str,
) -> Result<Answer, String> {
    let token = auth.issue("warmup", 3600).map_err(|e| e.to_string())?;
    let resp = client
        .post(format!("{base}/flash/{sku}/reserve"))
        .bearer_auth(token)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let body: Value = resp.json().await.map_err(|e| e.to_string())?;
    if status != 202 {
        return Err(format!("warm-up reservation answered {status}: {body}"));
    }
    let pool = sqlx::MySqlPool::connect(mysql_url)
        .await
        .map_err(|e| e.to_string())?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (n,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM orders")
            .fetch_one(&pool)
            .await
            .map_err(|e| e.to_string())?;
        if n > 0 {
            break;
        }
        if Instant::now() > deadline {
            return Err("the warm-up order never reached MySQL".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    pool.close().await;
    Ok(Answer {
        status: Some(status),
        code: None,
        reservation_id: body["reservation_id"].as_str().map(str::to_owned),
    })
}

fn wait_exit(p: &mut Proc, within: Duration) -> Result<(), String> {
    let deadline = Instant::now() + within;
    loop {
        match p.try_wait() {
            Some(true) => return Ok(()),
            Some(false) => return Err(format!("{} failed:\n{}", p.name, p.log_tail(20))),
            None if Instant::now() > deadline => return Err(format!("{} did not finish", p.name)),
            None => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

async fn wait_sent(sent: &AtomicUsize, n: usize) {
    while sent.load(Ordering::SeqCst) < n {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn open_sale(
    client: &reqwest::Client,
    base: &str,
    admin: &str,
    payment_timeout_secs: u32,
) -> Result<(String, String), String> {
    let sku = unique("sku-");
    let now = chrono::Utc::now();
    let resp = client
        .post(format!("{base}/admin/activities"))
        .bearer_auth(admin)
        .json(&json!({
            "sku": sku, "stock": STOCK, "per_user_limit": 1,
            "starts_at": now - chrono::Duration::seconds(2),
            "ends_at": now + chrono::Duration::hours(1),
            "payment_timeout_secs": payment_timeout_secs,
        }))
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if resp.status() != reqwest::StatusCode::CREATED {
        return Err(format!("create: {}", resp.status()));
    }
    let body: Value = resp.json().await.map_err(|e| e.to_string())?;
    let id = body["id"].as_str().ok_or("no id")?.to_owned();
    for step in ["pause", "preload", "resume"] {
        let r = client
            .post(format!("{base}/admin/activities/{id}/{step}"))
            .bearer_auth(admin)
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if !r.status().is_success() {
            return Err(format!("{step}: {}", r.status()));
        }
    }
    Ok((id, sku))
}

/// 600 users × 2 clicks at a fixed rate, round-robin over the instances. A
/// connection that fails (an instance killed) is recorded as such.
async fn run_load(
    client: reqwest::Client,
    targets: Arc<Vec<String>>,
    sku: String,
    auth: Auth,
    sent: Arc<AtomicUsize>,
) -> Vec<Answer> {
    let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / RATE_PER_SEC));
    let mut tasks = Vec::with_capacity(USERS * CLICKS);
    for i in 0..USERS * CLICKS {
        tick.tick().await;
        let user = format!("u{}", i / CLICKS);
        let token = auth.issue(&user, 3600).unwrap_or_default();
        let url = format!("{}/flash/{sku}/reserve", targets[i % targets.len()]);
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            match client.post(url).bearer_auth(token).send().await {
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    let body: Value = resp.json().await.unwrap_or(Value::Null);
                    Answer {
                        status: Some(status),
                        code: body["code"].as_str().map(str::to_owned),
                        reservation_id: body["reservation_id"].as_str().map(str::to_owned),
                    }
                }
                Err(_) => Answer {
                    status: None,
                    code: None,
                    reservation_id: None,
                },
            }
        }));
        sent.fetch_add(1, Ordering::SeqCst);
    }
    let mut out = Vec::with_capacity(tasks.len());
    for t in tasks {
        if let Ok(a) = t.await {
            out.push(a);
        }
    }
    out
}

async fn hammer_reconcile(
    client: reqwest::Client,
    targets: Arc<Vec<String>>,
    admin: String,
    activity_id: String,
    stop: Arc<AtomicBool>,
    calls: Arc<AtomicUsize>,
) {
    let mut i = 0;
    while !stop.load(Ordering::SeqCst) {
        let url = format!(
            "{}/admin/activities/{activity_id}/reconcile",
            targets[i % targets.len()]
        );
        if let Ok(r) = client.post(url).bearer_auth(&admin).send().await {
            if r.status().is_success() {
                calls.fetch_add(1, Ordering::SeqCst);
            }
        }
        i += 1;
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
}

/// Pays about half of the orders, at times around their 2-second deadline, while
/// the sweepers cancel the rest.
async fn pay_some(
    client: reqwest::Client,
    base: String,
    mysql_url: String,
    activity_id: String,
    auth: Auth,
    stop: Arc<AtomicBool>,
) {
    let Ok(pool) = sqlx::MySqlPool::connect(&mysql_url).await else {
        return;
    };
    let mut tried = HashSet::new();
    while !stop.load(Ordering::SeqCst) {
        let rows: Vec<(u64, String)> = sqlx::query_as(
            "SELECT id, user_id FROM orders WHERE activity_id = ? AND status = 'pending_payment'",
        )
        .bind(&activity_id)
        .fetch_all(&pool)
        .await
        .unwrap_or_default();
        for (id, user) in rows {
            if id % 2 == 1 || !tried.insert(id) {
                continue;
            }
            let client = client.clone();
            let url = format!("{base}/orders/{id}/pay");
            let token = auth.issue(&user, 3600).unwrap_or_default();
            // Spread the payments over the deadline: some before, some after.
            let delay = Duration::from_millis(1500 + (id % 8) * 100);
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                let _ = client.post(url).bearer_auth(token).send().await;
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    pool.close().await;
}

/// Quiet: every published message committed by the consumers, nothing pending in
/// Redis, the activity loaded and open, every failed or cancelled order's units
/// back, no unpaid order past its deadline.
async fn wait_quiet(
    mysql_url: &str,
    redis_url: &str,
    activity_id: &str,
    brokers: &str,
    topic: &str,
    group: &str,
) -> Result<(), String> {
    let kafka = KafkaSettings {
        brokers: brokers.to_owned(),
        topic: topic.to_owned(),
        group_id: group.to_owned(),
        ..base_settings().kafka
    };
    let keys = flashsale::stock::Keys::new(activity_id);
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut last;
    loop {
        let state = async {
            let pool = sqlx::MySqlPool::connect(mysql_url).await.map_err(|e| e.to_string())?;
            let lag = flashsale::queue::consumer_lag(&kafka).await.map_err(|e| e.to_string())?;
            let client = redis::Client::open(redis_url).map_err(|e| e.to_string())?;
            let mut conn = client
                .get_multiplexed_async_connection()
                .await
                .map_err(|e| e.to_string())?;
            let (pending, stock, state): (i64, Option<i64>, Option<String>) = redis::pipe()
                .zcard(&keys.pending)
                .get(&keys.stock)
                .get(&keys.state)
                .query_async(&mut conn)
                .await
                .map_err(|e| e.to_string())?;
            let (owed, overdue): (i64, i64) = sqlx::query_as(
                "SELECT \
                   CAST(COALESCE(SUM(units_returned = FALSE AND status IN ('failed', 'cancelled')), 0) AS SIGNED), \
                   CAST(COALESCE(SUM(status = 'pending_payment' AND expires_at < NOW(3)), 0) AS SIGNED) \
                 FROM orders WHERE activity_id = ?",
            )
            .bind(activity_id)
            .fetch_one(&pool)
            .await
            .map_err(|e| e.to_string())?;
            pool.close().await;
            Ok::<_, String>(format!(
                "lag {lag}, pending {pending}, stock {stock:?}, state {state:?}, owed {owed}, overdue {overdue}"
            ))
            .map(|s| (s, lag == 0 && pending == 0 && stock.is_some() && state.as_deref() == Some("open") && owed == 0 && overdue == 0))
        }
        .await;
        match state {
            Ok((_, true)) => return Ok(()),
            Ok((s, false)) => last = s,
            Err(e) => last = e,
        }
        if Instant::now() > deadline {
            return Err(format!("never quiet: {last}"));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn check(
    mysql_url: &str,
    redis_url: &str,
    activity_id: &str,
    answers: &[Answer],
    fault: Fault,
) -> Result<Row, String> {
    let pool = sqlx::MySqlPool::connect(mysql_url)
        .await
        .map_err(|e| e.to_string())?;
    let mut row = Row {
        requests: answers.len(),
        ..Row::default()
    };
    let mut problems = Vec::new();
    let mut codes: BTreeMap<String, usize> = BTreeMap::new();
    for a in answers {
        let key = match (a.status, &a.code) {
            (Some(s), Some(c)) => format!("{s} {c}"),
            (Some(s), None) => s.to_string(),
            (None, _) => "connection lost".into(),
        };
        *codes.entry(key).or_default() += 1;
        match a.status {
            Some(202) => row.accepted += 1,
            Some(503) => row.refused_503 += 1,
            None => row.lost_connections += 1,
            _ => {}
        }
        let documented = matches!(
            (a.status, a.code.as_deref()),
            (Some(202), _)
                | (Some(409), Some("sold_out" | "already_reserved"))
                | (Some(503), Some("unavailable" | "paused"))
                | (None, _)
        );
        if !documented {
            problems.push(format!(
                "an undocumented answer: {:?} {:?}",
                a.status, a.code
            ));
        }
    }
    if fault == Fault::ScriptCacheFlushed && (row.refused_503 > 0 || row.lost_connections > 0) {
        problems.push(format!("a flushed script cache failed requests: {codes:?}"));
    }
    if answers.len() < USERS * CLICKS + 1 {
        problems.push(format!("only {} answers recorded", answers.len()));
    }

    let (stock, available): (i64, i64) = sqlx::query_as(
        "SELECT CAST(stock AS SIGNED), CAST(available AS SIGNED) FROM activities WHERE id = ?",
    )
    .bind(activity_id)
    .fetch_one(&pool)
    .await
    .map_err(|e| e.to_string())?;
    let by_status: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT CAST(status AS CHAR), COUNT(*), CAST(SUM(quantity) AS SIGNED) FROM orders \
         WHERE activity_id = ? GROUP BY status",
    )
    .bind(activity_id)
    .fetch_all(&pool)
    .await
    .map_err(|e| e.to_string())?;
    let mut live_units = 0;
    for (status, count, units) in &by_status {
        match status.as_str() {
            "pending_payment" => {
                live_units += units;
                row.live_orders += count;
            }
            "paid" => {
                live_units += units;
                row.live_orders += count;
                row.paid += count;
            }
            "cancelled" => row.cancelled += count,
            "failed" => row.failed_refunded += count,
            _ => {}
        }
    }
    let client = redis::Client::open(redis_url).map_err(|e| e.to_string())?;
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| e.to_string())?;
    let keys = flashsale::stock::Keys::new(activity_id);
    let redis_stock: Option<i64> = redis::cmd("GET")
        .arg(&keys.stock)
        .query_async(&mut conn)
        .await
        .map_err(|e| e.to_string())?;
    let redis_stock = redis_stock.ok_or("Redis does not hold the activity")?;

    // 1. No oversell.
    if live_units > stock {
        problems.push(format!("oversell: {live_units} live units for {stock}"));
    }
    if redis_stock < 0 || available < 0 {
        problems.push(format!(
            "negative stock: redis {redis_stock}, mysql {available}"
        ));
    }
    // 2. One per user.
    let doubles: Vec<(String, i64)> = sqlx::query_as(
        "SELECT user_id, COUNT(*) FROM orders WHERE activity_id = ? GROUP BY user_id HAVING COUNT(*) > 1",
    )
    .bind(activity_id)
    .fetch_all(&pool)
    .await
    .map_err(|e| e.to_string())?;
    if !doubles.is_empty() {
        problems.push(format!("users with two orders: {doubles:?}"));
    }
    // 3. Nothing lost: every 202 is an order or a failed reservation whose units
    //    came back.
    let rows: Vec<(String, String, bool)> = sqlx::query_as(
        "SELECT reservation_id, CAST(status AS CHAR), units_returned FROM orders WHERE activity_id = ?",
    )
    .bind(activity_id)
    .fetch_all(&pool)
    .await
    .map_err(|e| e.to_string())?;
    let fate: std::collections::HashMap<String, (String, bool)> =
        rows.into_iter().map(|(r, s, u)| (r, (s, u))).collect();
    let mut lost = 0;
    for a in answers.iter().filter(|a| a.status == Some(202)) {
        match a.reservation_id.as_ref().and_then(|r| fate.get(r)) {
            Some((s, _)) if s != "failed" => {}
            Some((_, true)) => {}
            Some((_, false)) => {
                problems.push("a failed reservation's units were not returned".into())
            }
            None => lost += 1,
        }
    }
    if lost > 0 {
        problems.push(format!("{lost} accepted reservations are in no order"));
    }
    // 4. Stock conserved (nothing is pending once quiet).
    if redis_stock + live_units != stock {
        problems.push(format!(
            "not conserved: redis {redis_stock} + live {live_units} != stock {stock}"
        ));
    }
    if available + live_units != stock {
        problems.push(format!(
            "mysql not conserved: available {available} + live {live_units} != stock {stock}"
        ));
    }
    pool.close().await;
    if problems.is_empty() {
        Ok(row)
    } else {
        Err(format!(
            "{}\nanswers: {codes:?}\norders: {by_status:?}",
            problems.join("\n")
        ))
    }
}

async fn drop_database(mysql_url: &str) {
    let _ = <sqlx::MySql as sqlx::migrate::MigrateDatabase>::drop_database(mysql_url).await;
}
