//! Identity: user JWTs (HS256, `sub` + `exp`) and the admin bearer token.

use std::sync::Arc;

use anyhow::Context;
use axum::http::{header, HeaderMap};
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize};
use subtle::ConstantTimeEq;

use crate::activity::is_valid_id;
use crate::error::AppError;

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
}

impl Auth {
    /// Fails only on an empty secret (config validation already refuses one).
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
        })
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
        Ok(User {
            id: data.claims.sub.into(),
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
}

fn bearer(headers: &HeaderMap) -> Result<&str, AppError> {
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

    fn auth() -> Auth {
        Auth::new(
            SecretString::from("admin-token-0123456789"),
            &SecretString::from("user-secret-0123456789"),
        )
        .expect("auth")
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
    fn admin_token() {
        let a = auth();
        assert!(a.admin(&headers("Bearer admin-token-0123456789")).is_ok());
        assert!(a.admin(&headers("Bearer admin-token-012345678")).is_err());
        assert!(a.admin(&HeaderMap::new()).is_err());
    }
}
