//! Identity: user JWTs and the admin bearer token.
//!
//! A user token is accepted when it is
//! - HS256, signed with `auth.user_token_secret` (unless `auth.hs256 = false`):
//!   the service's own tokens (`flashsale token`);
//! - or signed by the identity provider (RS256, ES256, ...) with a key from its
//!   JWKS (`auth.jwks_url`, [`jwks`]) or a PEM file (`auth.public_keys`),
//!   and then it must also carry `auth.issuer` and `auth.audience` when set
//!   (`serve` refuses to start without both off loopback).
//!
//! The key decides the algorithm ([`keys`]): a token naming a provider key by
//! `kid` is checked with that key's one algorithm, and refused when its header
//! says another. A token without `kid` is accepted only when exactly one
//! provider key has its algorithm. A PEM key's `kid` takes precedence over the
//! JWKS's (a JWKS key of that name is skipped). HS256 is only ever checked with the secret, never with a
//! provider key's bytes. Either way `exp` and `sub` (a user id) are required,
//! and `exp`/`nbf` hold within `auth.leeway_secs`.
//!
//! A token verified once is remembered ([`verified`]): the user's next click
//! costs a hash lookup, whatever verified it.

mod jwks;
mod keys;
mod verified;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::http::{header, HeaderMap};
use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize};
use subtle::ConstantTimeEq;
use tokio_util::sync::CancellationToken;

use crate::clock::Clock;
use crate::config::AuthSettings;
use crate::error::AppError;
use crate::input::{is_valid_id, is_valid_user_id};

use jwks::RemoteKeys;
use keys::{KeySet, ProviderKey};
use verified::Verified;

/// `exp`/`nbf` skew allowed by [`Auth::new`] (the service's is `auth.leeway_secs`).
const DEFAULT_LEEWAY_SECS: u64 = 30;

/// The claims of a user token.
#[derive(Debug, Serialize, Deserialize)]
pub struct Claims {
    pub sub: String,
    pub exp: i64,
}

/// The authenticated caller of a user endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct User {
    pub id: Arc<str>,
}

/// The claims of an identity provider's token, as [`Auth::verify_claims`]
/// returns them after checking everything a user token's check does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifiedClaims {
    /// Who: a user id (see [`crate::input::is_valid_user_id`]).
    pub sub: String,
    /// The token's `role` claim, when it is a string (`"operator"` for operators).
    pub role: Option<String>,
    /// Expiry, seconds since the Unix epoch.
    pub exp: i64,
    /// The issuer, when the token names one as a string.
    pub iss: Option<String>,
}

/// The claims read from any token. Every one is optional here so that
/// `jsonwebtoken`'s own checks, which run after the claims are read, name what
/// is missing; `role` and `iss` of another type than a string are ignored.
#[derive(Deserialize)]
struct TokenClaims {
    #[serde(default)]
    sub: Option<String>,
    #[serde(default)]
    exp: Option<f64>,
    #[serde(default)]
    nbf: Option<f64>,
    #[serde(default)]
    role: Option<serde_json::Value>,
    #[serde(default)]
    iss: Option<serde_json::Value>,
}

impl TokenClaims {
    /// The subject, which must be a user id, and the expiry (both required by
    /// the checks already made).
    fn subject(&self, ids: &UserIds) -> Result<(&str, i64), AppError> {
        let (Some(sub), Some(exp)) = (self.sub.as_deref(), self.exp) else {
            return Err(AppError::Unauthorized("token is malformed"));
        };
        if !ids.accepts(sub) {
            return Err(AppError::Unauthorized(
                "token subject is not a valid user id",
            ));
        }
        Ok((sub, exp as i64))
    }
}

/// Which user ids a token's subject may be. Providers' ids (up to 255 bytes,
/// [`is_valid_user_id`]) need the migration that widened MySQL's columns
/// (`20261210000002_user_ids_as_bytes`): until an instance has seen it applied,
/// it accepts only ids the narrow columns hold (`[A-Za-z0-9_-]{1,64}`), so an
/// upgrade can roll out first and migrate after, while instances of the
/// release before, which cannot read the widened columns, are gone.
#[derive(Clone)]
pub struct UserIds(Arc<AtomicBool>);

