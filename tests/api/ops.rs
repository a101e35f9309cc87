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
    assert!(text.contains("http_requests_total"), "{text}");
    assert!(text.contains("route=\"/flash/{sku}/reserve\""), "{text}");
    assert!(
        text.contains("http_request_duration_seconds_bucket"),
        "{text}"
    );
    assert!(
        text.contains("reservations_total{outcome=\"reserved\"}"),
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
