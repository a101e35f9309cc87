//! Identity: user JWTs (HS256, `sub` + `exp`) and the admin bearer token.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use axum::http::{header, HeaderMap};
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize};
use subtle::ConstantTimeEq;

use crate::config::AuthSettings;
use crate::error::AppError;
use crate::input::is_valid_id;

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

#[derive(Clone)]
pub struct Auth {
    admin_token: SecretString,
    encoding: EncodingKey,
    decoding: DecodingKey,
    validation: Validation,
    verified: Arc<Verified>,
}

/// Tokens this process has verified in full, with their subject and expiry, so a
/// user's next click costs one hash lookup instead of an HMAC and two JSON
/// parses (the cache of verified JWTs API gateways keep). Only a token that passed
/// every check enters; a hit checks the expiry again. The signing key never
/// changes in a running process, so an entry stays as good as a verification.
/// Bounded: emptied when full.
struct Verified {
    capacity: usize,
    /// Token → (user id, expiry in seconds since the epoch).
    tokens: Mutex<HashMap<Box<str>, VerifiedUser>>,
}

type VerifiedUser = (Arc<str>, i64);

impl Auth {
    /// The service's tokens as configured, keeping `auth.verified_tokens`
    /// verified tokens.
    pub fn from_settings(settings: &AuthSettings) -> anyhow::Result<Self> {
        Ok(
            Self::new(settings.admin_token.clone(), &settings.user_token_secret)?
                .with_verified_tokens(settings.verified_tokens),
        )
    }

    /// Fails only on an empty secret (config validation already refuses one).
    /// Keeps no verified token until `with_verified_tokens` says how many: the
    /// service's number is a setting (`auth.verified_tokens`).
    pub fn new(
        admin_token: SecretString,
        user_token_secret: &SecretString,
    ) -> anyhow::Result<Self> {
        let secret = user_token_secret.expose_secret().as_bytes();
        let mut validation = Validation::new(Algorithm::HS256);
        validation.set_required_spec_claims(&["exp", "sub"]);
        // A token that says it is not valid yet is not valid yet.
        validation.validate_nbf = true;
        validation.leeway = 5;
        Ok(Auth {
            admin_token,
            encoding: EncodingKey::from_secret(secret).context("invalid user token secret")?,
            decoding: DecodingKey::from_secret(secret).context("invalid user token secret")?,
            validation,
            verified: Arc::new(Verified {
                capacity: 0,
                tokens: Mutex::default(),
            }),
        })
    }

    /// Keeps at most `capacity` verified tokens (0: verify every request in full).
    pub fn with_verified_tokens(mut self, capacity: usize) -> Self {
        self.verified = Arc::new(Verified {
            capacity,
            tokens: Mutex::default(),
        });
        self
    }

    /// Signs a user token valid for `ttl_secs`.
    pub fn issue(&self, user_id: &str, ttl_secs: i64) -> anyhow::Result<String> {
        if !is_valid_id(user_id) {
            anyhow::bail!("user id must be 1 to 64 characters of A-Z, a-z, 0-9, '_' or '-'");
        }
        let claims = Claims {
            sub: user_id.to_owned(),
            exp: chrono::Utc::now().timestamp() + ttl_secs,
        };
        Ok(jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &claims,
            &self.encoding,
        )?)
    }

    /// Verifies `Authorization: Bearer <JWT>` and returns the user.
    pub fn user(&self, headers: &HeaderMap) -> Result<User, AppError> {
        let token = bearer(headers)?;
        let now = jsonwebtoken::get_current_timestamp() as i64;
        if let Some(user) = self
            .verified
            .get(token, now - self.validation.leeway as i64)
        {
            return Ok(user);
        }
        let data = jsonwebtoken::decode::<Claims>(token, &self.decoding, &self.validation)
            .map_err(|e| match e.kind() {
                jsonwebtoken::errors::ErrorKind::ExpiredSignature => {
                    AppError::Unauthorized("token expired")
                }
                jsonwebtoken::errors::ErrorKind::ImmatureSignature => {
                    AppError::Unauthorized("token not valid yet (nbf)")
                }
                jsonwebtoken::errors::ErrorKind::InvalidSignature => {
                    AppError::Unauthorized("token signature is invalid")
                }
                _ => AppError::Unauthorized("token is malformed"),
            })?;
        if !is_valid_id(&data.claims.sub) {
            return Err(AppError::Unauthorized(
                "token subject is not a valid user id",
            ));
        }
        let user = User {
            id: data.claims.sub.into(),
        };
        self.verified.put(token, &user, data.claims.exp);
        Ok(user)
    }

    /// Checks `Authorization: Bearer <admin token>` in constant time: the shared
    /// token only; `operators::Operators` names every admin caller.
    pub fn admin(&self, headers: &HeaderMap) -> Result<(), AppError> {
        let token = bearer(headers)?;
        let expected = self.admin_token.expose_secret().as_bytes();
        if bool::from(token.as_bytes().ct_eq(expected)) {
            Ok(())
        } else {
            Err(AppError::Unauthorized("admin token required"))
        }
    }
}

