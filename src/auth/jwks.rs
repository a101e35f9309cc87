//! The identity provider's JWKS, fetched over HTTP(S) and kept in memory.
//!
//! - Fetched at start and every `auth.jwks_refresh_secs` by the refresher
//!   (`Auth::run_key_refresher`), sooner (every `auth.jwks_min_refresh_secs`)
//!   while fetches fail.
//! - Fetched again when a token names a `kid` the set lacks (a key the provider
//!   has just rotated in), at most once per `auth.jwks_min_refresh_secs`: a flood
//!   of made-up `kid`s costs the provider one request every few seconds.
//! - One fetch at a time, in a task of its own: requests that need a fetch wait
//!   for the one under way and use its result (single flight), instead of each
//!   sending its own. A request that gives up (its client left, its timeout
//!   struck) never cancels the fetch, and waits at most `auth.jwks_timeout_ms`
//!   (less than `server.request_timeout_ms`, checked at start). Within
//!   `auth.jwks_min_refresh_secs` of the last fetch an unknown `kid` caused,
//!   and with no fetch under way, an unknown `kid` is refused at once.
//! - A redirect is not followed: it is a failed fetch.
//! - A fetch that fails (provider down, an error status, a timeout, a body that
//!   is not a JWKS or holds no usable key) changes nothing: the last good set is
//!   kept, and tokens signed with its keys go on verifying.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tokio::sync::watch;

use super::keys::{KeySet, ProviderKey};
use super::verified::Verified;
use crate::config::AuthSettings;

/// Added to `auth.jwks_timeout_ms` for a request waiting on a fetch.
const WAIT_MARGIN: Duration = Duration::from_millis(50);

/// The largest JWKS document read; a provider's is a few kilobytes.
const MAX_JWKS_BYTES: usize = 1 << 20;

pub(super) struct RemoteKeys {
    url: reqwest::Url,
    client: reqwest::Client,
    keys: RwLock<Arc<KeySet>>,
    /// The PEM keys, whose kids a JWKS key may not take.
    pem_keys: Arc<KeySet>,
    /// Emptied when a fetch finds a key withdrawn.
    verified: Arc<Verified>,
    /// The fetch under way: done when its channel says `Some`.
    inflight: Mutex<Option<watch::Receiver<Option<Refreshed>>>>,
    /// Whether `inflight` holds a fetch (read without its lock).
    fetching: AtomicBool,
    /// When a token's unknown `kid` last caused a fetch: milliseconds since
    /// `started`, plus one (0: never).
    last_unknown_kid: AtomicU64,
    started: Instant,
    min_interval: Duration,
    /// How long a request waits for a fetch.
    wait_limit: Duration,
    pub(super) refresh_every: Duration,
}

/// What a fetch did.
#[derive(Debug, Clone, Copy)]
pub(super) struct Refreshed {
    pub ok: bool,
}

const FAILED: Refreshed = Refreshed { ok: false };

#[derive(Debug, Clone, Copy)]
enum Failure {
    /// No answer, an error status, a broken body.
    Unreachable,
    /// An answer that is not a JWKS with a usable key.
    Invalid,
}

