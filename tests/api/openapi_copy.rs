//! The repository carries a copy of the OpenAPI document (`docs/openapi.json`) so
//! that it can be read without running the service. This test keeps the copy
//! true: it fails as soon as a handler's documented shape changes without a new
//! copy. Regenerate it with `cargo run --quiet -- openapi > docs/openapi.json`.

use reqwest::StatusCode;
use serde_json::Value;

use crate::helpers::spawn_app;

/// Where the copy lives, from the crate's root.
const COPY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/openapi.json");

#[tokio::test]
async fn the_committed_document_is_the_one_served() {
    let app = spawn_app().await;
    let resp = app.send(app.api.openapi()).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let served: Value = resp.json().await.expect("JSON");

    let text = std::fs::read_to_string(COPY).expect("docs/openapi.json is readable");
    let committed: Value = serde_json::from_str(&text).expect("docs/openapi.json is JSON");

    // Compared as JSON values, so the copy may be pretty-printed; the first
    // difference is named, rather than two whole documents printed.
    if let Some(path) = first_difference(&committed, &served, String::new()) {
        panic!(
            "docs/openapi.json differs from GET /openapi.json at `{path}`; \
             regenerate it: cargo run --quiet -- openapi > docs/openapi.json"
        );
    }
}

/// The JSON pointer of the first place where `a` and `b` differ, if any.
fn first_difference(a: &Value, b: &Value, at: String) -> Option<String> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let missing = x
                .keys()
                .chain(y.keys())
                .find(|k| !(x.contains_key(*k) && y.contains_key(*k)));
            if let Some(key) = missing {
                return Some(format!("{at}/{key}"));
            }
            x.iter()
                .find_map(|(k, v)| first_difference(v, &y[k], format!("{at}/{k}")))
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (v, w))| first_difference(v, w, format!("{at}/{i}"))),
        _ if a == b => None,
        _ => Some(if at.is_empty() { "/".to_string() } else { at }),
    }
}
