//! Health, readiness, metrics, request ids.

use std::time::Duration;

use reqwest::StatusCode;

use crate::helpers::{assert_error, eventually, spawn_app, Caller, Relay, TestApp, WAIT};

#[tokio::test]
async fn health_readiness_and_metrics() {
    let app = spawn_app().await;
    let resp = app.healthz().await;
    assert_eq!(resp.status(), StatusCode::OK);

    let body = app.wait_ready().await;
    for dep in ["redis", "mysql", "kafka"] {
        assert_eq!(body["checks"][dep], "ok", "{dep} in {body}");
    }

    let sale = app.open_sale(2, 1).await;
    assert_eq!(
        app.reserve(&sale.sku, "kim", None).await.status(),
        StatusCode::ACCEPTED
    );
    assert_eq!(
        app.reserve(&sale.sku, "kim", None).await.status(),
        StatusCode::CONFLICT
    );

    let resp = app.metrics().await;
    assert_eq!(resp.status(), StatusCode::OK);
    let text = resp.text().await.expect("text");
    every_metric_is_named_and_explained(&text, &sale.id);
    promtool_accepts(&text);
    the_deployment_uses_only_recorded_metrics();
    assert!(text.contains("flashsale_http_requests_total"), "{text}");
    assert!(text.contains("route=\"/flash/{sku}/reserve\""), "{text}");
    assert!(
        text.contains("http_request_duration_seconds_bucket"),
        "{text}"
    );
    assert!(
        text.contains("flashsale_reservations_total{outcome=\"reserved\"}"),
        "{text}"
    );
    assert!(
        text.contains("reservations_total{outcome=\"already_reserved\"}"),
        "{text}"
    );
    assert!(text.contains("kafka_publish_duration_seconds"), "{text}");
    app.stop().await;
}

/// The key metrics have HELP text, every sample is a `flashsale_` metric, and
/// the sale has its units-left gauge.
fn every_metric_is_named_and_explained(text: &str, activity_id: &str) {
    for name in [
        "flashsale_build_info",
        "flashsale_http_requests_total",
        "flashsale_process_resident_memory_bytes",
        "flashsale_activity_units_left",
        "flashsale_activity_reservations_pending",
        "flashsale_activity_oldest_pending_age_seconds",
        "flashsale_redis_up",
    ] {
        assert!(
            text.contains(&format!("# HELP {name} ")),
            "no HELP for {name}:\n{text}"
        );
    }
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        assert!(line.starts_with("flashsale_"), "unprefixed: {line}");
    }
    assert!(
        text.contains(&format!(
            "flashsale_activity_units_left{{activity_id=\"{activity_id}\"}}"
        )),
        "{text}"
    );
}

/// Every metric the alert rules and the dashboard use is one the service has.
fn the_deployment_uses_only_recorded_metrics() {
    for file in [
        "deploy/prometheus/alerts.yml",
        "deploy/grafana/flashsale.json",
    ] {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
        let deployed = std::fs::read_to_string(&path).expect("deployment file");
        let known: Vec<&str> = flashsale::telemetry::metric_names().collect();
        for name in metric_names(&deployed) {
            assert!(
                known.contains(&name.as_str()),
                "{file} uses {name}, which the service does not record"
            );
        }
    }
}

#[tokio::test]
async fn every_answer_carries_a_request_id() {
    let app = spawn_app().await;
    let resp = app.sale("none").await;
    let id = resp.headers().get("x-request-id").expect("generated id");
    assert!(!id.is_empty());
    // A client's id is kept beside the request's (the audit trail's
    // `client_request_id`), never taken as it: the answer carries the service's.
    let resp = app
        .send(app.api.healthz().header("x-request-id", "abc-123"))
        .await;
    let id = resp
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .expect("the service's id");
    assert_ne!(id, "abc-123");
    uuid::Uuid::parse_str(id).expect("a UUID the service made");
    app.stop().await;
}

