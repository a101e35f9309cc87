//! An OpenTelemetry collector's front door for tests: an OTLP/HTTP receiver on
//! a free loopback port that accepts `POST /v1/traces` with JSON bodies (what
//! the service exports) and keeps every span it was sent, flattened, for a test
//! to look at. It counts every request, so a test can also show that nothing
//! was sent.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::routing::post;
use axum::Router;
use serde_json::Value;

/// One exported span, as the receiver got it.
#[derive(Debug, Clone, PartialEq)]
pub struct ExportedSpan {
    /// 32 hex digits.
    pub trace_id: String,
    /// 16 hex digits.
    pub span_id: String,
    /// Empty for a root span.
    pub parent_span_id: String,
    pub name: String,
    /// OTLP's `SpanKind`: 1 internal, 2 server, 3 client, 4 producer, 5 consumer.
    pub kind: i64,
    /// Attribute values unwrapped from OTLP's `AnyValue` (strings stay strings;
    /// integers may come as strings, as OTLP's JSON encodes them).
    pub attributes: HashMap<String, Value>,
    /// `(trace_id, span_id)` of each linked span.
    pub links: Vec<(String, String)>,
    /// The resource's `service.name`.
    pub service: String,
}

impl ExportedSpan {
    /// An attribute as text (a string, or a number written out).
    pub fn attribute(&self, key: &str) -> Option<String> {
        self.attributes.get(key).map(|v| match v {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        })
    }
}

#[derive(Default)]
struct Received {
    requests: usize,
    spans: Vec<ExportedSpan>,
    /// Bodies that were not OTLP JSON: a test failure names them.
    refused: Vec<String>,
}

/// The receiver; it stops when dropped.
pub struct OtlpReceiver {
    port: u16,
    received: Arc<Mutex<Received>>,
    server: tokio::task::JoinHandle<()>,
}