/// The token of `Authorization: Bearer <token>`, or `401`.
pub(crate) fn bearer(headers: &HeaderMap) -> Result<&str, AppError> {
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

impl Verified {
    /// The user of a token verified before and not expired at `oldest_exp`.
    fn get(&self, token: &str, oldest_exp: i64) -> Option<User> {
        if self.capacity == 0 {
            return None;
        }
        let tokens = self.tokens.lock().unwrap_or_else(|e| e.into_inner());
        match tokens.get(token) {
            Some((id, exp)) if *exp >= oldest_exp => Some(User { id: id.clone() }),
            _ => None,
        }
    }

    fn put(&self, token: &str, user: &User, exp: i64) {
        if self.capacity == 0 {
            return;
        }
        let mut tokens = self.tokens.lock().unwrap_or_else(|e| e.into_inner());
        if tokens.len() >= self.capacity {
            tokens.clear();
        }
        tokens.insert(token.into(), (user.id.clone(), exp));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

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

    #[test]
    fn round_trip_and_rejections() {
        let a = auth();
        let t = a.issue("alice", 60).expect("issue");
        let u = a.user(&headers(&format!("Bearer {t}"))).expect("valid");
        assert_eq!(&*u.id, "alice");
        assert!(a.user(&HeaderMap::new()).is_err());
        assert!(a.user(&headers("Bearer nonsense")).is_err());
        assert!(a.user(&headers(&format!("Basic {t}"))).is_err());
        let expired = a.issue("alice", -120).expect("issue");
        let err = a
            .user(&headers(&format!("Bearer {expired}")))
            .expect_err("expired");
        assert_eq!(err.to_string(), "token expired");
        let other = Auth::new(
            SecretString::from("admin-token-0123456789"),
            &SecretString::from("another-secret-0123456"),
        )
        .expect("auth");
        let forged = other.issue("alice", 60).expect("issue");
        assert!(a.user(&headers(&format!("Bearer {forged}"))).is_err());
        assert!(a.issue("bad id", 60).is_err());
    }

    #[test]
    fn a_verified_token_is_remembered_until_it_expires() {
        let a = auth();
        let t = a.issue("bob", 60).expect("issue");
        let h = headers(&format!("Bearer {t}"));
        assert_eq!(&*a.user(&h).expect("first").id, "bob");
        assert_eq!(&*a.user(&h).expect("remembered").id, "bob");
        // A tampered copy of a remembered token is a different string: verified
        // in full, and refused.
        let mut tampered = t.clone();
        tampered.pop();
        assert!(a.user(&headers(&format!("Bearer {tampered}"))).is_err());
        // An entry past its expiry is not a pass: the token is verified again.
        let now = jsonwebtoken::get_current_timestamp() as i64;
        a.verified.put(&t, &User { id: "bob".into() }, now - 60);
        assert!(a.verified.get(&t, now - 5).is_none());
        // Full: emptied, and the newest kept.
        let small = auth().with_verified_tokens(2);
        for name in ["a1", "a2", "a3"] {
            let t = small.issue(name, 60).expect("issue");
            small.user(&headers(&format!("Bearer {t}"))).expect("valid");
        }
        assert_eq!(small.verified.tokens.lock().expect("lock").len(), 1);
        let off = auth().with_verified_tokens(0);
        off.user(&h).expect("valid");
        assert!(off.verified.tokens.lock().expect("lock").is_empty());
    }

    #[test]
    fn admin_token() {
        let a = auth();
        assert!(a.admin(&headers("Bearer admin-token-0123456789")).is_ok());
        assert!(a.admin(&headers("Bearer admin-token-012345678")).is_err());
        assert!(a.admin(&HeaderMap::new()).is_err());
    }
}
