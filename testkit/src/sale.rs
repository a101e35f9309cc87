//! Setting up a sale as an operator would: through the admin API.

use serde_json::{json, Value};

/// An activity created and loaded into Redis.
#[derive(Debug, Clone)]
pub struct Sale {
    pub id: String,
    pub sku: String,
    /// How many stock shards its Redis state is split over.
    pub shards: u8,
}

/// What to sell; `SaleSpec::new(stock)` for the usual: one per user, open now
/// for an hour, 15 minutes to pay.
#[derive(Debug, Clone)]
pub struct SaleSpec {
    /// The SKU on sale; a unique one when `None`.
    pub sku: Option<String>,
    pub stock: u32,
    pub per_user_limit: u32,
    pub payment_timeout_secs: u32,
    /// Stock shards (`"stock_shards"`, API version 2); 1 keeps one hash tag.
    pub stock_shards: u8,
    /// Seconds from now to `starts_at`: negative for a sale already selling.
    pub starts_in_secs: i64,
    /// Seconds from `starts_at` to `ends_at`.
    pub open_secs: i64,
    /// Admission through the waiting room (joinable 600 s before the start)
    /// instead of first come, first served.
    pub waiting_room: bool,
    /// A price in minor units and its currency (`"price"`, `"currency"`).
    pub price: Option<(i64, String)>,
}

impl SaleSpec {
    pub fn new(stock: u32) -> Self {
        SaleSpec {
            sku: None,
            stock,
            per_user_limit: 1,
            payment_timeout_secs: 900,
            stock_shards: 1,
            starts_in_secs: -5,
            open_secs: 3600,
            waiting_room: false,
            price: None,
        }
    }
}

/// Creates a sale (by default one that opened a few seconds ago) and preloads it
/// into Redis, so it is selling when this returns if its window is open.
pub async fn open_sale(
    client: &reqwest::Client,
    base: &str,
    admin_token: &str,
    spec: &SaleSpec,
) -> Result<Sale, String> {
    let api = crate::api::Api::new(client.clone(), base, admin_token);
    let sku = spec.sku.clone().unwrap_or_else(|| crate::unique("sku-"));
    let now = chrono::Utc::now();
    let starts_at = now + chrono::Duration::seconds(spec.starts_in_secs);
    let mut body = json!({
            "sku": sku,
            "stock": spec.stock,
            "per_user_limit": spec.per_user_limit,
            "starts_at": starts_at,
            "ends_at": starts_at + chrono::Duration::seconds(spec.open_secs),
            "payment_timeout_secs": spec.payment_timeout_secs,
            "stock_shards": spec.stock_shards,
            "admission": if spec.waiting_room { "waiting_room" } else { "open" },
            "waiting_room_secs": 600,
    });
    if let Some((price, currency)) = &spec.price {
        body["price"] = json!(price);
        body["currency"] = json!(currency);
    }
    let resp = api
        .create_activity(&body)
        .send()
        .await
        .map_err(|e| format!("create the sale: {e}"))?;
    let status = resp.status();
    let body: Value = resp.json().await.unwrap_or(Value::Null);
    if status != reqwest::StatusCode::CREATED {
        return Err(format!("create the sale: {status} {body}"));
    }
    let id = body["id"]
        .as_str()
        .ok_or("the created sale has no id")?
        .to_owned();
    // Not loaded yet, so it is loaded whatever its window (API version 2).
    let resp = api
        .preload(&id)
        .send()
        .await
        .map_err(|e| format!("preload the sale: {e}"))?;
    if !resp.status().is_success() {
        return Err(format!("preload the sale: {}", resp.status()));
    }
    Ok(Sale {
        id,
        sku,
        shards: spec.stock_shards,
    })
}

/// Deletes every Redis key of activity `activity_id`, its stock shards' and its
/// waiting room's, on each node of `node_urls` (every primary of a Cluster, or
/// the one node): the sale's state lost, as an eviction or a shard that
/// restarted empty would lose it. Returns how many keys went.
pub async fn forget_in_redis(node_urls: &[String], activity_id: &str) -> Result<usize, String> {
    let mut deleted = 0;
    for url in node_urls {
        let client = redis::Client::open(url.as_str()).map_err(|e| e.to_string())?;
        let mut conn = client
            .get_multiplexed_async_connection()
            .await
            .map_err(|e| format!("{url}: {e}"))?;
        for pattern in [
            format!("flash:{{{activity_id}}}*"),
            format!("flash:{{{activity_id}#*"),
        ] {
            let keys: Vec<String> = redis::cmd("KEYS")
                .arg(&pattern)
                .query_async(&mut conn)
                .await
                .map_err(|e| format!("{url}: {e}"))?;
            // One DEL per key: on a Cluster node, keys of several slots may
            // not go in one command.
            for key in keys {
                let n: usize = redis::cmd("DEL")
                    .arg(&key)
                    .query_async(&mut conn)
                    .await
                    .map_err(|e| format!("{url}: {e}"))?;
                deleted += n;
            }
        }
    }
    Ok(deleted)
}