/// `promtool check metrics` (the machine's own, or the one `scripts/tools.sh`
/// unpacks into `.run/tools`) finds nothing to say about the exposition.
fn promtool_accepts(text: &str) {
    use std::io::Write;
    let unpacked =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(".run/tools/usr/bin/promtool");
    let promtool = if unpacked.is_file() {
        unpacked
    } else {
        "promtool".into()
    };
    let mut child = std::process::Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool runs (scripts/tools.sh installs it)");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("metrics written to promtool");
    let out = child.wait_with_output().expect("promtool finishes");
    assert!(
        out.status.success() && out.stdout.is_empty() && out.stderr.is_empty(),
        "promtool check metrics:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `flashsale_…` names in a text, histogram suffixes dropped.
fn metric_names(text: &str) -> std::collections::BTreeSet<String> {
    let mut names = std::collections::BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("flashsale_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c == '_'))
            .unwrap_or(tail.len());
        let name = &tail[..end];
        let name = name
            .strip_suffix("_bucket")
            .or_else(|| name.strip_suffix("_count"))
            .or_else(|| name.strip_suffix("_sum"))
            .unwrap_or(name);
        if name != "flashsale_" && name != "flashsale_live" {
            names.insert(name.to_owned());
        }
        rest = &tail[end..];
    }
    names
}

/// `flashsale consume` serves `/healthz` and `/metrics` on `consumer.metrics_addr`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_consumer_serves_metrics_and_health() {
    let app = spawn_app().await;
    let dir = tempfile::tempdir().expect("a temporary folder");
    let port = testkit::process::free_port();
    let mut env = app.binary_env();
    // Set after the kit's own default (port 0), so this one wins.
    env.set(
        "FLASHSALE__CONSUMER__METRICS_ADDR",
        format!("127.0.0.1:{port}"),
    );
    let mut consumer = testkit::process::flashsale(
        &["consume"],
        &env,
        dir.path().join("consume.log"),
        "consumer",
    );
    tokio::task::block_in_place(|| {
        testkit::process::wait_for_port(port, Duration::from_secs(60), "consume")
    });
    let consumer_api = app.api.on(format!("http://127.0.0.1:{port}"));
    let health = app.send(consumer_api.healthz()).await;
    assert_eq!(health.status(), StatusCode::OK);
    let text = app
        .send(consumer_api.metrics())
        .await
        .text()
        .await
        .expect("text");
    assert!(text.contains("# HELP flashsale_build_info "), "{text}");
    assert!(text.contains("flashsale_process_open_fds"), "{text}");
    promtool_accepts(&text);
    consumer.terminate();
}

/// Stopping as an orchestrator expects: not ready at once, still serving for the
/// drain delay, then stopped within the grace period.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_turns_readiness_off_before_the_server_stops() {
    let app = TestApp::builder().drain(2, 3).spawn().await;
    let sale = app.open_sale(5, 1).await;
    app.state.draining.cancel();
    let resp = app.readyz().await;
    let body = assert_error(resp, StatusCode::SERVICE_UNAVAILABLE, "unavailable").await;
    assert!(
        body["message"]
            .as_str()
            .is_some_and(|m| m.contains("draining")),
        "{body}"
    );
    assert_eq!(
        app.reserve(&sale.sku, "during-drain", None).await.status(),
        StatusCode::ACCEPTED,
        "requests are still served while load balancers notice"
    );
    let healthz = app.api.healthz();
    let stopped = tokio::time::timeout(Duration::from_secs(30), app.server)
        .await
        .expect("the server stops within the delay and the grace period")
        .expect("server task joins");
    stopped.expect("server stops cleanly");
    assert!(healthz.send().await.is_err(), "no longer listening");
}

