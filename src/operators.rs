//! Who is acting on `/admin/*`: an operator, named, or the holder of the
//! shared token.
//!
//! A bearer token is tried, in this order, as
//! 1. the shared `auth.admin_token` (`Auth::admin`, constant time): recorded as
//!    `admin_token`, via `shared`;
//! 2. one of the named `auth.operators` tokens, each compared in constant time,
//!    all of them every time (the time taken does not say which one, or how
//!    close a guess came): recorded by that name, via `named`;
//! 3. a JWT from the service's identity provider with `role: "operator"`:
//!    recorded by its `sub`, via `jwt` (verified by `Auth::verify_claims`
//!    with the provider's keys only).
//!
//! Anything else is `401`: a user's token without the role too.

use std::sync::Arc;

use axum::http::HeaderMap;
use secrecy::{ExposeSecret, SecretString};
use subtle::{Choice, ConstantTimeEq};

use crate::auth::{bearer, Auth};
use crate::config::{AuthSettings, SHARED_TOKEN_NAME};
use crate::error::AppError;

/// The `role` claim that makes a JWT an operator's.
pub const OPERATOR_ROLE: &str = "operator";

/// How an operator proved who they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// The shared `auth.admin_token`: whoever holds it.
    Shared,
    /// A named `auth.operators` token.
    Named,
    /// A JWT with `role: "operator"`.
    Jwt,
}

impl Via {
    pub fn as_str(self) -> &'static str {
        match self {
            Via::Shared => "shared",
            Via::Named => "named",
            Via::Jwt => "jwt",
        }
    }
}

/// The authenticated caller of an admin endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Operator {
    pub name: Arc<str>,
    pub via: Via,
}

/// The admin credentials: the shared token (held by `Auth`) and the named
/// ones; operators' JWTs are verified by `Auth` like the identity provider's
/// user tokens.
#[derive(Clone)]
pub struct Operators {
    named: Arc<[(Arc<str>, SecretString)]>,
}

impl Operators {
    /// The credentials of `auth` (validated when the settings were loaded).
    pub fn from_settings(settings: &AuthSettings) -> anyhow::Result<Self> {
        let named = settings
            .operators
            .0
            .iter()
            .map(|op| (Arc::<str>::from(op.name.as_str()), op.token.clone()))
            .collect();
        Ok(Operators { named })
    }

    /// The operator behind `Authorization: Bearer …`, or `401`.
    pub async fn identify(&self, auth: &Auth, headers: &HeaderMap) -> Result<Operator, AppError> {
        let token = bearer(headers)?;
        if auth.admin(headers).is_ok() {
            return Ok(Operator {
                name: SHARED_TOKEN_NAME.into(),
                via: Via::Shared,
            });
        }
        if let Some(name) = self.named(token) {
            return Ok(Operator {
                name,
                via: Via::Named,
            });
        }
        // Not an admin token; perhaps an operator's JWT. Only a token that looks
        // like one (three dot-separated parts) is verified: a mistyped admin
        // token is told so, not "token is malformed".
        if token.split('.').count() != 3 {
            return Err(AppError::Unauthorized("admin or operator token required"));
        }
        // Only the identity provider's keys verify it (`Auth::verify_claims`):
        // the service's own HS256 secret never grants a role.
        let claims = auth.verify_claims(token).await?;
        if claims.role.as_deref() != Some(OPERATOR_ROLE) {
            return Err(AppError::Unauthorized(
                "this token carries no operator role (role: \"operator\")",
            ));
        }
        if !auth.user_ids().accepts(&claims.sub) {
            return Err(AppError::Unauthorized(
                "the operator token's subject is not a valid name",
            ));
        }
        Ok(Operator {
            name: claims.sub.into(),
            via: Via::Jwt,
        })
    }

    /// The named operator whose token this is: every named token is compared,
    /// in constant time, whatever matched before.
    fn named(&self, token: &str) -> Option<Arc<str>> {
        let mut found = None;
        for (name, expected) in self.named.iter() {
            let same: Choice = token.as_bytes().ct_eq(expected.expose_secret().as_bytes());
            if bool::from(same) {
                found = Some(name.clone());
            }
        }
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::{header, HeaderValue};
    use jsonwebtoken::{Algorithm, EncodingKey, Header};

    const SECRET: &str = "user-secret-0123456789";

    /// The default settings' `auth`, with these secrets and operators.
    fn settings(operators: &str) -> AuthSettings {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
        let mut auth = crate::config::Settings::load_from(&dir, "development")
            .expect("default config loads")
            .auth;
        auth.admin_token = SecretString::from("admin-token-0123456789");
        auth.user_token_secret = SecretString::from(SECRET);
        auth.operators = crate::config::OperatorCredentials::parse_list(operators).expect("parses");
        auth
    }

    fn headers(token: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_str(&format!("Bearer {token}")).expect("header"),
        );
        h
    }

    fn jwt(claims: serde_json::Value, secret: &str) -> String {
        jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &claims,
            &EncodingKey::from_secret(secret.as_bytes()).expect("a key"),
        )
        .expect("signed")
    }

    #[tokio::test]
    async fn each_kind_of_credential_names_its_operator() {
        let s = settings("alice:Alice-token-0123456789,bob:Bob-token-0123456789ab");
        let auth = Auth::new(s.admin_token.clone(), &s.user_token_secret).expect("auth");
        let ops = Operators::from_settings(&s).expect("operators");
        let who = |t: &str| {
            let h = headers(t);
            let (ops, auth) = (ops.clone(), auth.clone());
            async move { ops.identify(&auth, &h).await }
        };

        let shared = who("admin-token-0123456789").await.expect("shared");
        assert_eq!((&*shared.name, shared.via), ("admin_token", Via::Shared));
        let bob = who("Bob-token-0123456789ab").await.expect("bob");
        assert_eq!((&*bob.name, bob.via), ("bob", Via::Named));
        assert!(who("Bob-token-0123456789a").await.is_err());
        assert!(who("Alice-token-0123456789x").await.is_err());
        assert!(ops.identify(&auth, &HeaderMap::new()).await.is_err());

        let exp = chrono::Utc::now().timestamp() + 60;
        let op = jwt(
            serde_json::json!({"sub": "carol", "exp": exp, "role": "operator"}),
            SECRET,
        );
        // The service's own HS256 secret never grants a role: only the identity
        // provider's keys verify an operator's JWT (tests/api/audit.rs).
        assert!(who(&op).await.is_err(), "an HS256 operator token");
        // A user's token, another role, another key, expired: refused.
        let user = auth.issue("dave", 60).expect("user token");
        assert!(who(&user).await.is_err(), "a user is no operator");
        for bad in [
            jwt(
                serde_json::json!({"sub": "eve", "exp": exp, "role": "admin"}),
                SECRET,
            ),
            jwt(
                serde_json::json!({"sub": "eve", "exp": exp, "role": "operator"}),
                "another-secret-0123456",
            ),
            jwt(
                serde_json::json!({"sub": "eve", "exp": exp - 120, "role": "operator"}),
                SECRET,
            ),
            jwt(
                serde_json::json!({"sub": "e v e", "exp": exp, "role": "operator"}),
                SECRET,
            ),
        ] {
            assert!(who(&bad).await.is_err(), "{bad}");
        }
    }
}
