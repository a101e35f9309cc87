//! Health, readiness, metrics, request ids.

use reqwest::StatusCode;
use serde_json::Value;

use crate::helpers::spawn_app;

#[tokio::test]
async fn health_readiness_and_metrics() {
    let app = spawn_app().await;
    let resp = app
        .client
        .get(app.url("/healthz"))
        .send()
        .await
        .expect("sent");
    assert_eq!(resp.status(), StatusCode::OK);

    let resp = app
        .client
        .get(app.url("/readyz"))
        .send()
        .await
        .expect("sent");
    assert_eq!(resp.status(), StatusCode::OK);
    let body: Value = resp.json().await.expect("json");
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

    let resp = app
        .client
        .get(app.url("/metrics"))
        .send()
        .await
        .expect("sent");
    assert_eq!(resp.status(), StatusCode::OK);
    let text = resp.text().await.expect("text");
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
    // Every sample is a flashsale_ metric.
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        assert!(line.starts_with("flashsale_"), "unprefixed: {line}");
    }
    assert!(
        text.contains(&format!(
            "flashsale_activity_units_left{{activity_id=\"{}\"}}",
            sale.id
        )),
        "{text}"
    );
    promtool_accepts(&text);
    // Every metric the alert rules and the dashboard use is one the service has.
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

#[tokio::test]
async fn every_answer_carries_a_request_id() {
    let app = spawn_app().await;
    let resp = app
        .client
        .get(app.url("/flash/none"))
        .send()
        .await
        .expect("sent");
    let id = resp.headers().get("x-request-id").expect("generated id");
    assert!(!id.is_empty());
    let resp = app
        .client
        .get(app.url("/healthz"))
        .header("x-request-id", "abc-123")
        .send()
        .await
        .expect("sent");
    assert_eq!(
        resp.headers().get("x-request-id").expect("propagated"),
        "abc-123"
    );
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
    let app = crate::helpers::spawn_app().await;
    let s = &app.settings;
    let dir = tempfile::tempdir().expect("a temporary folder");
    let port = testkit::process::free_port();
    let mut env = testkit::process::Env::new(
        env!("CARGO_BIN_EXE_flashsale"),
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config"),
    );
    env.set(
        "FLASHSALE__MYSQL__URL",
        secrecy::ExposeSecret::expose_secret(&s.mysql.url),
    );
    env.set("FLASHSALE__REDIS__URL", &s.redis.url);
    env.set("FLASHSALE__KAFKA__BROKERS", &s.kafka.brokers);
    env.set("FLASHSALE__KAFKA__TOPIC", &s.kafka.topic);
    env.set(
        "FLASHSALE__KAFKA__DEAD_LETTER_TOPIC",
        &s.kafka.dead_letter_topic,
    );
    env.set("FLASHSALE__KAFKA__GROUP_ID", &s.kafka.group_id);
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
        testkit::process::wait_for_port(port, std::time::Duration::from_secs(60), "consume")
    });
    let base = format!("http://127.0.0.1:{port}");
    let health = app
        .client
        .get(format!("{base}/healthz"))
        .send()
        .await
        .expect("sent");
    assert_eq!(health.status(), StatusCode::OK);
    let text = app
        .client
        .get(format!("{base}/metrics"))
        .send()
        .await
        .expect("sent")
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
    let app = crate::helpers::spawn_app_with(|s| {
        s.server.drain_delay_secs = 2;
        s.server.shutdown_grace_secs = 3;
    })
    .await;
    let sale = app.open_sale(5, 1).await;
    app.state.draining.cancel();
    let resp = app
        .client
        .get(app.url("/readyz"))
        .send()
        .await
        .expect("sent");
    let body =
        crate::helpers::assert_error(resp, StatusCode::SERVICE_UNAVAILABLE, "unavailable").await;
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
    let healthz = app.url("/healthz");
    let client = app.client.clone();
    let stopped = tokio::time::timeout(std::time::Duration::from_secs(30), app.server)
        .await
        .expect("the server stops within the delay and the grace period")
        .expect("server task joins");
    stopped.expect("server stops cleanly");
    assert!(
        client.get(healthz).send().await.is_err(),
        "no longer listening"
    );
}

/// `?role=api` needs Redis and the broker; MySQL down is reported, not fatal.
#[tokio::test]
async fn an_api_instance_is_ready_without_mysql() {
    let relay = crate::helpers::Relay::start("127.0.0.1:3306").await;
    let port = relay.port;
    let app = crate::helpers::spawn_app_with(|s| {
        let url = secrecy::ExposeSecret::expose_secret(&s.mysql.url)
            .replace(":3306/", &format!(":{port}/"));
        s.mysql.url = secrecy::SecretString::from(url);
        s.mysql.acquire_timeout_ms = 500;
    })
    .await;
    let ready = |path: &'static str| {
        let (client, url) = (app.client.clone(), app.url(path));
        async move { client.get(url).send().await.expect("sent") }
    };
    assert_eq!(ready("/readyz?role=api").await.status(), StatusCode::OK);
    relay.down();
    let resp = ready("/readyz").await;
    let body =
        crate::helpers::assert_error(resp, StatusCode::SERVICE_UNAVAILABLE, "unavailable").await;
    assert_eq!(body["checks"]["mysql"], "down", "{body}");
    let resp = ready("/readyz?role=api").await;
    assert_eq!(resp.status(), StatusCode::OK);
    let body: serde_json::Value = resp.json().await.expect("JSON");
    assert_eq!(body["checks"]["mysql"], "down", "reported: {body}");
    assert_eq!(body["checks"]["redis"], "ok", "{body}");
    let resp = ready("/readyz?role=nonsense").await;
    crate::helpers::assert_error(resp, StatusCode::UNPROCESSABLE_ENTITY, "invalid_request").await;
    relay.up();
}
