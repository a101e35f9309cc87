//! An identity provider for tests: fixed test-only key pairs (`testkit/keys/`)
//! that sign RS256 and ES256 tokens, and a JWKS endpoint on loopback port 0
//! whose key set a test changes while the service runs, and which it can make
//! answer an error, answer garbage, or stop.
//!
//! ```ignore
//! let idp = IdentityProvider::start(&[&TestKey::rsa_a()]).await;
//! // the service: auth.jwks_url = idp.jwks_url, auth.issuer = ISSUER, auth.audience = AUDIENCE
//! let token = TestKey::rsa_a().token("alice");
//! idp.publish(&[&TestKey::rsa_a(), &TestKey::rsa_b()]); // a key rotated in
//! idp.answer(Answer::Status(500));                       // the provider is down
//! ```

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use jsonwebtoken::jwk::{Jwk, PublicKeyUse};
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{json, Value};

/// The `iss` of the tokens [`claims`] makes.
pub const ISSUER: &str = "https://idp.flashsale.test/realms/shop";
/// The `aud` of the tokens [`claims`] makes.
pub const AUDIENCE: &str = "flashsale";

/// A test-only key pair of the provider, named by its `kid`.
#[derive(Clone)]
pub struct TestKey {
    pub kid: String,
    pub alg: Algorithm,
    /// The public key as a PEM file's text (for `auth.public_keys`).
    pub public_pem: &'static str,
    encoding: EncodingKey,
    jwk: Value,
}

fn load(
    cell: &'static OnceLock<TestKey>,
    kid: &str,
    alg: Algorithm,
    private_pem: &str,
    public_pem: &'static str,
) -> TestKey {
    cell.get_or_init(|| {
        let (_, der) = pem_rfc7468::decode_vec(private_pem.as_bytes()).expect("test key is PEM");
        let encoding = match alg {
            Algorithm::RS256 => EncodingKey::from_rsa_der(&der),
            _ => EncodingKey::from_ec_der(&der),
        };
        let mut jwk = Jwk::from_encoding_key(&encoding, alg).expect("test key makes a JWK");
        jwk.common.key_id = Some(kid.to_owned());
        jwk.common.public_key_use = Some(PublicKeyUse::Signature);
        TestKey {
            kid: kid.to_owned(),
            alg,
            public_pem,
            encoding,
            jwk: serde_json::to_value(&jwk).expect("a JWK is JSON"),
        }
    })
    .clone()
}

static RSA_A: OnceLock<TestKey> = OnceLock::new();
static RSA_B: OnceLock<TestKey> = OnceLock::new();
static EC_A: OnceLock<TestKey> = OnceLock::new();
static EC_B: OnceLock<TestKey> = OnceLock::new();

impl TestKey {
    /// RSA 2048, RS256, kid `rsa-a`.
    pub fn rsa_a() -> TestKey {
        load(
            &RSA_A,
            "rsa-a",
            Algorithm::RS256,
            include_str!("../keys/test-only-rsa-a.key.pem"),
            include_str!("../keys/test-only-rsa-a.pub.pem"),
        )
    }

    /// RSA 2048, RS256, kid `rsa-b`: the key rotated in.
    pub fn rsa_b() -> TestKey {
        load(
            &RSA_B,
            "rsa-b",
            Algorithm::RS256,
            include_str!("../keys/test-only-rsa-b.key.pem"),
            include_str!("../keys/test-only-rsa-b.pub.pem"),
        )
    }

    /// EC P-256, ES256, kid `ec-a`.
    pub fn ec_a() -> TestKey {
        load(
            &EC_A,
            "ec-a",
            Algorithm::ES256,
            include_str!("../keys/test-only-ec-a.key.pem"),
            include_str!("../keys/test-only-ec-a.pub.pem"),
        )
    }

    /// EC P-256, ES256, kid `ec-b`.
    pub fn ec_b() -> TestKey {
        load(
            &EC_B,
            "ec-b",
            Algorithm::ES256,
            include_str!("../keys/test-only-ec-b.key.pem"),
            include_str!("../keys/test-only-ec-b.pub.pem"),
        )
    }

    /// The same key under another `kid`.
    pub fn named(&self, kid: &str) -> TestKey {
        let mut key = self.clone();
        key.kid = kid.to_owned();
        key.jwk["kid"] = json!(kid);
        key
    }

    /// The public key as a JWK (`kty`, `kid`, `use`, `alg` and its values).
    pub fn jwk(&self) -> Value {
        self.jwk.clone()
    }

    /// A valid token for `user`: [`claims`] signed with this key, naming it.
    pub fn token(&self, user: &str) -> String {
        self.sign(&claims(user))
    }

    /// `claims` signed with this key's algorithm, the header naming the key.
    pub fn sign(&self, claims: &Value) -> String {
        self.sign_as(self.alg, Some(&self.kid), claims)
    }