/// `?role=api` needs Redis and the broker; MySQL down is reported, not fatal.
#[tokio::test]
async fn an_api_instance_is_ready_without_mysql() {
    let relay = Relay::start("127.0.0.1:3306").await;
    let app = TestApp::builder()
        .mysql_via(&relay)
        .mysql_acquire_timeout_ms(500)
        .spawn()
        .await;
    let ready = |path: &'static str| app.get(path);
    app.wait_ready().await;
    relay.down();
    // The prober sees it at its next round (every 500 ms).
    let body = eventually(
        Duration::from_secs(3),
        "readiness to report MySQL down",
        || async {
            let resp = ready("/readyz").await;
            let status = resp.status();
            let body: serde_json::Value = resp.json().await.ok()?;
            (status == StatusCode::SERVICE_UNAVAILABLE && body["checks"]["mysql"] == "down")
                .then_some(body)
        },
    )
    .await;
    assert_eq!(body["code"], "unavailable", "{body}");
    assert_eq!(body["checks"]["redis"], "ok", "{body}");
    let resp = ready("/readyz?role=api").await;
    assert_eq!(resp.status(), StatusCode::OK);
    let body: serde_json::Value = resp.json().await.expect("JSON");
    assert_eq!(body["checks"]["mysql"], "down", "reported: {body}");
    assert_eq!(body["checks"]["redis"], "ok", "{body}");
    let resp = ready("/readyz?role=nonsense").await;
    assert_error(resp, StatusCode::UNPROCESSABLE_ENTITY, "invalid_request").await;
    relay.up();
    // And ready again once it answers.
    eventually(
        Duration::from_secs(5),
        "readiness once MySQL is back",
        || async { (ready("/readyz").await.status() == StatusCode::OK).then_some(()) },
    )
    .await;
}

/// `server.ops_addr`: a listener with the probes and metrics only; the main
/// listener keeps serving them too.
#[tokio::test]
async fn the_ops_listener_serves_the_probes_and_nothing_else() {
    let app = TestApp::builder().ops_listener().spawn().await;
    let ops_address = app.ops_address.clone().expect("an ops listener");
    assert_ne!(ops_address, app.address);
    let ops = app.api.on(ops_address);
    assert_eq!(app.send(ops.healthz()).await.status(), StatusCode::OK);
    eventually(
        Duration::from_secs(10),
        "/readyz on the ops listener",
        || async { (app.send(ops.readyz()).await.status() == StatusCode::OK).then_some(()) },
    )
    .await;
    let role = ops.request(reqwest::Method::GET, "/readyz?role=api", Caller::Anonymous);
    assert!(TestApp::is_readiness_answer(app.send(role).await).await);
    let metrics = app.send(ops.metrics()).await;
    assert_eq!(metrics.status(), StatusCode::OK);
    assert!(metrics
        .text()
        .await
        .expect("text")
        .contains("# HELP flashsale_build_info "));
    // Not the API: no admin, user, documentation or page route answers there.
    let sale = app.open_sale(3, 1).await;
    for path in [
        "/admin/activities".to_owned(),
        format!("/flash/{}", sale.sku),
        "/openapi.json".to_owned(),
        "/docs".to_owned(),
        "/admin/ui".to_owned(),
    ] {
        let resp = app
            .send(ops.request(reqwest::Method::GET, &path, Caller::Admin))
            .await;
        assert_error(resp, StatusCode::NOT_FOUND, "not_found").await;
    }
    let resp = app
        .send(ops.reserve(&sale.sku, Caller::User("ops-user")))
        .await;
    assert_error(resp, StatusCode::NOT_FOUND, "not_found").await;
    // The main listener still serves all three, for compatibility.
    assert_eq!(app.healthz().await.status(), StatusCode::OK);
    assert!(TestApp::is_readiness_answer(app.readyz().await).await);
    assert_eq!(app.metrics().await.status(), StatusCode::OK);
    assert_eq!(app.sale(&sale.sku).await.status(), StatusCode::OK);
    app.stop().await;
}

/// `count` requests for `path`, all sent at once; their statuses, with the body
/// of each answer other than `200`.
async fn flood(app: &TestApp, path: &str, count: usize) -> Vec<(StatusCode, Option<String>)> {
    futures::future::join_all((0..count).map(|_| async move {
        let resp = app.get(path).await;
        let status = resp.status();
        let body = if status == StatusCode::OK {
            None
        } else {
            resp.text().await.ok()
        };
        (status, body)
    }))
    .await
}

