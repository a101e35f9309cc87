//! The reservation topic's messages are what docs/asyncapi.yaml says they are:
//! the messages the service really publishes, checked against the document
//! with the AsyncAPI Initiative's parser (`scripts/asyncapi-check.sh`, which
//! scripts/tools.sh installs).

use std::path::Path;

use testkit::sale::SaleSpec;

use crate::helpers::{each_message_blocking, spawn_app};

/// Runs the check with these payloads as `Reservation` messages; its output
/// when it fails.
fn asyncapi_check(payloads: &[Vec<u8>]) -> Result<(), String> {
    let dir = tempfile::tempdir().expect("temp dir");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut cmd = std::process::Command::new(root.join("scripts/asyncapi-check.sh"));
    cmd.arg(root.join("docs/asyncapi.yaml"));
    for (i, p) in payloads.iter().enumerate() {
        let file = dir.path().join(format!("{i}.json"));
        std::fs::write(&file, p).expect("payload written");
        cmd.arg("Reservation").arg(file);
    }
    let out = cmd
        .output()
        .expect("scripts/asyncapi-check.sh runs (scripts/tools.sh installs its parser)");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out.status.success().then_some(()).ok_or(said)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn published_reservations_match_the_asyncapi_document() {
    let app = spawn_app().await;
    let plain = app.open_sale(5, 2).await;
    let split = app
        .open_sale_spec(&SaleSpec {
            stock_shards: 4,
            ..SaleSpec::new(8)
        })
        .await;
    for (sale, user) in [
        (&plain, "auth0|5f7c8ec7c33c6c004bbafe82"),
        (&split, "ann@example.com"),
    ] {
        app.reserve_accepted(&sale.sku, user).await;
    }
    let topic = app.settings.kafka.topic.clone();
    let payloads = tokio::task::spawn_blocking(move || {
        each_message_blocking(&topic, |m| {
            rdkafka::Message::payload(m).expect("payload").to_vec()
        })
    })
    .await
    .expect("reader");
    assert_eq!(payloads.len(), 2);
    asyncapi_check(&payloads).unwrap_or_else(|said| panic!("{said}"));
    // The check can fail: a field the document does not name.
    let mut extra: serde_json::Value = serde_json::from_slice(&payloads[0]).expect("JSON");
    extra["note"] = "unexpected".into();
    let extra = serde_json::to_vec(&extra).expect("JSON");
    let said = asyncapi_check(&[extra]).expect_err("a field the document does not name");
    assert!(
        said.contains("must NOT have additional properties"),
        "{said}"
    );
    app.stop().await;
}
