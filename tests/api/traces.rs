//! OpenTelemetry traces across Kafka: one trace holds a reservation from its
//! HTTP request, through the Redis script and the publish, to the consumer's
//! MySQL write of its order; with traces off nothing is exported and messages
//! carry no trace context.
//!
//! The traced service runs as its own `flashsale serve` process: the tracing
//! subscriber (and so the exporter) is one per process, and the API tests
//! share one. The in-process app of each test sets the sale up and, with
//! traces off, publishes a message without trace headers.

use std::collections::HashMap;

use rdkafka::message::Headers;
use rdkafka::Message;
use reqwest::StatusCode;
use serde_json::Value;
use testkit::otlp::{ExportedSpan, OtlpReceiver};
use testkit::process::Service;

use crate::helpers::{each_message_blocking, eventually, spawn_app, Caller, TestApp, WAIT};

/// OTLP's span kinds.
const SERVER: i64 = 2;
const CLIENT: i64 = 3;
const PRODUCER: i64 = 4;
const CONSUMER: i64 = 5;

/// A `flashsale serve` on `app`'s database, Redis and topic, running the order
/// consumer, with JSON logs that show the request span's events.
fn serve(app: &TestApp, dir: &std::path::Path, vars: &[(&str, String)]) -> Service {
    let mut env = app.binary_env();
    env.set("FLASHSALE__LOG__FORMAT", "json");
    env.set("FLASHSALE__LOG__FILTER", "info,tower_http=debug");
    env.set("FLASHSALE__CONSUMER__ENABLED", "true");
    env.set("FLASHSALE__CONSUMER__BATCH_WAIT_MS", "10");
    for (k, v) in vars {
        env.set(k, v);
    }
    tokio::task::block_in_place(|| Service::start("serve", &env, dir))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_holds_a_reservation_from_its_request_to_its_order() {
    let receiver = OtlpReceiver::start().await;
    let app = spawn_app().await;
    let sale = app.open_sale(10, 1).await;
    let dir = tempfile::tempdir().expect("a temporary folder");
    let service = serve(
        &app,
        dir.path(),
        &[
            ("FLASHSALE__TELEMETRY__OTLP_ENDPOINT", receiver.endpoint()),
            ("FLASHSALE__TELEMETRY__EXPORT_DELAY_MS", "100".into()),
        ],
    );
    let traced = app.api.on(service.base());
    let resp = app
        .send(traced.reserve(&sale.sku, Caller::User("traced-buyer")))
        .await;
    assert_eq!(resp.status(), StatusCode::ACCEPTED);
    let body: Value = resp.json().await.expect("JSON");
    let reservation_id = body["reservation_id"].as_str().expect("an id").to_owned();
    // Published by an instance with traces off: no trace headers, as a message
    // from before traces existed. The traced consumer writes it all the same.
    let untraced = app.reserve_accepted(&sale.sku, "untraced-buyer").await;
    let untraced_id = untraced["reservation_id"].as_str().expect("an id");
    app.wait_for_status(&sale.id, "pending_payment", 2).await;

    // The order's write, and every span of its trace up to the request.
    let trace = eventually(WAIT, "the reservation's whole trace", || async {
        let write = written(&receiver, &reservation_id)?;
        let trace = receiver.trace(&write.trace_id);
        let names: Vec<&str> = trace.iter().map(|s| s.name.as_str()).collect();
        [
            "POST /flash/{sku}/reserve",
            "reserve",
            "redis.reserve",
            "kafka.publish",
            "redis.fate",
        ]
        .iter()
        .all(|n| names.contains(n))
        .then_some(trace)
    })
    .await;
    let by_id: HashMap<&str, &ExportedSpan> =
        trace.iter().map(|s| (s.span_id.as_str(), s)).collect();
    let parent = |s: &ExportedSpan| -> &ExportedSpan {
        by_id
            .get(s.parent_span_id.as_str())
            .unwrap_or_else(|| panic!("{}'s parent is not in the trace: {trace:#?}", s.name))
    };
    let named = |name: &str| -> &ExportedSpan {
        trace
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no {name} span in {trace:#?}"))
    };

    // order.write ← kafka.publish ← reserve ← the request, the trace's root.
    let write = written(&receiver, &reservation_id).expect("seen above");
    assert_eq!(write.kind, CONSUMER);
    assert_eq!(write.attribute("decision").as_deref(), Some("Ordered"));
    assert_eq!(write.attribute("db.system.name").as_deref(), Some("mysql"));
    let publish = parent(&write);
    assert_eq!(publish.name, "kafka.publish");
    assert_eq!(publish.kind, PRODUCER);
    assert_eq!(
        publish.attribute("reservation_id").as_deref(),
        Some(reservation_id.as_str())
    );
    assert_eq!(
        publish.attribute("messaging.destination.name").as_deref(),
        Some(app.settings.kafka.topic.as_str())
    );
    let reserve = parent(publish);
    assert_eq!(reserve.name, "reserve");
    assert_eq!(reserve.attribute("outcome").as_deref(), Some("reserved"));
    let request = parent(reserve);
    assert_eq!(request.name, "POST /flash/{sku}/reserve");
    assert_eq!(request.kind, SERVER);
    assert!(request.parent_span_id.is_empty(), "the request is the root");
    assert_eq!(
        request.attribute("http.response.status_code").as_deref(),
        Some("202")
    );
    assert_eq!(
        request.attribute("user_id").as_deref(),
        Some("traced-buyer")
    );
    for script in ["redis.reserve", "redis.fate"] {
        let span = named(script);
        assert_eq!(span.kind, CLIENT, "{script}");
        assert_eq!(parent(span).span_id, reserve.span_id, "{script}");
    }
    assert!(trace.iter().all(|s| s.service == "flashsale"), "{trace:#?}");

    // The batch: a trace of its own, linked to the publish; its MySQL step
    // under it; the write linked back to it.
    let batch = eventually(WAIT, "the consumer's batch span", || async {
        receiver.spans().into_iter().find(|s| {
            s.name == "consumer.batch"
                && s.links
                    .contains(&(publish.trace_id.clone(), publish.span_id.clone()))
        })
    })
    .await;
    assert_eq!(batch.kind, CONSUMER);
    assert!(batch.parent_span_id.is_empty(), "a batch is a root");
    assert!(
        write
            .links
            .contains(&(batch.trace_id.clone(), batch.span_id.clone())),
        "{write:#?} links to {batch:#?}"
    );
    eventually(WAIT, "the batch's MySQL step", || async {
        receiver
            .trace(&batch.trace_id)
            .into_iter()
            .find(|s| s.name == "mysql.apply" && s.parent_span_id == batch.span_id)
    })
    .await;

    // The message without trace headers: its write is in its batch's trace.
    let orphan = eventually(WAIT, "the untraced message's write", || async {
        written(&receiver, untraced_id)
    })
    .await;
    assert_eq!(orphan.attribute("decision").as_deref(), Some("Ordered"));
    let orphan_batch = eventually(WAIT, "the untraced message's batch", || async {
        receiver
            .trace(&orphan.trace_id)
            .into_iter()
            .find(|s| s.span_id == orphan.parent_span_id)
    })
    .await;
    assert_eq!(orphan_batch.name, "consumer.batch");
    assert_ne!(orphan.trace_id, write.trace_id);

    // The logs name the trace: the request's log lines carry its trace id.
    let log = std::fs::read_to_string(dir.path().join("serve.log")).expect("the service's log");
    let request_lines: Vec<Value> = log
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|l| l["span"]["user_id"] == "traced-buyer")
        .collect();
    assert!(
        !request_lines.is_empty(),
        "no log line of the request:\n{log}"
    );
    for line in &request_lines {
        assert_eq!(line["span"]["trace_id"], write.trace_id.as_str(), "{line}");
    }
    let headers = message_headers(&app.settings.kafka.topic).await;
    assert_eq!(headers.len(), 2, "{headers:?}");
    let traceparents: Vec<&str> = headers
        .iter()
        .filter_map(|h| h.get("traceparent").map(String::as_str))
        .collect();
    assert_eq!(
        traceparents,
        vec![format!("00-{}-{}-01", publish.trace_id, publish.span_id).as_str()],
        "the traced publish carries its context, the untraced one none"
    );
    drop(service);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_traces_off_nothing_is_exported_and_messages_carry_no_trace_context() {
    let receiver = OtlpReceiver::start().await;
    let app = spawn_app().await;
    let sale = app.open_sale(10, 1).await;
    let dir = tempfile::tempdir().expect("a temporary folder");
    // An endpoint is there, and the standard switch turns traces off.
    let mut service = serve(
        &app,
        dir.path(),
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint()),
            ("OTEL_SDK_DISABLED", "true".into()),
            ("FLASHSALE__TELEMETRY__EXPORT_DELAY_MS", "100".into()),
        ],
    );
    let resp = app
        .send(
            app.api
                .on(service.base())
                .reserve(&sale.sku, Caller::User("buyer")),
        )
        .await;
    assert_eq!(resp.status(), StatusCode::ACCEPTED);
    app.wait_for_status(&sale.id, "pending_payment", 1).await;
    // A graceful stop sends whatever spans are waiting: none may be.
    tokio::task::block_in_place(|| service.stop());
    assert_eq!(receiver.requests(), 0, "traces were exported while off");
    let log = std::fs::read_to_string(dir.path().join("serve.log")).expect("the service's log");
    let lines: Vec<Value> = log
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .collect();
    assert!(
        lines.iter().any(|l| l["span"]["user_id"] == "buyer"),
        "no log line of the request:\n{log}"
    );
    assert!(
        lines.iter().all(|l| l["span"].get("trace_id").is_none()),
        "a trace id in the logs while traces are off:\n{log}"
    );
    let headers = message_headers(&app.settings.kafka.topic).await;
    assert_eq!(headers, vec![HashMap::new()], "no header at all");
}

/// The `order.write` span of a reservation, once exported.
fn written(receiver: &OtlpReceiver, reservation_id: &str) -> Option<ExportedSpan> {
    receiver.spans().into_iter().find(|s| {
        s.name == "order.write" && s.attribute("reservation_id").as_deref() == Some(reservation_id)
    })
}

/// The headers of every message on the topic, as text.
async fn message_headers(topic: &str) -> Vec<HashMap<String, String>> {
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        each_message_blocking(&topic, |m| {
            m.headers()
                .map(|h| {
                    h.iter()
                        .map(|h| {
                            let value = h.value.map(String::from_utf8_lossy);
                            (h.key.to_owned(), value.unwrap_or_default().into_owned())
                        })
                        .collect()
                })
                .unwrap_or_default()
        })
    })
    .await
    .expect("reader task")
}