/// `/readyz` answers from the background probe: 2,000 probes at once send MySQL
/// nothing beyond the prober's own statement every half second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_readiness_probes_costs_the_database_nothing() {
    const PROBES: usize = 2_000;
    let relay = Relay::start("127.0.0.1:3306").await;
    // Nothing else of the app talks to MySQL meanwhile: the activity cache
    // reads once at start (the workers are off in tests).
    let app = TestApp::builder()
        .mysql_via(&relay)
        .cache_refresh_ms(3_600_000)
        .spawn()
        .await;
    app.wait_ready().await;
    let before = relay.bytes_sent();
    let started = std::time::Instant::now();
    let statuses = flood(&app, "/readyz", PROBES).await;
    let elapsed = started.elapsed();
    let sent = relay.bytes_sent() - before;
    // Each MySQL command is at least 5 bytes (a 4-byte header and the command),
    // so a probe that reached MySQL would make the flood send 10,000 bytes or
    // more. The prober sends a ping and one statement every 500 ms; 256 bytes is
    // a generous allowance for each of its rounds.
    let prober_rounds = elapsed.as_millis() as u64 / 500 + 2;
    assert!(
        sent <= 256 * prober_rounds,
        "{PROBES} probes in {elapsed:?} sent MySQL {sent} bytes"
    );
    // Every probe is ready: an answer of the prober delayed on the busy
    // runtime is checked once more (one check for the whole flood, within the
    // allowance above), not reported as not ready.
    for (status, body) in &statuses {
        assert_eq!(*status, StatusCode::OK, "{body:?}");
    }
    // And once the flood is over, it is ready again.
    app.wait_ready().await;
    app.stop().await;
}

/// `/metrics` reads each activity's figures from Redis at most about once a
/// second, however many scrapes arrive: a flood costs Redis next to nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_scrapes_reads_redis_once_a_second_at_most() {
    const SCRAPES: usize = 1_000;
    let relay = Relay::start("127.0.0.1:6379").await;
    let app = TestApp::builder().redis_via(&relay).spawn().await;
    let sale = app.open_sale(10, 1).await;
    let first = app.metrics_text().await;
    assert!(
        first.contains(&format!(
            "flashsale_activity_units_left{{activity_id=\"{}\"}} 10",
            sale.id
        )),
        "{first}"
    );
    let before = relay.bytes_sent();
    let started = std::time::Instant::now();
    let statuses = flood(&app, "/metrics", SCRAPES).await;
    let elapsed = started.elapsed();
    let sent = relay.bytes_sent() - before;
    assert!(
        statuses.iter().all(|(s, _)| *s == StatusCode::OK),
        "{statuses:?}"
    );
    // The smallest Redis command of a figure read is well over 20 bytes; fewer
    // than 20 bytes a scrape means the scrapes shared their reads.
    assert!(
        sent < 20 * SCRAPES as u64,
        "{SCRAPES} scrapes in {elapsed:?} sent Redis {sent} bytes"
    );
    // The figures are still fresh: a unit sold shows within about a second.
    assert_eq!(
        app.reserve(&sale.sku, "scraped", None).await.status(),
        StatusCode::ACCEPTED
    );
    let line = format!(
        "flashsale_activity_units_left{{activity_id=\"{}\"}} 9",
        sale.id
    );
    eventually(
        Duration::from_secs(3),
        "the scrape to show the unit sold",
        || async { app.metrics_text().await.contains(&line).then_some(()) },
    )
    .await;
    app.stop().await;
}

/// The metric names the alert rules' expressions use.
fn alerted_metrics() -> std::collections::BTreeSet<String> {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/prometheus/alerts.yml");
    let rules = std::fs::read_to_string(&path).expect("alerts.yml");
    let exprs: String = rules
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("expr:"))
        .collect::<Vec<_>>()
        .join("\n");
    metric_names(&exprs)
}

