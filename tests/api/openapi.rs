//! The OpenAPI document (`/openapi.json`) covers the whole contract, and `/docs`
//! renders it in a browser from the service's own page. (`scripts/test.sh` also
//! lints the document and fuzzes the running API against it.)

use std::time::Duration;

use reqwest::StatusCode;
use serde_json::Value;

use crate::helpers::spawn_app;

/// Every endpoint of docs/API.md (version 2), by method and path.
const CONTRACT: &[(&str, &str)] = &[
    ("get", "/flash/{sku}"),
    ("post", "/flash/{sku}/reserve"),
    ("get", "/flash/{sku}/reservation"),
    ("post", "/orders/{order_id}/pay"),
    ("post", "/admin/activities"),
    ("get", "/admin/activities"),
    ("get", "/admin/activities/{id}"),
    ("post", "/admin/activities/{id}/preload"),
    ("post", "/admin/activities/{id}/pause"),
    ("post", "/admin/activities/{id}/resume"),
    ("post", "/admin/activities/{id}/reconcile"),
    ("post", "/admin/activities/{id}/stock"),
    ("get", "/admin/ui"),
    ("get", "/buy/{sku}"),
    ("get", "/healthz"),
    ("get", "/readyz"),
    ("get", "/metrics"),
    ("get", "/openapi.json"),
    ("get", "/docs"),
];

#[tokio::test]
async fn the_document_covers_the_contract() {
    let app = spawn_app().await;
    let resp = app.send(app.api.openapi()).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let doc: Value = resp.json().await.expect("JSON");
    assert!(doc["openapi"]
        .as_str()
        .is_some_and(|v| v.starts_with("3.1")));
    for (method, path) in CONTRACT {
        let op = &doc["paths"][path][method];
        assert!(op.is_object(), "{method} {path} is not documented");
        let responses = op["responses"].as_object().expect("responses");
        assert!(!responses.is_empty(), "{method} {path} has no answers");
        let secured = path.starts_with("/admin/activities")
            || path.ends_with("/reserve")
            || path.ends_with("/reservation")
            || path.ends_with("/pay");
        if secured {
            assert!(op["security"].is_array(), "{method} {path} names no token");
            let unauthorized = &responses["401"]["content"]["application/json"]["schema"];
            assert_eq!(
                unauthorized["$ref"], "#/components/schemas/ErrorBody",
                "{method} {path}: 401 in the error shape"
            );
        }
    }
    let schemes = &doc["components"]["securitySchemes"];
    assert_eq!(schemes["user"]["scheme"], "bearer");
    assert_eq!(schemes["admin"]["scheme"], "bearer");
    let reserve = &doc["paths"]["/flash/{sku}/reserve"]["post"]["responses"];
    for status in ["202", "401", "403", "404", "409", "422", "429", "503"] {
        assert!(reserve[status].is_object(), "reserve documents {status}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_docs_page_renders_the_document() {
    let app = spawn_app().await;
    let dir = tempfile::tempdir().expect("a temporary folder");
    let browser = testkit::browser::Browser::start(dir.path())
        .await
        .expect("a headless browser");
    browser.goto(&app.url("/docs")).await.expect("page");
    browser
        .wait_text("#title", Duration::from_secs(20), |t| {
            t.contains("OpenAPI 3.1")
        })
        .await
        .expect("the document loaded");
    let main = browser.text("#main").await.expect("text");
    for (_, path) in CONTRACT {
        assert!(main.contains(path), "{path} is not on the page");
    }
}
