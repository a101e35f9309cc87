//! The identity provider's JWKS, fetched over HTTP(S) and kept in memory.
//!
//! - Fetched at start and every `auth.jwks_refresh_secs` by the refresher
//!   (`Auth::run_key_refresher`), sooner (every `auth.jwks_min_refresh_secs`)
//!   while fetches fail.
//! - Fetched again when a token names a `kid` the set lacks (a key the provider
//!   has just rotated in), at most once per `auth.jwks_min_refresh_secs`: a flood
//!   of made-up `kid`s costs the provider one request every few seconds.
//! - One fetch at a time: requests that need a fetch wait for the one under way
//!   and use its result (single flight), instead of each sending its own.
//! - A fetch that fails (provider down, an error status, a timeout, a body that
//!   is not a JWKS or holds no usable key) changes nothing: the last good set is
//!   kept, and tokens signed with its keys go on verifying.

use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use super::keys::{KeySet, ProviderKey};
use crate::config::AuthSettings;

/// The largest JWKS document read; a provider's is a few kilobytes.
const MAX_JWKS_BYTES: usize = 1 << 20;

pub(super) struct RemoteKeys {
    url: reqwest::Url,
    client: reqwest::Client,
    keys: RwLock<Arc<KeySet>>,
    /// Held while a fetch is under way (single flight); holds when a token's
    /// unknown `kid` last caused a fetch.
    fetching: tokio::sync::Mutex<Option<Instant>>,
    min_interval: Duration,
    pub(super) refresh_every: Duration,
}

/// What a fetch did.
#[derive(Debug, Clone, Copy)]
pub(super) struct Refreshed {
    pub ok: bool,
    /// The new set lacks a key the old one had (withdrawn by the provider).
    pub lost_keys: bool,
}

#[derive(Debug, Clone, Copy)]
enum Failure {
    /// No answer, an error status, a broken body.
    Unreachable,
    /// An answer that is not a JWKS with a usable key.
    Invalid,
}

impl RemoteKeys {
    pub(super) fn new(url: &str, settings: &AuthSettings) -> anyhow::Result<Self> {
        let url = reqwest::Url::parse(url).with_context(|| format!("auth.jwks_url {url:?}"))?;
        let timeout = Duration::from_millis(settings.jwks_timeout_ms);
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout)
            .user_agent(concat!("flashsale/", env!("CARGO_PKG_VERSION")))
            .build()
            .context("cannot build the HTTP client for auth.jwks_url")?;
        Ok(RemoteKeys {
            url,
            client,
            keys: RwLock::default(),
            fetching: tokio::sync::Mutex::new(None),
            min_interval: Duration::from_secs(settings.jwks_min_refresh_secs),
            refresh_every: Duration::from_secs(settings.jwks_refresh_secs),
        })
    }

    pub(super) fn min_interval(&self) -> Duration {
        self.min_interval
    }

    /// The keys in hand.
    pub(super) fn current(&self) -> Arc<KeySet> {
        // A poisoned lock still holds a whole Arc: writers only swap it.
        self.keys.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Fetches the set now (after any fetch under way).
    pub(super) async fn refresh(&self) -> Refreshed {
        let _fetching = self.fetching.lock().await;
        self.fetch_and_keep("scheduled").await
    }

    /// The key named `kid`, which the set in hand lacks: waits for a fetch under
    /// way, or fetches unless an unknown `kid` already did within the minimum
    /// interval. `None` when the key is still unknown.
    pub(super) async fn key_for_unknown_kid(
        &self,
        kid: &str,
    ) -> (Option<Arc<ProviderKey>>, Refreshed) {
        let unchanged = Refreshed {
            ok: true,
            lost_keys: false,
        };
        let mut last = self.fetching.lock().await;
        if let Some(key) = self.current().get(kid) {
            // Fetched while this request waited.
            return (Some(key.clone()), unchanged);
        }
        if last.is_some_and(|at| at.elapsed() < self.min_interval) {
            metrics::counter!("flashsale_jwks_unknown_kid_total", "fetched" => "no").increment(1);
            return (None, unchanged);
        }
        *last = Some(Instant::now());
        metrics::counter!("flashsale_jwks_unknown_kid_total", "fetched" => "yes").increment(1);
        let refreshed = self.fetch_and_keep("unknown_kid").await;
        (self.current().get(kid).cloned(), refreshed)
    }

    /// One fetch; the set is replaced only by a good one. Call with `fetching` held.
    async fn fetch_and_keep(&self, trigger: &'static str) -> Refreshed {
        match self.fetch().await {
            Ok(set) => {
                let count = set.len();
                let lost_keys = {
                    let mut keys = self.keys.write().unwrap_or_else(|e| e.into_inner());
                    let lost = keys.loses_keys_in(&set);
                    *keys = Arc::new(set);
                    lost
                };
                metrics::counter!("flashsale_jwks_refreshes_total", "trigger" => trigger, "outcome" => "ok")
                    .increment(1);
                metrics::gauge!("flashsale_jwks_keys").set(count as f64);
                metrics::gauge!("flashsale_jwks_last_success_timestamp_seconds")
                    .set(chrono::Utc::now().timestamp() as f64);
                if lost_keys {
                    tracing::info!(url = %self.url, keys = count, "the identity provider withdrew a key; tokens it signed are verified again");
                }
                Refreshed {
                    ok: true,
                    lost_keys,
                }
            }
            Err((failure, err)) => {
                let outcome = match failure {
                    Failure::Unreachable => "unreachable",
                    Failure::Invalid => "invalid",
                };
                metrics::counter!("flashsale_jwks_refreshes_total", "trigger" => trigger, "outcome" => outcome)
                    .increment(1);
                tracing::warn!(
                    url = %self.url,
                    error = %format!("{err:#}"),
                    kept = self.current().len(),
                    "cannot refresh the identity provider's keys; keeping the ones in hand"
                );
                Refreshed {
                    ok: false,
                    lost_keys: false,
                }
            }
        }
    }

    async fn fetch(&self) -> Result<KeySet, (Failure, anyhow::Error)> {
        let body = self
            .fetch_body()
            .await
            .map_err(|e| (Failure::Unreachable, e))?;
        KeySet::from_jwks(&body).map_err(|e| (Failure::Invalid, e))
    }

    async fn fetch_body(&self) -> anyhow::Result<Vec<u8>> {
        let mut response = self
            .client
            .get(self.url.clone())
            .header(reqwest::header::ACCEPT, "application/json")
            .send()
            .await
            .context("request failed")?;
        let status = response.status();
        if !status.is_success() {
            bail!("answered {status}");
        }
        let mut body = Vec::new();
        while let Some(chunk) = response.chunk().await.context("the body broke off")? {
            if body.len() + chunk.len() > MAX_JWKS_BYTES {
                bail!("the body is larger than {MAX_JWKS_BYTES} bytes");
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body)
    }
}