/// After a restart, the first scrape already has every metric an alert rule
/// uses: a counter that first appears at 1 is an increase Prometheus never
/// sees, and a gauge that appears late leaves its alert blind until then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_scrape_has_every_metric_the_alerts_use() {
    let alerted = alerted_metrics();
    for name in [
        "flashsale_consumer_lag_messages",
        "flashsale_promises_broken_total",
        "flashsale_activity_drift_units",
    ] {
        assert!(alerted.contains(name), "{name} in {alerted:?}");
    }
    // A sale running when the instance (re)starts.
    let app = spawn_app().await;
    let sale = app.open_sale(10, 1).await;
    let dir = tempfile::tempdir().expect("a temporary folder");
    let env = app.binary_env();
    let service =
        tokio::task::block_in_place(|| testkit::process::Service::start("serve", &env, dir.path()));
    let text = app
        .send(app.api.on(service.base()).metrics())
        .await
        .text()
        .await
        .expect("text");
    let missing: Vec<&String> = alerted
        .iter()
        .filter(|name| {
            !text.lines().any(|l| {
                l.strip_prefix(name.as_str())
                    .is_some_and(|rest| rest.starts_with(['{', ' ']))
            })
        })
        .collect();
    assert!(
        missing.is_empty(),
        "missing from the first scrape: {missing:?}\n{text}"
    );
    assert!(
        text.contains(&format!(
            "flashsale_activity_drift_units{{activity_id=\"{}\"}} 0",
            sale.id
        )),
        "{text}"
    );
    promtool_accepts(&text);
    drop(service);
}

/// The published development secrets are refused off loopback, whatever
/// `FLASHSALE_ENV` says (the kit runs the binary with `test`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_development_secrets_are_refused_on_a_public_address() {
    let app = spawn_app().await;
    let dir = tempfile::tempdir().expect("a temporary folder");
    let mut env = app.binary_env();
    env.set(
        "FLASHSALE__SERVER__ADDR",
        format!("0.0.0.0:{}", testkit::process::free_port()),
    );
    let log = refused_at_start(&env, dir.path()).await;
    assert!(
        log.contains("refusing to start")
            && log.contains("auth.admin_token")
            && log.contains("loopback"),
        "{log}"
    );
}

/// Runs `flashsale serve` with `env`, waits for it to exit unsuccessfully and
/// returns its log's last lines: the refusal, not a backtrace (turned off).
async fn refused_at_start(env: &testkit::process::Env, dir: &std::path::Path) -> String {
    let mut env = env.clone();
    env.set("RUST_BACKTRACE", "0");
    let mut serve = testkit::process::flashsale(&["serve"], &env, dir.join("serve.log"), "serve");
    let exited = eventually(Duration::from_secs(20), "serve to refuse to start", || {
        let exited = serve.try_wait();
        async move { exited }
    })
    .await;
    let log = serve.log_tail(20);
    assert!(!exited, "exited with success:\n{log}");
    log
}

/// In production, orders paid on their owners' word (`payments.provider =
/// "none"`) are refused at start, unless `payments.allow_unverified` says the
/// deployment means it; then the same process serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn production_refuses_unverified_payments_unless_allowed() {
    let app = spawn_app().await;
    let dir = tempfile::tempdir().expect("a temporary folder");
    let mut env = app.binary_env();
    env.set("FLASHSALE_ENV", "production");
    env.set("FLASHSALE__AUTH__ADMIN_TOKEN", "a-production-admin-token-1");
    env.set(
        "FLASHSALE__AUTH__USER_TOKEN_SECRET",
        "a-production-user-secret-1",
    );
    let port = testkit::process::free_port();
    env.set("FLASHSALE__SERVER__ADDR", format!("127.0.0.1:{port}"));
    let log = refused_at_start(&env, dir.path()).await;
    assert!(
        log.contains("refusing to start") && log.contains("FLASHSALE__PAYMENTS__ALLOW_UNVERIFIED"),
        "{log}"
    );
    env.set("FLASHSALE__PAYMENTS__ALLOW_UNVERIFIED", "true");
    let mut allowed =
        testkit::process::flashsale(&["serve"], &env, dir.path().join("allowed.log"), "allowed");
    tokio::task::block_in_place(|| {
        testkit::process::wait_for_port(port, Duration::from_secs(30), "serve in production")
    });
    assert_eq!(allowed.try_wait(), None, "{}", allowed.log_tail(20));
    allowed.terminate();
    app.stop().await;
}