impl UserIds {
    /// Providers' ids are accepted from now on.
    pub fn widen(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    pub fn wide(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    /// Only ids of the narrow form, until [`UserIds::widen`].
    pub fn narrow() -> Self {
        UserIds(Arc::new(AtomicBool::new(false)))
    }

    /// Providers' ids accepted at once (a process without MySQL to look at).
    pub fn wide_from_the_start() -> Self {
        UserIds(Arc::new(AtomicBool::new(true)))
    }

    pub fn accepts(&self, id: &str) -> bool {
        if self.wide() {
            is_valid_user_id(id)
        } else {
            is_valid_id(id)
        }
    }
}

#[derive(Clone)]
pub struct Auth {
    admin_token: SecretString,
    /// The service's own tokens; `None` when `auth.hs256` is off.
    hs256: Option<Arc<Hs256>>,
    /// The identity provider's keys; `None` when none is configured.
    provider: Option<Arc<Provider>>,
    verified: Arc<Verified>,
    leeway: u64,
    /// What `exp` and `nbf` are judged against: the shared clock in the
    /// service (see `crate::clock`), this process's own elsewhere.
    clock: Clock,
    /// The subjects accepted (all of providers' ids, unless the service found
    /// MySQL's columns not widened yet).
    user_ids: UserIds,
}

struct Hs256 {
    encoding: EncodingKey,
    decoding: DecodingKey,
    validation: Validation,
}

struct Provider {
    /// `auth.public_keys`, read at start.
    pem_keys: Arc<KeySet>,
    /// `auth.jwks_url`'s keys.
    remote: Option<Arc<RemoteKeys>>,
    /// `exp`, `sub`, and the configured issuer and audience; the algorithm is
    /// set per key.
    validation: Validation,
}

/// Who may have signed a token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Signers {
    /// The service's secret or the identity provider.
    Any,
    /// The identity provider only.
    Provider,
}

impl Auth {
    /// The service's tokens as configured: HS256 (unless `auth.hs256` is off),
    /// the identity provider's keys (PEM files read now; the JWKS fetched by
    /// `run_key_refresher` or by the first token that needs it), keeping
    /// `auth.verified_tokens` verified tokens.
    pub fn from_settings(settings: &AuthSettings) -> anyhow::Result<Self> {
        let hs256 = if settings.hs256 {
            Some(Arc::new(Hs256::new(
                &settings.user_token_secret,
                settings.leeway_secs,
            )?))
        } else {
            None
        };
        let verified = Arc::new(Verified::new(settings.verified_tokens));
        let provider = if settings.has_identity_provider() {
            Some(Arc::new(Provider::from_settings(settings, &verified)?))
        } else {
            None
        };
        Ok(Auth {
            admin_token: settings.admin_token.clone(),
            hs256,
            provider,
            verified,
            leeway: settings.leeway_secs,
            clock: Clock::local(),
            user_ids: UserIds::wide_from_the_start(),
        })
    }

    /// HS256 user tokens only (to sign them: `flashsale token`, the tests and
    /// the benchmark). Fails only on an empty secret (config validation already
    /// refuses one). Keeps no verified token until `with_verified_tokens` says
    /// how many: the service's number is a setting (`auth.verified_tokens`).
    pub fn new(
        admin_token: SecretString,
        user_token_secret: &SecretString,
    ) -> anyhow::Result<Self> {
        Ok(Auth {
            admin_token,
            hs256: Some(Arc::new(Hs256::new(
                user_token_secret,
                DEFAULT_LEEWAY_SECS,
            )?)),
            provider: None,
            verified: Arc::new(Verified::new(0)),
            leeway: DEFAULT_LEEWAY_SECS,
            clock: Clock::local(),
            user_ids: UserIds::wide_from_the_start(),
        })
    }

    /// Accepts the subjects `ids` says (the service's: narrow until MySQL's
    /// columns are seen widened).
    pub fn with_user_ids(mut self, ids: UserIds) -> Self {
        self.user_ids = ids;
        self
    }

    pub fn user_ids(&self) -> &UserIds {
        &self.user_ids
    }

    /// Judges `exp` and `nbf` by `clock` (the service's: the shared one).
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    /// Keeps at most `capacity` verified tokens (0: verify every request in
    /// full). For the HS256-only `Auth` of [`Auth::new`]: the service's own is
    /// sized by `auth.verified_tokens`.
    pub fn with_verified_tokens(mut self, capacity: usize) -> Self {
        self.verified = Arc::new(Verified::new(capacity));
        self
    }

    /// Signs an HS256 user token valid for `ttl_secs`.
    pub fn issue(&self, user_id: &str, ttl_secs: i64) -> anyhow::Result<String> {
        let hs256 = self
            .hs256
            .as_ref()
            .context("HS256 user tokens are turned off (auth.hs256 = false)")?;
        if !is_valid_user_id(user_id) {
            anyhow::bail!(
                "a user id is 1 to 255 bytes of UTF-8 without control or bidirectional-text characters"
            );
        }
        let exp = self
            .clock
            .now()
            .timestamp()
            .checked_add(ttl_secs)
            .context("the token's validity overflows its expiry")?;
        let claims = Claims {
            sub: user_id.to_owned(),
            exp,
        };
        Ok(jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &claims,
            &hs256.encoding,
        )?)
    }

