//! A reservation's trace across Kafka: the W3C trace context (`traceparent`,
//! `tracestate`) of the publish travels in its message's headers, and the
//! consumer continues that trace when it writes the order.
//!
//! Only while traces are on (`crate::telemetry::traces_enabled`): otherwise a
//! message carries no header, as before traces existed, and the consumer reads
//! none. A message without them (published with traces off, or by an older
//! build) is written all the same, in a trace of its batch's.

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry::Context;
use rdkafka::message::{Header, Headers, OwnedHeaders};

use crate::telemetry;

/// The headers carrying the current trace context (the publish span's), or
/// `None` while traces are off or no span is recorded here.
pub fn current_headers() -> Option<OwnedHeaders> {
    if !telemetry::traces_enabled() {
        return None;
    }
    let mut fields = Fields(Vec::with_capacity(2));
    telemetry::propagator().inject_context(&Context::current(), &mut fields);
    // `traceparent` only: a `tracestate` would ride along in every message.
    fields.0.retain(|(k, _)| k == "traceparent");
    headers_of(&fields.0)
}

/// The trace context a message's headers carry, if they carry a valid one and
/// traces are on.
pub fn context_of<H: Headers>(headers: Option<&H>) -> Option<Context> {
    if !telemetry::traces_enabled() {
        return None;
    }
    let cx = telemetry::propagator().extract(&Carrier(headers?));
    cx.span().span_context().is_valid().then_some(cx)
}

/// Kafka headers holding `fields`; `None` when there are none.
fn headers_of(fields: &[(String, String)]) -> Option<OwnedHeaders> {
    if fields.is_empty() {
        return None;
    }
    let headers = fields.iter().fold(
        OwnedHeaders::new_with_capacity(fields.len()),
        |h, (k, v)| {
            h.insert(Header {
                key: k,
                value: Some(v.as_str()),
            })
        },
    );
    Some(headers)
}

/// What the propagator writes, collected before it becomes Kafka headers.
struct Fields(Vec<(String, String)>);

impl Injector for Fields {
    fn set(&mut self, key: &str, value: String) {
        self.0.push((key.to_owned(), value));
    }
}

/// A message's headers as the propagator reads them (keys are matched without
/// regard to case, as HTTP does; values that are not UTF-8 are ignored).
struct Carrier<'a, H>(&'a H);

impl<H: Headers> Extractor for Carrier<'_, H> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|h| h.key.eq_ignore_ascii_case(key))
            .and_then(|h| h.value)
            .and_then(|v| std::str::from_utf8(v).ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|h| h.key).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};

    fn extract(headers: &OwnedHeaders) -> Context {
        telemetry::propagator().extract(&Carrier(headers))
    }

    /// The publish's context survives the trip through Kafka headers: same
    /// trace, same parent span, same sampling decision.
    #[test]
    fn trace_context_round_trips_through_kafka_headers() {
        let sent = SpanContext::new(
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").expect("trace id"),
            SpanId::from_hex("00f067aa0ba902b7").expect("span id"),
            TraceFlags::SAMPLED,
            true,
            TraceState::default(),
        );
        let mut fields = Fields(Vec::new());
        telemetry::propagator().inject_context(
            &Context::new().with_remote_span_context(sent.clone()),
            &mut fields,
        );
        let headers = headers_of(&fields.0).expect("a valid context makes headers");
        assert_eq!(
            Carrier(&headers).get("traceparent"),
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        );
        let got = extract(&headers);
        let got = got.span().span_context().clone();
        assert_eq!(got.trace_id(), sent.trace_id());
        assert_eq!(got.span_id(), sent.span_id());
        assert!(got.is_sampled() && got.is_remote());
    }

    /// No context, no header: a message published without a trace is the
    /// message published before traces existed.
    #[test]
    fn no_context_makes_no_headers() {
        let mut fields = Fields(Vec::new());
        telemetry::propagator().inject_context(&Context::new(), &mut fields);
        assert!(headers_of(&fields.0).is_none());
    }

    /// Headers without a trace, or with a broken one, give no parent (the
    /// consumer then writes the order in its batch's own trace).
    #[test]
    fn missing_or_broken_headers_give_no_context() {
        let other = OwnedHeaders::new().insert(Header {
            key: "reason",
            value: Some("x"),
        });
        assert!(!extract(&other).span().span_context().is_valid());
        let broken = OwnedHeaders::new().insert(Header {
            key: "traceparent",
            value: Some("00-not-a-trace-01"),
        });
        assert!(!extract(&broken).span().span_context().is_valid());
        let binary = OwnedHeaders::new().insert(Header {
            key: "traceparent",
            value: Some(&[0xff_u8, 0xfe][..]),
        });
        assert!(!extract(&binary).span().span_context().is_valid());
        // Traces off (no subscriber in unit tests): nothing is read at all.
        assert!(context_of(Some(&other)).is_none());
        assert!(context_of::<OwnedHeaders>(None).is_none());
    }
}