/// `redis.min_replicas_acked = auto`, the default: a `202` waits for the
/// replica while the sale's primary has one online (a replica that stopped
/// answering makes it `503`, nothing held), and, once the primary has none, does
/// not wait and is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_waits_for_the_replica_the_primary_has() {
    let dir = tempfile::tempdir().expect("a temporary folder");
    let primary = tokio::task::block_in_place(|| testkit::process::Redis::start(dir.path()));
    let mut replica = tokio::task::block_in_place(|| {
        testkit::process::Redis::start_replica(dir.path(), primary.port)
    });
    let client = redis::Client::open(primary.url()).expect("redis url");
    let redis = client
        .get_multiplexed_async_connection()
        .await
        .expect("own redis");
    let online = |redis: redis::aio::MultiplexedConnection| async move {
        let mut redis = redis;
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query_async(&mut redis)
            .await
            .ok()?;
        Some(info.contains("state=online"))
    };
    eventually(Duration::from_secs(20), "the replica to sync", || {
        let r = redis.clone();
        async move { online(r).await.filter(|o| *o).map(|_| ()) }
    })
    .await;
    let app = TestApp::builder().redis_url(primary.url()).spawn().await;
    assert_eq!(
        app.settings.redis.min_replicas_acked,
        flashsale::config::ReplicasAcked::Auto
    );
    let sale = app.open_sale(10, 1).await;
    // A replica just synchronised acknowledges its first writes about a second
    // later: until then a reservation is refused (`503`, nothing held).
    eventually(Duration::from_secs(20), "a first reservation", || async {
        (app.reserve(&sale.sku, "warm", None).await.status() == StatusCode::ACCEPTED).then_some(())
    })
    .await;
    // Online and answering: the reservation waits for it (the barrier's key is
    // bumped by each wait, before the publish and before the answer).
    let barrier = flashsale::stock::Keys::new(&sale.id).barrier;
    let bumps = |redis: redis::aio::MultiplexedConnection, key: String| async move {
        let mut redis = redis;
        let n: i64 = redis::cmd("GET")
            .arg(&key)
            .query_async(&mut redis)
            .await
            .expect("barrier read");
        n
    };
    let before_ann = bumps(redis.clone(), barrier.clone()).await;
    assert_eq!(
        app.reserve(&sale.sku, "ann", None).await.status(),
        StatusCode::ACCEPTED
    );
    assert_eq!(
        bumps(redis.clone(), barrier.clone()).await,
        before_ann + 2,
        "two waits for the replica"
    );
    // Online but not answering: refused, and nothing is held.
    replica.pause();
    let refused = app.reserve(&sale.sku, "bob", None).await;
    assert_error(refused, StatusCode::SERVICE_UNAVAILABLE, "unavailable").await;
    replica.resume();
    // No replica: answered at once, not waited for, and counted.
    let before = counter(
        &app.metrics_text().await,
        "flashsale_redis_unreplicated_reservations_total",
    );
    replica.kill();
    eventually(
        Duration::from_secs(20),
        "the primary to see its replica gone",
        || {
            let r = redis.clone();
            async move { online(r).await.filter(|o| !*o).map(|_| ()) }
        },
    )
    .await;
    // The first reservation after the loss waits once (the replica was online
    // at the last look), finds it gone, and is answered; the next do not wait.
    let before_loss = bumps(redis.clone(), barrier.clone()).await;
    assert_eq!(
        app.reserve(&sale.sku, "bob", None).await.status(),
        StatusCode::ACCEPTED
    );
    let after_loss = bumps(redis.clone(), barrier.clone()).await;
    assert!(
        after_loss <= before_loss + 1,
        "{before_loss} then {after_loss}"
    );
    for user in ["cy", "dee"] {
        assert_eq!(
            app.reserve(&sale.sku, user, None).await.status(),
            StatusCode::ACCEPTED,
            "{user}"
        );
    }
    assert_eq!(
        bumps(redis.clone(), barrier.clone()).await,
        after_loss,
        "nothing waited"
    );
    let after = counter(
        &app.metrics_text().await,
        "flashsale_redis_unreplicated_reservations_total",
    );
    assert!(after >= before + 3.0, "counted: {before} then {after}");
    let state = app.sale_state(&sale.sku).await;
    assert_eq!(state["stock_left"], 5, "{state}");
    app.stop().await;
}