    /// Verifies `Authorization: Bearer <JWT>` and returns the user. A token
    /// verified before costs a hash lookup; a new one a signature check, and,
    /// when it names a key the identity provider has just rotated in, a wait
    /// for the JWKS (see [`jwks`]).
    pub async fn user(&self, headers: &HeaderMap) -> Result<User, AppError> {
        let token = bearer(headers)?;
        let now = self.clock.now().timestamp();
        // `auth.leeway_secs` is at most 300 (checked at load).
        if let Some(user) = self
            .verified
            .get(token, now.saturating_sub(self.leeway as i64))
        {
            return Ok(user);
        }
        // Read before any key is: a key withdrawn meanwhile bumps it.
        let generation = self.verified.generation();
        let claims = self.verify(token, Signers::Any).await?;
        let (sub, exp) = claims.subject(&self.user_ids)?;
        let user = User { id: sub.into() };
        self.verified.put(token, &user, exp, generation);
        Ok(user)
    }

    /// Verifies a JWT of the identity provider (an operator's, say) and returns
    /// its claims with its `role`. Checks what [`Auth::user`] checks (the key
    /// and its algorithm, the signature, `exp`/`nbf`, `iss`, `aud`, a `sub`
    /// that is a user id), remembers nothing, and refuses HS256 tokens: the
    /// service's own secret signs users, never roles. `401` on any failure.
    pub async fn verify_claims(&self, token: &str) -> Result<VerifiedClaims, AppError> {
        let claims = self.verify(token, Signers::Provider).await?;
        let (sub, exp) = claims.subject(&self.user_ids)?;
        let text =
            |v: &Option<serde_json::Value>| v.as_ref().and_then(|v| v.as_str()).map(str::to_owned);
        Ok(VerifiedClaims {
            sub: sub.to_owned(),
            role: text(&claims.role),
            exp,
            iss: text(&claims.iss),
        })
    }

    /// Checks `Authorization: Bearer <admin token>` in constant time.
    pub fn admin(&self, headers: &HeaderMap) -> Result<(), AppError> {
        let token = bearer(headers)?;
        let expected = self.admin_token.expose_secret().as_bytes();
        if bool::from(token.as_bytes().ct_eq(expected)) {
            Ok(())
        } else {
            Err(AppError::Unauthorized("admin token required"))
        }
    }