impl OtlpReceiver {
    /// Listens on a free port of 127.0.0.1.
    pub async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a free port for the OTLP receiver");
        let port = listener.local_addr().expect("a local address").port();
        let received = Arc::new(Mutex::new(Received::default()));
        let app = Router::new()
            .route("/v1/traces", post(receive))
            .with_state(received.clone());
        let server = tokio::spawn(async move {
            // Ends when the test drops the receiver (the task is aborted).
            let _ = axum::serve(listener, app).await;
        });
        OtlpReceiver {
            port,
            received,
            server,
        }
    }

    /// The base URL a service is configured with (`telemetry.otlp_endpoint`,
    /// `OTEL_EXPORTER_OTLP_ENDPOINT`); spans come to `<it>/v1/traces`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Export requests received so far, whatever they held.
    pub fn requests(&self) -> usize {
        self.lock().requests
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ExportedSpan> {
        let received = self.lock();
        assert!(
            received.refused.is_empty(),
            "the receiver got bodies that are not OTLP JSON: {:?}",
            received.refused
        );
        received.spans.clone()
    }

    /// The spans of one trace.
    pub fn trace(&self, trace_id: &str) -> Vec<ExportedSpan> {
        self.spans()
            .into_iter()
            .filter(|s| s.trace_id == trace_id)
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Received> {
        // A poisoned lock only means a handler panicked; what it holds is whole.
        self.received.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.server.abort();
    }
}

async fn receive(
    State(received): State<Arc<Mutex<Received>>>,
    headers: HeaderMap,
    body: Bytes,
) -> (
    StatusCode,
    [(header::HeaderName, &'static str); 1],
    &'static str,
) {
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    let parsed = serde_json::from_slice::<Value>(&body)
        .ok()
        .filter(|_| json)
        .and_then(|v| flatten(&v));
    let mut received = received.lock().unwrap_or_else(|p| p.into_inner());
    received.requests += 1;
    let content_type = [(header::CONTENT_TYPE, "application/json")];
    match parsed {
        Some(spans) => {
            received.spans.extend(spans);
            // An empty ExportTraceServiceResponse: everything accepted.
            (StatusCode::OK, content_type, "{}")
        }
        None => {
            received
                .refused
                .push(String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned());
            (StatusCode::BAD_REQUEST, content_type, "{}")
        }
    }
}

/// An `ExportTraceServiceRequest` in OTLP's JSON encoding, as flat spans.
fn flatten(request: &Value) -> Option<Vec<ExportedSpan>> {
    let mut out = Vec::new();
    for resource_spans in request.get("resourceSpans")?.as_array()? {
        let service = resource_spans
            .pointer("/resource/attributes")
            .map(attributes)
            .unwrap_or_default()
            .remove("service.name")
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        let scopes = resource_spans.get("scopeSpans").and_then(Value::as_array);
        for scope in scopes.into_iter().flatten() {
            let spans = scope.get("spans").and_then(Value::as_array);
            for span in spans.into_iter().flatten() {
                let text = |key: &str| {
                    span.get(key)
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_owned()
                };
                let links = span
                    .get("links")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .map(|l| {
                        let id = |k: &str| l.get(k).and_then(Value::as_str).unwrap_or_default();
                        (id("traceId").to_owned(), id("spanId").to_owned())
                    })
                    .collect();
                out.push(ExportedSpan {
                    trace_id: text("traceId"),
                    span_id: text("spanId"),
                    parent_span_id: text("parentSpanId"),
                    name: text("name"),
                    kind: span.get("kind").and_then(Value::as_i64).unwrap_or(0),
                    attributes: span.get("attributes").map(attributes).unwrap_or_default(),
                    links,
                    service: service.clone(),
                });
            }
        }
    }
    Some(out)
}

/// OTLP's `[{"key": …, "value": {"stringValue": …}}]` as a map of plain values.
fn attributes(list: &Value) -> HashMap<String, Value> {
    list.as_array()
        .into_iter()
        .flatten()
        .filter_map(|kv| {
            let key = kv.get("key")?.as_str()?.to_owned();
            Some((key, any_value(kv.get("value")?)))
        })
        .collect()
}

/// The value inside an `AnyValue` (`{"stringValue": "x"}`, `{"intValue": "5"}`,
/// possibly wrapped once more in `{"value": …}`).
fn any_value(v: &Value) -> Value {
    match v {
        Value::Object(map) if map.len() == 1 => {
            let (key, inner) = map
                .iter()
                .next()
                .map(|(k, v)| (k.as_str(), v))
                .unwrap_or(("", v));
            match key {
                "value" => any_value(inner),
                _ => inner.clone(),
            }
        }
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flattens_an_export_request() {
        let body = serde_json::json!({
            "resourceSpans": [{
                "resource": {"attributes": [
                    {"key": "service.name", "value": {"stringValue": "flashsale"}}
                ]},
                "scopeSpans": [{"spans": [{
                    "traceId": "4bf92f3577b34da6a3ce929d0e0e4736",
                    "spanId": "00f067aa0ba902b7",
                    "parentSpanId": "",
                    "name": "order.write",
                    "kind": 5,
                    "attributes": [
                        {"key": "reservation_id", "value": {"stringValue": "r1"}},
                        {"key": "messaging.kafka.offset", "value": {"intValue": "7"}}
                    ],
                    "links": [{"traceId": "aa", "spanId": "bb"}]
                }]}]
            }]
        });
        let spans = flatten(&body).expect("an export request");
        assert_eq!(spans.len(), 1);
        let s = &spans[0];
        assert_eq!(s.service, "flashsale");
        assert_eq!(s.name, "order.write");
        assert_eq!(s.kind, 5);
        assert_eq!(s.attribute("reservation_id").as_deref(), Some("r1"));
        assert_eq!(s.attribute("messaging.kafka.offset").as_deref(), Some("7"));
        assert_eq!(s.links, vec![("aa".to_owned(), "bb".to_owned())]);
        assert!(flatten(&serde_json::json!({"other": 1})).is_none());
    }
}