/// A Redis whose `maxmemory-policy` can evict a sale's keys is reported by
/// `/readyz` (and logged as an error at start).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicting_redis_is_reported_by_readiness() {
    let dir = tempfile::tempdir().expect("a temporary folder");
    let own = tokio::task::block_in_place(|| testkit::process::Redis::start(dir.path()));
    let client = redis::Client::open(own.url()).expect("redis url");
    let mut redis = client
        .get_multiplexed_async_connection()
        .await
        .expect("own redis");
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("allkeys-lru")
        .query_async(&mut redis)
        .await
        .expect("policy set");
    let app = TestApp::builder().redis_url(own.url()).spawn().await;
    let body = app.wait_ready().await;
    let warnings = body["warnings"].to_string();
    assert!(warnings.contains("allkeys-lru"), "{body}");
    // The shared Redis evicts nothing: no warning.
    let plain = spawn_app().await;
    let body = plain.wait_ready().await;
    assert!(body.get("warnings").is_none(), "{body}");
    plain.stop().await;
    app.stop().await;
}

/// A counter's value in a scrape, 0 when it has none yet.
fn counter(text: &str, name: &str) -> f64 {
    text.lines()
        .filter_map(|l| l.strip_prefix(name))
        .filter_map(|rest| rest.trim().parse::<f64>().ok())
        .sum()
}

/// The operations listener serves a bounded number of requests at once
/// (`OPS_MAX_IN_FLIGHT`): with Redis silent, scrapes of `/metrics` wait on its
/// figures, and a flood of them beyond the bound is answered `503` at once
/// instead of piling up behind the first; `/healthz` answers all the while.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flood_at_the_ops_listener_is_shed_beyond_its_bound() {
    const SCRAPES: usize = 3 * flashsale::http::OPS_MAX_IN_FLIGHT;
    let relay = Relay::start("127.0.0.1:6379").await;
    let app = TestApp::builder()
        .ops_listener()
        .redis_via(&relay)
        .redis_response_timeout_ms(10_000)
        .spawn()
        .await;
    let ops = app
        .api
        .on(app.ops_address.clone().expect("an ops listener"));
    let _sale = app.open_sale(5, 1).await;
    // No scrape yet: the first one reads the sale's figures from Redis.
    relay.hold();
    let refused = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let flood = futures::future::join_all((0..SCRAPES).map(|_| {
        let request = ops.metrics();
        let refused = refused.clone();
        async move {
            let resp = request.send().await.expect("an answer");
            let status = resp.status();
            if status == StatusCode::SERVICE_UNAVAILABLE {
                refused.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
            let body: Option<serde_json::Value> = resp.json().await.ok();
            (status, body)
        }
    }));
    // While the bound is full (some scrapes already shed, the first ones still
    // waiting on Redis), liveness still answers: it is outside the bound.
    let alive = async {
        eventually(WAIT, "a scrape shed", || async {
            (refused.load(std::sync::atomic::Ordering::SeqCst) > 0).then_some(())
        })
        .await;
        app.send(ops.healthz()).await.status()
    };
    let (answers, alive) = tokio::join!(flood, alive);
    relay.release();
    assert_eq!(alive, StatusCode::OK, "liveness while the bound is full");
    let shed = answers
        .iter()
        .filter(|(status, body)| {
            *status == StatusCode::SERVICE_UNAVAILABLE
                && body.as_ref().is_some_and(|b| b["code"] == "unavailable")
        })
        .count();
    let served = answers
        .iter()
        .filter(|(status, _)| *status == StatusCode::OK)
        .count();
    assert_eq!(shed + served, SCRAPES, "{answers:?}");
    assert!(
        shed >= SCRAPES - flashsale::http::OPS_MAX_IN_FLIGHT,
        "{shed} of {SCRAPES} scrapes shed"
    );
    app.stop().await;
}