    /// Fetches the identity provider's JWKS now and then every
    /// `auth.jwks_refresh_secs` (every `auth.jwks_min_refresh_secs` while
    /// fetches fail), until `shutdown`. Returns at once without a JWKS.
    pub async fn run_key_refresher(self, shutdown: CancellationToken) {
        let Some(remote) = self.provider.as_ref().and_then(|p| p.remote.as_ref()) else {
            return;
        };
        loop {
            let refreshed = remote.refresh().await;
            let wait: Duration = if refreshed.ok {
                remote.refresh_every
            } else {
                remote.min_interval()
            };
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// The claims of a token signed by one of `signers`, after every check:
    /// the signature's and the claims' (`verify_signed`), then `exp` and `nbf`
    /// against the service's clock, within `auth.leeway_secs`.
    async fn verify(&self, token: &str, signers: Signers) -> Result<TokenClaims, AppError> {
        let claims = self.verify_signed(token, signers).await?;
        let now = self.clock.now().timestamp() as f64;
        let leeway = self.leeway as f64;
        if claims.exp.is_some_and(|exp| exp < now - leeway) {
            return Err(AppError::Unauthorized("token expired"));
        }
        if claims.nbf.is_some_and(|nbf| nbf > now + leeway) {
            return Err(AppError::Unauthorized("token not valid yet (nbf)"));
        }
        Ok(claims)
    }

    /// The claims of a token signed by one of `signers`, after every check but
    /// its time's.
    async fn verify_signed(&self, token: &str, signers: Signers) -> Result<TokenClaims, AppError> {
        let header = jsonwebtoken::decode_header(token)
            .map_err(|_| AppError::Unauthorized("token is malformed"))?;
        let provider = self.provider.as_deref();
        // A provider key the token names decides the algorithm.
        if let (Some(provider), Some(kid)) = (provider, header.kid.as_deref()) {
            if let Some(key) = provider.known_key(kid) {
                return provider.verify_with(&key, &header, token);
            }
        }
        if header.alg == Algorithm::HS256 {
            if signers == Signers::Provider {
                return Err(AppError::Unauthorized(
                    "token is not signed by the identity provider",
                ));
            }
            let hs256 = self
                .hs256
                .as_deref()
                .ok_or(AppError::Unauthorized("HS256 tokens are not accepted"))?;
            return jsonwebtoken::decode::<TokenClaims>(token, &hs256.decoding, &hs256.validation)
                .map(|data| data.claims)
                .map_err(refusal);
        }
        let Some(provider) = provider else {
            return Err(AppError::Unauthorized("token algorithm is not accepted"));
        };
        match header.kid.as_deref() {
            Some(kid) => {
                let remote = provider
                    .remote
                    .as_ref()
                    .ok_or(AppError::Unauthorized("token key id (kid) is unknown"))?;
                let key = remote
                    .key_for_unknown_kid(kid)
                    .await
                    .ok_or(AppError::Unauthorized("token key id (kid) is unknown"))?;
                provider.verify_with(&key, &header, token)
            }
            None => provider.verify_unnamed(&header, token),
        }
    }
}

impl Hs256 {
    fn new(secret: &SecretString, leeway: u64) -> anyhow::Result<Self> {
        let secret = secret.expose_secret().as_bytes();
        let mut validation = Validation::new(Algorithm::HS256);
        validation.set_required_spec_claims(&["exp", "sub"]);
        // `exp` and `nbf` are judged against the shared clock (`Auth::verify`),
        // not this process's own.
        validation.validate_exp = false;
        validation.validate_nbf = false;
        validation.leeway = leeway;
        Ok(Hs256 {
            encoding: EncodingKey::from_secret(secret).context("invalid user token secret")?,
            decoding: DecodingKey::from_secret(secret).context("invalid user token secret")?,
            validation,
        })
    }
}

impl Provider {
    fn from_settings(settings: &AuthSettings, verified: &Arc<Verified>) -> anyhow::Result<Self> {
        let pem_keys = settings
            .public_keys
            .iter()
            .map(|path| keys::from_pem_file(path))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let pem_keys = Arc::new(
            KeySet::new(pem_keys).context("auth.public_keys: two files have the same name")?,
        );
        let remote = settings
            .jwks_url
            .as_deref()
            .map(|url| RemoteKeys::new(url, settings, pem_keys.clone(), verified.clone()))
            .transpose()?
            .map(Arc::new);
        let mut required = vec!["exp", "sub"];
        // Without these, a token lacking the claim would pass the check.
        if settings.issuer.is_some() {
            required.push("iss");
        }
        if settings.audience.is_some() {
            required.push("aud");
        }
        let mut validation = Validation::new(Algorithm::RS256);
        validation.set_required_spec_claims(&required);
        // As for HS256: the shared clock judges `exp` and `nbf`.
        validation.validate_exp = false;
        validation.validate_nbf = false;
        validation.leeway = settings.leeway_secs;
        if let Some(issuer) = &settings.issuer {
            validation.set_issuer(&[issuer]);
        }
        match &settings.audience {
            Some(audience) => validation.set_audience(&[audience]),
            None => validation.validate_aud = false,
        }
        Ok(Provider {
            pem_keys,
            remote,
            validation,
        })
    }

    /// A key named `kid` in hand (PEM files first, then the JWKS).
    fn known_key(&self, kid: &str) -> Option<Arc<ProviderKey>> {
        if let Some(key) = self.pem_keys.get(kid) {
            return Some(key.clone());
        }
        self.remote
            .as_ref()
            .and_then(|remote| remote.current().get(kid).cloned())
    }

    /// Checks `token` with `key`, whose algorithm its header must name.
    fn verify_with(
        &self,
        key: &ProviderKey,
        header: &Header,
        token: &str,
    ) -> Result<TokenClaims, AppError> {
        if header.alg != key.alg {
            return Err(AppError::Unauthorized(
                "token algorithm is not allowed for its key",
            ));
        }
        let mut validation = self.validation.clone();
        validation.algorithms = vec![key.alg];
        jsonwebtoken::decode::<TokenClaims>(token, &key.key, &validation)
            .map(|data| data.claims)
            .map_err(refusal)
    }

    /// Checks a token that names no key with the one provider key of its
    /// algorithm; with two or more, which one signed it is not the token's to
    /// leave open (it is refused).
    fn verify_unnamed(&self, header: &Header, token: &str) -> Result<TokenClaims, AppError> {
        let remote = self.remote.as_ref().map(|r| r.current());
        let mut candidates = self
            .pem_keys
            .for_alg(header.alg)
            .chain(remote.iter().flat_map(|set| set.for_alg(header.alg)));
        match (candidates.next(), candidates.next()) {
            (Some(key), None) => self.verify_with(key, header, token),
            (None, _) => Err(AppError::Unauthorized(
                "token algorithm is not allowed for any key",
            )),
            (Some(_), Some(_)) => Err(AppError::Unauthorized(
                "token names no key (kid) and more than one key could have signed it",
            )),
        }
    }
}

const SIGNATURE_INVALID: &str = "token signature is invalid";

/// The `401` for a token `jsonwebtoken` refused.
fn refusal(err: jsonwebtoken::errors::Error) -> AppError {
    AppError::Unauthorized(match err.kind() {
        ErrorKind::ExpiredSignature => "token expired",
        ErrorKind::ImmatureSignature => "token not valid yet (nbf)",
        ErrorKind::InvalidSignature
        | ErrorKind::InvalidEcdsaKey
        | ErrorKind::InvalidRsaKey(_)
        | ErrorKind::InvalidKeyFormat => SIGNATURE_INVALID,
        ErrorKind::InvalidIssuer => "token issuer (iss) is not accepted",
        ErrorKind::InvalidAudience => "token audience (aud) is not accepted",
        ErrorKind::InvalidAlgorithm => "token algorithm is not allowed for its key",
        ErrorKind::MissingRequiredClaim(claim) => match claim.as_str() {
            "exp" => "token has no expiry (exp)",
            "sub" => "token has no subject (sub)",
            "iss" => "token has no issuer (iss)",
            "aud" => "token has no audience (aud)",
            _ => "token lacks a required claim",
        },
        _ => "token is malformed",
    })
}

/// The token of `Authorization: Bearer <token>`.
pub fn bearer(headers: &HeaderMap) -> Result<&str, AppError> {
    let value = headers
        .get(header::AUTHORIZATION)
        .ok_or(AppError::Unauthorized("missing Authorization header"))?
        .to_str()
        .map_err(|_| AppError::Unauthorized("Authorization header is not text"))?;
    let (scheme, token) = value.split_once(' ').ok_or(AppError::Unauthorized(
        "expected Authorization: Bearer <token>",
    ))?;
    if !scheme.eq_ignore_ascii_case("bearer") || token.trim().is_empty() {
        return Err(AppError::Unauthorized(
            "expected Authorization: Bearer <token>",
        ));
    }
    Ok(token.trim())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;
    use serde_json::{json, Value};

    const ISSUER: &str = "https://idp.test/realms/shop";

    fn auth() -> Auth {
        Auth::new(
            SecretString::from("admin-token-0123456789"),
            &SecretString::from("user-secret-0123456789"),
        )
        .expect("auth")
        .with_verified_tokens(100)
    }

    fn headers(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_str(v).expect("header"),
        );
        h
    }

    fn bearer_of(token: &str) -> HeaderMap {
        headers(&format!("Bearer {token}"))
    }

    #[tokio::test]
    async fn round_trip_and_rejections() {
        let a = auth();
        let t = a.issue("alice", 60).expect("issue");
        let u = a.user(&bearer_of(&t)).await.expect("valid");
        assert_eq!(&*u.id, "alice");
        assert!(a.user(&HeaderMap::new()).await.is_err());
        assert!(a.user(&headers("Bearer nonsense")).await.is_err());
        assert!(a.user(&headers(&format!("Basic {t}"))).await.is_err());
        let expired = a.issue("alice", -120).expect("issue");
        let err = a.user(&bearer_of(&expired)).await.expect_err("expired");
        assert_eq!(err.to_string(), "token expired");
        let other = Auth::new(
            SecretString::from("admin-token-0123456789"),
            &SecretString::from("another-secret-0123456"),
        )
        .expect("auth");
        let forged = other.issue("alice", 60).expect("issue");
        assert!(a.user(&bearer_of(&forged)).await.is_err());
        assert!(a.issue("bad\nid", 60).is_err());
        // Without an identity provider, other algorithms are refused outright.
        let rs = TestSigner::rsa().sign(&provider_claims("alice"));
        let err = a.user(&bearer_of(&rs)).await.expect_err("no provider");
        assert_eq!(err.to_string(), "token algorithm is not accepted");
    }

    /// `exp` and `nbf` follow the service's clock (the shared one), not this
    /// process's: ten minutes ahead of it, a token this process thinks has a
    /// minute left has expired; ten minutes behind, one valid from five minutes
    /// on is not valid yet.
    #[tokio::test]
    async fn token_times_follow_the_services_clock() {
        let own = chrono::Utc::now();
        let ahead = auth().with_clock(Clock::fixed_at(own + chrono::Duration::minutes(10)));
        let t = auth().issue("alice", 60).expect("issue");
        let err = ahead.user(&bearer_of(&t)).await.expect_err("expired");
        assert_eq!(err.to_string(), "token expired");
        let behind = auth().with_clock(Clock::fixed_at(own - chrono::Duration::minutes(10)));
        let later = hs256(
            b"user-secret-0123456789",
            None,
            &json!({"sub": "bob", "exp": own.timestamp() + 3600, "nbf": own.timestamp() - 300}),
        );
        let err = behind.user(&bearer_of(&later)).await.expect_err("not yet");
        assert_eq!(err.to_string(), "token not valid yet (nbf)");
        // By this process's own clock, both are fine.
        assert!(auth().user(&bearer_of(&t)).await.is_ok());
        assert!(auth().user(&bearer_of(&later)).await.is_ok());
        // Issued by a service whose clock is ahead, a token's expiry follows it.
        let issued = ahead.issue("cy", 60).expect("issue");
        assert!(ahead.user(&bearer_of(&issued)).await.is_ok());
    }

    #[tokio::test]
    async fn a_verified_token_is_remembered_until_it_expires() {
        let a = auth();
        let t = a.issue("bob", 60).expect("issue");
        let h = bearer_of(&t);
        assert_eq!(&*a.user(&h).await.expect("first").id, "bob");
        assert_eq!(a.verified.full_checks(), 1);
        assert_eq!(&*a.user(&h).await.expect("remembered").id, "bob");
        assert_eq!(a.verified.full_checks(), 1, "answered from the cache");
        // Verified while a key was withdrawn (a clear between the generation
        // read and the put): not remembered.
        let racing = a.issue("racer", 60).expect("issue");
        let generation = a.verified.generation();
        a.verified.clear();
        let exp = jsonwebtoken::get_current_timestamp() as i64 + 60;
        a.verified
            .put(&racing, &User { id: "racer".into() }, exp, generation);
        assert!(a.verified.get(&racing, 0).is_none(), "put after a clear");
        a.user(&h).await.expect("verified again after the clear");
        assert_eq!(a.verified.full_checks(), 3);
        // A tampered copy of a remembered token is a different string: verified
        // in full, and refused.
        let mut tampered = t.clone();
        tampered.pop();
        assert!(a.user(&bearer_of(&tampered)).await.is_err());
        // An entry past its expiry is not a pass: the token is verified again.
        let now = jsonwebtoken::get_current_timestamp() as i64;
        let generation = a.verified.generation();
        a.verified
            .put(&t, &User { id: "bob".into() }, now - 60, generation);
        assert!(a.verified.get(&t, now - 5).is_none());
        // Full: emptied, and the newest kept.
        let small = auth().with_verified_tokens(2);
        for name in ["a1", "a2", "a3"] {
            let t = small.issue(name, 60).expect("issue");
            small.user(&bearer_of(&t)).await.expect("valid");
        }
        assert_eq!(small.verified.len(), 1);
        let off = auth().with_verified_tokens(0);
        off.user(&h).await.expect("valid");
        assert_eq!(off.verified.len(), 0);
    }

    #[test]
    fn admin_token() {
        let a = auth();
        assert!(a.admin(&headers("Bearer admin-token-0123456789")).is_ok());
        assert!(a.admin(&headers("Bearer admin-token-012345678")).is_err());
        assert!(a.admin(&HeaderMap::new()).is_err());
    }

    /// Signs with a test-only key of `testkit/keys/`.
    struct TestSigner {
        kid: &'static str,
        alg: Algorithm,
        key: EncodingKey,
        public_pem: &'static str,
    }

    impl TestSigner {
        fn rsa() -> Self {
            let (_, der) = pem_rfc7468::decode_vec(include_bytes!(
                "../../testkit/keys/test-only-rsa-a.key.pem"
            ))
            .expect("PEM");
            TestSigner {
                kid: "rsa-a",
                alg: Algorithm::RS256,
                key: EncodingKey::from_rsa_der(&der),
                public_pem: include_str!("../../testkit/keys/test-only-rsa-a.pub.pem"),
            }
        }

        fn ec() -> Self {
            let (_, der) = pem_rfc7468::decode_vec(include_bytes!(
                "../../testkit/keys/test-only-ec-a.key.pem"
            ))
            .expect("PEM");
            TestSigner {
                kid: "ec-a",
                alg: Algorithm::ES256,
                key: EncodingKey::from_ec_der(&der),
                public_pem: include_str!("../../testkit/keys/test-only-ec-a.pub.pem"),
            }
        }

        fn sign(&self, claims: &Value) -> String {
            self.sign_with_kid(Some(self.kid), claims)
        }

        fn sign_with_kid(&self, kid: Option<&str>, claims: &Value) -> String {
            let mut header = Header::new(self.alg);
            header.kid = kid.map(str::to_owned);
            jsonwebtoken::encode(&header, claims, &self.key).expect("signs")
        }
    }

    fn provider_claims(user: &str) -> Value {
        let now = chrono::Utc::now().timestamp();
        json!({"sub": user, "exp": now + 600, "iss": ISSUER, "aud": "flashsale"})
    }

    fn hs256(secret: &[u8], kid: Option<&str>, claims: &Value) -> String {
        let mut header = Header::new(Algorithm::HS256);
        header.kid = kid.map(str::to_owned);
        jsonwebtoken::encode(
            &header,
            claims,
            &EncodingKey::from_secret(secret).expect("key"),
        )
        .expect("signs")
    }

    /// An `Auth` trusting the test RSA and EC keys as PEM files (kids `rsa-a`
    /// and `ec-a`), with an issuer and an audience.
    fn with_pem_keys(dir: &std::path::Path, hs256: bool) -> Auth {
        let mut paths = Vec::new();
        for signer in [TestSigner::rsa(), TestSigner::ec()] {
            let path = dir.join(format!("{}.pem", signer.kid));
            std::fs::write(&path, signer.public_pem).expect("write");
            paths.push(path);
        }
        let dev = crate::config::Settings::load_from(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config"),
            "development",
        )
        .expect("config");
        let mut settings = dev.auth;
        settings.public_keys = paths;
        settings.issuer = Some(ISSUER.into());
        settings.audience = Some("flashsale".into());
        settings.hs256 = hs256;
        settings.verified_tokens = 10;
        Auth::from_settings(&settings).expect("auth")
    }

    #[tokio::test]
    async fn identity_provider_tokens_and_what_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = with_pem_keys(dir.path(), true);
        let (rsa, ec) = (TestSigner::rsa(), TestSigner::ec());
        let refused = |token: String, why: &'static str| {
            let a = a.clone();
            async move {
                let err = a.user(&bearer_of(&token)).await.expect_err(why);
                assert!(matches!(err, AppError::Unauthorized(_)), "{why}: {err}");
                err.to_string()
            }
        };
        for signer in [&rsa, &ec] {
            let user = a
                .user(&bearer_of(&signer.sign(&provider_claims("carol"))))
                .await
                .expect("a provider token");
            assert_eq!(&*user.id, "carol");
            // No kid: the one key of its algorithm.
            let token = signer.sign_with_kid(None, &provider_claims("dave"));
            assert_eq!(
                &*a.user(&bearer_of(&token)).await.expect("no kid").id,
                "dave"
            );
        }
        // An unknown kid (no JWKS to ask).
        let msg = refused(
            rsa.sign_with_kid(Some("nope"), &provider_claims("u1")),
            "unknown kid",
        )
        .await;
        assert_eq!(msg, "token key id (kid) is unknown");
        // An RSA signature under the EC key's kid, and the other way round.
        let msg = refused(
            rsa.sign_with_kid(Some("ec-a"), &provider_claims("u2")),
            "alg for key",
        )
        .await;
        assert_eq!(msg, "token algorithm is not allowed for its key");
        refused(
            ec.sign_with_kid(Some("rsa-a"), &provider_claims("u2")),
            "alg for key",
        )
        .await;
        // The key-confusion attack: HMAC with the public key as the secret, with
        // or without the key's kid, HS256 on or off.
        let confused = |kid| hs256(rsa.public_pem.as_bytes(), kid, &provider_claims("mallory"));
        let msg = refused(confused(Some("rsa-a")), "confusion with kid").await;
        assert_eq!(msg, "token algorithm is not allowed for its key");
        let msg = refused(confused(None), "confusion without kid").await;
        assert_eq!(msg, "token signature is invalid");
        // Issuer and audience.
        let mut claims = provider_claims("u3");
        claims["iss"] = json!("https://evil.test");
        let msg = refused(rsa.sign(&claims), "issuer").await;
        assert_eq!(msg, "token issuer (iss) is not accepted");
        claims = provider_claims("u3");
        claims.as_object_mut().expect("object").remove("iss");
        assert_eq!(
            refused(rsa.sign(&claims), "no issuer").await,
            "token has no issuer (iss)"
        );
        claims = provider_claims("u3");
        claims["aud"] = json!(["other-app"]);
        let msg = refused(rsa.sign(&claims), "audience").await;
        assert_eq!(msg, "token audience (aud) is not accepted");
        claims = provider_claims("u3");
        claims.as_object_mut().expect("object").remove("exp");
        assert_eq!(
            refused(rsa.sign(&claims), "no exp").await,
            "token has no expiry (exp)"
        );
        claims = provider_claims("auth0|u3\u{202E}");
        assert_eq!(
            refused(rsa.sign(&claims), "subject").await,
            "token subject is not a valid user id"
        );
        // The provider's own form of id is a user id.
        claims = provider_claims("auth0|u3");
        assert_eq!(
            &*a.user(&bearer_of(&rsa.sign(&claims)))
                .await
                .expect("an Auth0 subject")
                .id,
            "auth0|u3"
        );
        // Expired beyond the leeway (30 s), and within it.
        claims = provider_claims("u4");
        claims["exp"] = json!(chrono::Utc::now().timestamp() - 120);
        assert_eq!(refused(rsa.sign(&claims), "expired").await, "token expired");
        claims["exp"] = json!(chrono::Utc::now().timestamp() - 5);
        a.user(&bearer_of(&rsa.sign(&claims)))
            .await
            .expect("within the leeway");
        // The service's own HS256 tokens still work beside the provider's.
        let own = a.issue("erin", 60).expect("issue");
        assert_eq!(&*a.user(&bearer_of(&own)).await.expect("HS256").id, "erin");
    }

    #[tokio::test]
    async fn a_token_without_kid_needs_a_single_key_of_its_algorithm() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = with_pem_keys(dir.path(), true);
        let rsa = TestSigner::rsa();
        let token = rsa.sign_with_kid(None, &provider_claims("kidless"));
        a.user(&bearer_of(&token)).await.expect("one RSA key");
        // A second RSA key: which one signed is no longer the token's to leave open.
        let mut settings = dev_auth();
        settings.public_keys = vec![dir.path().join("rsa-a.pem"), dir.path().join("rsa-b.pem")];
        std::fs::write(
            &settings.public_keys[1],
            include_str!("../../testkit/keys/test-only-rsa-b.pub.pem"),
        )
        .expect("write");
        let two = Auth::from_settings(&settings).expect("auth");
        let err = two
            .user(&bearer_of(&token))
            .await
            .expect_err("two RSA keys");
        assert_eq!(
            err.to_string(),
            "token names no key (kid) and more than one key could have signed it"
        );
        two.user(&bearer_of(&rsa.sign(&provider_claims("named"))))
            .await
            .expect("with its kid");
        // Two files of one name: refused at start, naming the setting.
        let other = tempfile::tempdir().expect("tempdir");
        let again = other.path().join("rsa-a.pem");
        std::fs::write(&again, rsa.public_pem).expect("write");
        settings.public_keys = vec![dir.path().join("rsa-a.pem"), again];
        let err = Auth::from_settings(&settings)
            .err()
            .expect("same stem twice");
        assert!(format!("{err:#}").contains("auth.public_keys"), "{err:#}");
    }

    fn dev_auth() -> AuthSettings {
        let mut settings = crate::config::Settings::load_from(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config"),
            "development",
        )
        .expect("config")
        .auth;
        settings.issuer = Some(ISSUER.into());
        settings.audience = Some("flashsale".into());
        settings
    }

    #[tokio::test]
    async fn hs256_can_be_turned_off() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = with_pem_keys(dir.path(), false);
        let own = auth().issue("erin", 60).expect("issue");
        let err = a.user(&bearer_of(&own)).await.expect_err("HS256 off");
        assert_eq!(err.to_string(), "HS256 tokens are not accepted");
        assert!(a.issue("erin", 60).is_err(), "nothing to sign with");
        let rs = TestSigner::rsa().sign(&provider_claims("carol"));
        a.user(&bearer_of(&rs))
            .await
            .expect("provider tokens still work");
    }

    #[tokio::test]
    async fn verify_claims_returns_the_role_of_provider_tokens_only() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = with_pem_keys(dir.path(), true);
        let mut claims = provider_claims("ops-lead");
        claims["role"] = json!("operator");
        let verified = a
            .verify_claims(&TestSigner::ec().sign(&claims))
            .await
            .expect("an operator token");
        assert_eq!(verified.sub, "ops-lead");
        assert_eq!(verified.role.as_deref(), Some("operator"));
        assert_eq!(verified.iss.as_deref(), Some(ISSUER));
        let plain = a
            .verify_claims(&TestSigner::rsa().sign(&provider_claims("someone")))
            .await
            .expect("a token without a role");
        assert_eq!(plain.role, None);
        // The service's own secret never signs a role.
        let secret_signed = hs256(b"user-secret-0123456789", None, &claims);
        let err = a.verify_claims(&secret_signed).await.expect_err("HS256");
        assert_eq!(
            err.to_string(),
            "token is not signed by the identity provider"
        );
        claims["iss"] = json!("https://evil.test");
        assert!(a
            .verify_claims(&TestSigner::ec().sign(&claims))
            .await
            .is_err());
    }
}