impl RemoteKeys {
    pub(super) fn new(
        url: &str,
        settings: &AuthSettings,
        pem_keys: Arc<KeySet>,
        verified: Arc<Verified>,
    ) -> anyhow::Result<Self> {
        let url = reqwest::Url::parse(url).with_context(|| format!("auth.jwks_url {url:?}"))?;
        let timeout = Duration::from_millis(settings.jwks_timeout_ms);
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout)
            .user_agent(concat!("flashsale/", env!("CARGO_PKG_VERSION")))
            // A redirect could lead anywhere, https to http included.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .context("cannot build the HTTP client for auth.jwks_url")?;
        Ok(RemoteKeys {
            url,
            client,
            keys: RwLock::default(),
            pem_keys,
            verified,
            inflight: Mutex::new(None),
            fetching: AtomicBool::new(false),
            last_unknown_kid: AtomicU64::new(0),
            started: Instant::now(),
            min_interval: Duration::from_secs(settings.jwks_min_refresh_secs),
            wait_limit: timeout + WAIT_MARGIN,
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

    /// Fetches the set now (or waits for the fetch under way).
    pub(super) async fn refresh(self: &Arc<Self>) -> Refreshed {
        let mut done = self.join_or_start_fetch("scheduled");
        let refreshed = match done.wait_for(Option::is_some).await {
            Ok(result) => result.unwrap_or(FAILED),
            Err(_) => FAILED,
        };
        refreshed
    }

    /// The key named `kid`, which the set in hand lacks: waits (at most
    /// `wait_limit`) for a fetch under way, or starts one unless an unknown
    /// `kid` already did within the minimum interval. `None` when the key is
    /// still unknown.
    pub(super) async fn key_for_unknown_kid(
        self: &Arc<Self>,
        kid: &str,
    ) -> Option<Arc<ProviderKey>> {
        if !self.fetching.load(Ordering::Acquire) && self.unknown_kid_fetched_recently() {
            metrics::counter!("flashsale_jwks_unknown_kid_total", "fetched" => "no").increment(1);
            return None;
        }
        let mut done = {
            let mut inflight = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(key) = self.current().get(kid) {
                // Fetched meanwhile.
                return Some(key.clone());
            }
            match inflight.as_ref() {
                Some(done) => done.clone(),
                None => {
                    if self.unknown_kid_fetched_recently() {
                        metrics::counter!("flashsale_jwks_unknown_kid_total", "fetched" => "no")
                            .increment(1);
                        return None;
                    }
                    self.last_unknown_kid.store(
                        self.started.elapsed().as_millis() as u64 + 1,
                        Ordering::Release,
                    );
                    metrics::counter!("flashsale_jwks_unknown_kid_total", "fetched" => "yes")
                        .increment(1);
                    self.start_fetch(&mut inflight, "unknown_kid")
                }
            }
        };
        // Dropping this wait (the request given up) leaves the fetch running.
        let _ = tokio::time::timeout(self.wait_limit, done.wait_for(Option::is_some)).await;
        self.current().get(kid).cloned()
    }

    fn unknown_kid_fetched_recently(&self) -> bool {
        match self.last_unknown_kid.load(Ordering::Acquire) {
            0 => false,
            at => {
                let since = Duration::from_millis(at - 1);
                self.started.elapsed().saturating_sub(since) < self.min_interval
            }
        }
    }

    fn join_or_start_fetch(
        self: &Arc<Self>,
        trigger: &'static str,
    ) -> watch::Receiver<Option<Refreshed>> {
        let mut inflight = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
        match inflight.as_ref() {
            Some(done) => done.clone(),
            None => self.start_fetch(&mut inflight, trigger),
        }
    }

    /// Spawns a fetch; call with `inflight` locked and empty.
    fn start_fetch(
        self: &Arc<Self>,
        inflight: &mut Option<watch::Receiver<Option<Refreshed>>>,
        trigger: &'static str,
    ) -> watch::Receiver<Option<Refreshed>> {
        let (tx, rx) = watch::channel(None);
        *inflight = Some(rx.clone());
        self.fetching.store(true, Ordering::Release);
        let this = self.clone();
        tokio::spawn(async move {
            let refreshed = this.fetch_and_keep(trigger).await;
            {
                let mut inflight = this.inflight.lock().unwrap_or_else(|e| e.into_inner());
                *inflight = None;
                this.fetching.store(false, Ordering::Release);
            }
            tx.send_replace(Some(refreshed));
        });
        rx
    }

    /// One fetch; the set is replaced only by a good one. Only ever runs in the
    /// task `start_fetch` spawns (one at a time).
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
                if lost_keys {
                    // After the swap: a request that read the generation
                    // before this clear may hold an old key, and will not
                    // remember its token.
                    self.verified.clear();
                }
                metrics::counter!("flashsale_jwks_refreshes_total", "trigger" => trigger, "outcome" => "ok")
                    .increment(1);
                metrics::gauge!("flashsale_jwks_keys").set(count as f64);
                metrics::gauge!("flashsale_jwks_last_success_timestamp_seconds")
                    .set(chrono::Utc::now().timestamp() as f64);
                if lost_keys {
                    tracing::info!(url = %self.url, keys = count, "the identity provider withdrew a key; tokens it signed are verified again");
                }
                Refreshed { ok: true }
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
                FAILED
            }
        }
    }

    async fn fetch(&self) -> Result<KeySet, (Failure, anyhow::Error)> {
        let body = self
            .fetch_body()
            .await
            .map_err(|e| (Failure::Unreachable, e))?;
        KeySet::from_jwks(&body, &self.pem_keys).map_err(|e| (Failure::Invalid, e))
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