    /// `claims` signed with this key, the header saying `alg` and `kid` as
    /// given (a header that lies about the algorithm, or names no key).
    pub fn sign_as(&self, alg: Algorithm, kid: Option<&str>, claims: &Value) -> String {
        let mut header = Header::new(alg);
        header.kid = kid.map(str::to_owned);
        if alg == self.alg {
            return jsonwebtoken::encode(&header, claims, &self.encoding)
                .expect("test token signs");
        }
        // jsonwebtoken signs with the header's algorithm: sign with the key's
        // own, then put the lying header in front of that signature.
        let signed = jsonwebtoken::encode(&Header::new(self.alg), claims, &self.encoding)
            .expect("test token signs");
        let signature = signed.rsplit('.').next().expect("three parts");
        let header = serde_json::to_value(&header).expect("a header is JSON");
        format!("{}{signature}", unsigned(&header, claims))
    }
}

/// Claims of a valid provider token for `user`: `sub`, `exp` in an hour, `iat`,
/// `iss` = [`ISSUER`], `aud` = [`AUDIENCE`].
pub fn claims(user: &str) -> Value {
    let now = chrono::Utc::now().timestamp();
    json!({"sub": user, "exp": now + 3600, "iat": now, "iss": ISSUER, "aud": AUDIENCE})
}

/// `claims` signed with HS256 using `secret`, with this `kid` if any (the
/// key-confusion attack passes a provider's public key as the secret).
pub fn sign_hs256(secret: &[u8], kid: Option<&str>, claims: &Value) -> String {
    let mut header = Header::new(Algorithm::HS256);
    header.kid = kid.map(str::to_owned);
    let key = EncodingKey::from_secret(secret).expect("a secret");
    jsonwebtoken::encode(&header, claims, &key).expect("HS256 signs")
}

/// A token of this header and these claims with an empty signature (`alg: none`).
pub fn unsigned(header: &Value, claims: &Value) -> String {
    use base64::Engine as _;
    let b64 = |v: &Value| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(v.to_string());
    format!("{}.{}.", b64(header), b64(claims))
}

/// What the JWKS endpoint answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// `200` with the published keys.
    Keys,
    /// This status, with a text body.
    Status(u16),
    /// `200` with a body that is not a JWKS.
    Garbage,
    /// `307 Temporary Redirect` to this URL.
    Redirect(String),
}

struct Shared {
    keys: Mutex<(Vec<Value>, Answer)>,
    requests: AtomicUsize,
}

/// A JWKS endpoint on loopback, stopped when dropped.
pub struct IdentityProvider {
    /// `http://127.0.0.1:<port>/jwks.json`.
    pub jwks_url: String,
    shared: Arc<Shared>,
    stop: Arc<tokio::sync::Notify>,
    server: tokio::task::JoinHandle<()>,
}

impl IdentityProvider {
    /// Serves `keys` on a port of its own.
    pub async fn start(keys: &[&TestKey]) -> IdentityProvider {
        let shared = Arc::new(Shared {
            keys: Mutex::new((keys.iter().map(|k| k.jwk()).collect(), Answer::Keys)),
            requests: AtomicUsize::new(0),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("JWKS listener binds");
        let port = listener.local_addr().expect("local address").port();
        let app = Router::new()
            .route("/jwks.json", get(jwks))
            .with_state(shared.clone());
        let stop = Arc::new(tokio::sync::Notify::new());
        let stopped = stop.clone();
        let server = tokio::spawn(async move {
            // Graceful, so that kept-alive connections close too.
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move { stopped.notified().await })
                .await;
        });
        IdentityProvider {
            jwks_url: format!("http://127.0.0.1:{port}/jwks.json"),
            shared,
            stop,
            server,
        }
    }

    /// From now on the key set is `keys` (a rotation: add a key, drop one).
    pub fn publish(&self, keys: &[&TestKey]) {
        self.lock().0 = keys.iter().map(|k| k.jwk()).collect();
    }

    /// From now on the endpoint answers so.
    pub fn answer(&self, answer: Answer) {
        self.lock().1 = answer;
    }

    /// Requests the endpoint has answered, whatever it answered.
    pub fn requests(&self) -> usize {
        self.shared.requests.load(Ordering::SeqCst)
    }

    /// Stops serving: new connections are refused, open ones closed.
    pub async fn stop(&self) {
        self.stop.notify_one();
        crate::eventually(
            std::time::Duration::from_secs(10),
            "the JWKS endpoint to stop",
            || async { self.server.is_finished().then_some(()) },
        )
        .await;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (Vec<Value>, Answer)> {
        self.shared.keys.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for IdentityProvider {
    fn drop(&mut self) {
        self.server.abort();
    }
}

async fn jwks(State(shared): State<Arc<Shared>>) -> Response {
    let (keys, answer) = shared
        .keys
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let response = match answer {
        Answer::Keys => axum::Json(json!({ "keys": keys })).into_response(),
        Answer::Status(code) => (
            StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            "the identity provider is down",
        )
            .into_response(),
        Answer::Garbage => "<html>maintenance</html>".into_response(),
        Answer::Redirect(to) => axum::response::Redirect::temporary(&to).into_response(),
    };
    shared.requests.fetch_add(1, Ordering::SeqCst);
    response
}
