//! An identity provider's public keys: read from a JWKS document or from PEM
//! files, each with the one algorithm it verifies.
//!
//! The algorithm comes from the key, never from a token: an RSA key verifies
//! RS256 (or the RSA algorithm its JWK names), an EC key the ECDSA algorithm of
//! its curve. A token whose header names another algorithm is refused before any
//! signature check, which closes the RS256 → HS256 confusion (an HMAC made with
//! the public key's bytes as the secret) and its kin.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context};
use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, Jwk, KeyAlgorithm, PublicKeyUse};
use jsonwebtoken::{Algorithm, DecodingKey};
use serde::Deserialize;

/// The most keys one JWKS document may bring; providers publish two or three.
pub const MAX_KEYS: usize = 32;

/// The smallest RSA modulus accepted from a PEM file.
const MIN_RSA_BITS: usize = 2048;

/// One public key of the identity provider.
pub struct ProviderKey {
    /// The `kid` tokens name it by (a PEM file's stem; none for a JWK without one).
    pub kid: Option<String>,
    /// The one algorithm this key verifies.
    pub alg: Algorithm,
    pub key: DecodingKey,
    /// SHA-256 of the key's public values (RFC 7638's thumbprint for a JWK,
    /// of the DER for a PEM key): a key replaced under the same `kid` differs.
    pub thumbprint: [u8; 32],
}

impl std::fmt::Debug for ProviderKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProviderKey")
            .field("kid", &self.kid)
            .field("alg", &self.alg)
            .finish_non_exhaustive()
    }
}

/// A set of keys, found by `kid`.
#[derive(Debug, Default)]
pub struct KeySet {
    by_kid: HashMap<String, Arc<ProviderKey>>,
    all: Vec<Arc<ProviderKey>>,
}

/// A JWKS document, each key kept as JSON so that one key of a kind this service
/// does not know (an encryption key, a new curve) does not spoil the others.
#[derive(Deserialize)]
struct JwksDocument {
    keys: Vec<serde_json::Value>,
}

impl KeySet {
    /// The set of `keys`; a `kid` met twice is an error (PEM files are read at
    /// start: two files with the same stem are a mistake to fix, not to guess).
    pub fn new(keys: Vec<ProviderKey>) -> anyhow::Result<Self> {
        let mut set = KeySet::default();
        for key in keys {
            if let Some(kid) = &key.kid {
                if set.by_kid.contains_key(kid) {
                    bail!("two keys are named {kid:?}: each kid must name one key");
                }
            }
            set.push(key);
        }
        Ok(set)
    }

    fn push(&mut self, key: ProviderKey) {
        let key = Arc::new(key);
        if let Some(kid) = &key.kid {
            self.by_kid.insert(kid.clone(), key.clone());
        }
        self.all.push(key);
    }

    /// Parses a JWKS document (`{"keys": [...]}`). Keys this service cannot use
    /// (encryption keys, other key types or curves, broken values) are skipped
    /// with a warning; a document with none it can use is an error, so that the
    /// keys in hand are kept. A `kid` the document repeats, or that `taken` (the
    /// PEM keys, which take precedence) already names, is skipped with a
    /// warning: the first key of that name is kept.
    pub fn from_jwks(body: &[u8], taken: &KeySet) -> anyhow::Result<Self> {
        let document: JwksDocument =
            serde_json::from_slice(body).context("the JWKS is not a JSON {\"keys\": [...]}")?;
        let mut keys = Vec::new();
        for value in document.keys {
            let kid = value.get("kid").and_then(|k| k.as_str()).map(str::to_owned);
            let parsed = serde_json::from_value::<Jwk>(value)
                .context("not a JWK")
                .and_then(|jwk| from_jwk(&jwk));
            match parsed {
                Ok(Some(key)) => {
                    let repeated = key.kid.as_deref().is_some_and(|kid| {
                        taken.get(kid).is_some()
                            || keys
                                .iter()
                                .any(|k: &ProviderKey| k.kid.as_deref() == Some(kid))
                    });
                    if repeated {
                        tracing::warn!(kid = kid.as_deref().unwrap_or("-"), "skipping a key of the JWKS: its kid names another key already (a PEM key, or an earlier key of the JWKS)");
                    } else {
                        keys.push(key);
                    }
                }
                Ok(None) => {}
                Err(err) => {
                    tracing::warn!(kid = kid.as_deref().unwrap_or("-"), error = %format!("{err:#}"), "skipping a key of the JWKS");
                }
            }
        }
        if keys.is_empty() {
            bail!("the JWKS holds no signing key this service can use");
        }
        if keys.len() > MAX_KEYS {
            bail!("the JWKS holds {} keys, more than {MAX_KEYS}", keys.len());
        }
        let mut set = KeySet::default();
        for key in keys {
            set.push(key);
        }
        Ok(set)
    }

    /// The key named `kid`.
    pub fn get(&self, kid: &str) -> Option<&Arc<ProviderKey>> {
        self.by_kid.get(kid)
    }

    /// Every key verifying `alg` (for a token that names no key).
    pub fn for_alg(&self, alg: Algorithm) -> impl Iterator<Item = &Arc<ProviderKey>> {
        self.all.iter().filter(move |k| k.alg == alg)
    }

    pub fn len(&self) -> usize {
        self.all.len()
    }

    /// Whether a key of this set is missing from `newer` (withdrawn by the
    /// provider, or replaced by other key material under the same `kid`):
    /// tokens remembered as verified may have been signed by it.
    pub fn loses_keys_in(&self, newer: &KeySet) -> bool {
        let kept: HashSet<(Option<&str>, &[u8; 32])> = newer
            .all
            .iter()
            .map(|k| (k.kid.as_deref(), &k.thumbprint))
            .collect();
        self.all
            .iter()
            .any(|k| !kept.contains(&(k.kid.as_deref(), &k.thumbprint)))
    }
}

/// A JWK as a key, or `None` for a key that is not for signatures.
fn from_jwk(jwk: &Jwk) -> anyhow::Result<Option<ProviderKey>> {
    if matches!(
        jwk.common.public_key_use,
        Some(PublicKeyUse::Encryption) | Some(PublicKeyUse::Other(_))
    ) {
        return Ok(None);
    }
    let declared = jwk.common.key_algorithm;
    let alg = match &jwk.algorithm {
        AlgorithmParameters::RSA(_) => match declared {
            None => Algorithm::RS256,
            Some(KeyAlgorithm::RS256) => Algorithm::RS256,
            Some(KeyAlgorithm::RS384) => Algorithm::RS384,
            Some(KeyAlgorithm::RS512) => Algorithm::RS512,
            Some(KeyAlgorithm::PS256) => Algorithm::PS256,
            Some(KeyAlgorithm::PS384) => Algorithm::PS384,
            Some(KeyAlgorithm::PS512) => Algorithm::PS512,
            Some(other) => bail!("an RSA key cannot be for {other:?}"),
        },
        AlgorithmParameters::EllipticCurve(params) => {
            let alg = match params.curve {
                EllipticCurve::P256 => Algorithm::ES256,
                EllipticCurve::P384 => Algorithm::ES384,
                ref other => bail!("curve {other:?} is not supported"),
            };
            if declared.is_some_and(|d| d != KeyAlgorithm::from(alg)) {
                bail!("an EC key on {:?} cannot be for {declared:?}", params.curve);
            }
            alg
        }
        AlgorithmParameters::OctetKey(_) => {
            // A shared secret in a public document would let anyone sign.
            bail!("a symmetric key (kty oct) is never accepted from a JWKS")
        }
        _ => bail!("key type not supported (RSA and EC only)"),
    };
    let key = DecodingKey::from_jwk(jwk).context("the key's values are not valid")?;
    Ok(Some(ProviderKey {
        kid: jwk.common.key_id.clone(),
        alg,
        key,
        thumbprint: jwk_thumbprint(&jwk.algorithm),
    }))
}

/// RFC 7638: SHA-256 of the key's required members, sorted, without spaces.
fn jwk_thumbprint(params: &AlgorithmParameters) -> [u8; 32] {
    let canonical = match params {
        AlgorithmParameters::RSA(rsa) => serde_json::json!({"e": rsa.e, "kty": "RSA", "n": rsa.n}),
        AlgorithmParameters::EllipticCurve(ec) => {
            serde_json::json!({"crv": ec.curve, "kty": "EC", "x": ec.x, "y": ec.y})
        }
        // Only RSA and EC keys get this far.
        _ => serde_json::Value::Null,
    };
    sha256(canonical.to_string().as_bytes())
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    let mut out = [0u8; 32];
    out.copy_from_slice(&sha2::Sha256::digest(bytes));
    out
}

/// A PEM public key file (RSA: `PUBLIC KEY` or `RSA PUBLIC KEY`; EC: `PUBLIC
/// KEY` on P-256 or P-384), named by its file stem.
pub fn from_pem_file(path: &Path) -> anyhow::Result<ProviderKey> {
    let pem = std::fs::read(path)
        .with_context(|| format!("cannot read auth.public_keys file {}", path.display()))?;
    let kid = path.file_stem().and_then(|s| s.to_str()).map(str::to_owned);
    let key = from_pem(&pem).with_context(|| {
        format!(
            "auth.public_keys file {} is not an RSA or EC public key in PEM",
            path.display()
        )
    })?;
    Ok(ProviderKey { kid, ..key })
}

/// A PEM public key without a name. RSA: `RSA PUBLIC KEY` (PKCS#1) or `PUBLIC
/// KEY` (SubjectPublicKeyInfo); EC: `PUBLIC KEY` on P-256 or P-384. The key's
/// type and curve are read from the key itself.
pub fn from_pem(pem: &[u8]) -> anyhow::Result<ProviderKey> {
    use spki::ObjectIdentifier;
    const RSA: ObjectIdentifier = ObjectIdentifier::new_unwrap("1.2.840.113549.1.1.1");
    const EC: ObjectIdentifier = ObjectIdentifier::new_unwrap("1.2.840.10045.2.1");
    const P256: ObjectIdentifier = ObjectIdentifier::new_unwrap("1.2.840.10045.3.1.7");
    const P384: ObjectIdentifier = ObjectIdentifier::new_unwrap("1.3.132.0.34");

    let (label, der) = pem_rfc7468::decode_vec(pem).map_err(|e| anyhow::anyhow!("not PEM: {e}"))?;
    let (alg, key) = match label {
        "RSA PUBLIC KEY" => {
            check_rsa(&der)?;
            (Algorithm::RS256, DecodingKey::from_rsa_der(&der))
        }
        "PUBLIC KEY" => {
            let info = spki::SubjectPublicKeyInfoRef::try_from(der.as_slice())
                .map_err(|e| anyhow::anyhow!("not a SubjectPublicKeyInfo: {e}"))?;
            let bits = info
                .subject_public_key
                .as_bytes()
                .context("the key's bit string is not whole bytes")?;
            let (oid, curve) = info
                .algorithm
                .oids()
                .map_err(|e| anyhow::anyhow!("unreadable key algorithm: {e}"))?;
            match (oid, curve) {
                (RSA, _) => {
                    check_rsa(bits)?;
                    (Algorithm::RS256, DecodingKey::from_rsa_der(bits))
                }
                (EC, Some(P256)) => {
                    p256::PublicKey::from_sec1_bytes(bits)
                        .map_err(|_| anyhow::anyhow!("not a point on P-256"))?;
                    (Algorithm::ES256, DecodingKey::from_ec_der(bits))
                }
                (EC, Some(P384)) => {
                    p384::PublicKey::from_sec1_bytes(bits)
                        .map_err(|_| anyhow::anyhow!("not a point on P-384"))?;
                    (Algorithm::ES384, DecodingKey::from_ec_der(bits))
                }
                (EC, curve) => bail!("EC keys on P-256 or P-384 only, not {curve:?}"),
                (other, _) => bail!("key algorithm {other} is not RSA or EC"),
            }
        }
        other => bail!("a PEM {other:?} is not a public key"),
    };
    Ok(ProviderKey {
        kid: None,
        alg,
        key,
        thumbprint: sha256(&der),
    })
}

/// An RSA public key (PKCS#1 DER) that parses, of at least [`MIN_RSA_BITS`].
fn check_rsa(pkcs1_der: &[u8]) -> anyhow::Result<()> {
    use rsa::pkcs1::DecodeRsaPublicKey;
    use rsa::traits::PublicKeyParts;
    let key = rsa::PublicKey::from_pkcs1_der(pkcs1_der)
        .map_err(|e| anyhow::anyhow!("not a valid RSA public key: {e}"))?;
    let bits = key.size() * 8;
    if bits < MIN_RSA_BITS {
        bail!("an RSA key of {bits} bits is too small (at least {MIN_RSA_BITS})");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const RSA_PUB: &str = include_str!("../../testkit/keys/test-only-rsa-a.pub.pem");
    const EC_PUB: &str = include_str!("../../testkit/keys/test-only-ec-a.pub.pem");
    /// A public key only, too small to be accepted.
    const RSA_1024: &str = "-----BEGIN PUBLIC KEY-----\nMIGfMA0GCSqGSIb3DQEBAQUAA4GNADCBiQKBgQDsMahlpy1d/JzZvEQYsvbvF+aa\nUXgWpFrMzrfWoF2tWJQOjcg6so9L19TNlrVGTH+WsByCe8J2X8sDOukB1yTFu+Sh\nbm0EdhwWfo7l7EvJn9qBy93A9mGmRfv2cE1bzKoPSxdO/nZEQyy4YUnv/JKkxg9e\n/FLM/OSp5Zcsp2AiEwIDAQAB\n-----END PUBLIC KEY-----\n";

    fn rsa_jwk(kid: &str) -> serde_json::Value {
        // A syntactically valid modulus; no signature is checked here.
        json!({"kty": "RSA", "kid": kid, "use": "sig", "n": "sXchDaQebHnPiGvyDOAT4saGEUetSyo9MKLOoWFsueri23bOdgWp4Dy1WlUzewbgBHod5pcM9H95GQRV3JDXboIRROSBigeC5yjU1hGzHHyXss8UDprecbAYxknTcQkhslANGRUZmdTOQ5qTRsLAt6BTYuyvVRdhS8exSZEy_c4gs_7svlJJQ4H9_NxsiIoLwAEk7-Q3UXERGYw_75IDrGA84-lA_-Ct4eTlXHBIY2EaV7t7LjJaynVJCpkv4LKjTTAumiGUIuQhrNhZLuF_RJLqHpM2kgWFLU7-VTdL1VbC2tejvcI2BlMkEpk1BzBZI0KQB0GaDWFLN-aEAw3vRw", "e": "AQAB"})
    }

    #[test]
    fn the_algorithm_comes_from_the_key() {
        let body = json!({"keys": [
            rsa_jwk("r1"),
            {"kty": "EC", "crv": "P-256", "kid": "e1", "x": "MKBCTNIcKUSDii11ySs3526iDZ8AiTo7Tu6KPAqv7D4", "y": "4Etl6SRW2YiLUrN5vfvVHuhp7x8PxltmWWlbbM4IFyM"},
            // Skipped: an encryption key, a symmetric key, an RSA key claiming HS256.
            {"kty": "RSA", "kid": "enc", "use": "enc", "n": "AQAB", "e": "AQAB"},
            {"kty": "oct", "kid": "h1", "k": "c2VjcmV0"},
            {"kty": "RSA", "kid": "r2", "alg": "HS256", "n": "AQAB", "e": "AQAB"},
            {"kty": "OKP", "kid": "o1", "crv": "X25519", "x": "AQAB"},
        ]});
        let set =
            KeySet::from_jwks(body.to_string().as_bytes(), &KeySet::default()).expect("parses");
        assert_eq!(set.len(), 2);
        assert_eq!(set.get("r1").expect("r1").alg, Algorithm::RS256);
        assert_eq!(set.get("e1").expect("e1").alg, Algorithm::ES256);
        for skipped in ["enc", "h1", "r2", "o1"] {
            assert!(set.get(skipped).is_none(), "{skipped}");
        }
        assert_eq!(set.for_alg(Algorithm::RS256).count(), 1);
        assert_eq!(set.for_alg(Algorithm::HS256).count(), 0);
    }

    #[test]
    fn garbage_and_empty_sets_are_errors() {
        for body in [
            "",
            "<html>",
            "{}",
            r#"{"keys": []}"#,
            r#"{"keys": [{"kty": "oct", "k": "c2VjcmV0"}]}"#,
        ] {
            assert!(
                KeySet::from_jwks(body.as_bytes(), &KeySet::default()).is_err(),
                "{body}"
            );
        }
    }

    #[test]
    fn a_withdrawn_key_is_noticed() {
        let one = |kids: &[&str]| {
            let keys: Vec<_> = kids.iter().map(|k| rsa_jwk(k)).collect();
            KeySet::from_jwks(
                json!({ "keys": keys }).to_string().as_bytes(),
                &KeySet::default(),
            )
            .expect("parses")
        };
        assert!(!one(&["a"]).loses_keys_in(&one(&["a", "b"])));
        assert!(one(&["a", "b"]).loses_keys_in(&one(&["b"])));
        // The same kid on other key material is a withdrawal too.
        let ec = json!({"keys": [{"kty": "EC", "crv": "P-256", "kid": "a", "x": "MKBCTNIcKUSDii11ySs3526iDZ8AiTo7Tu6KPAqv7D4", "y": "4Etl6SRW2YiLUrN5vfvVHuhp7x8PxltmWWlbbM4IFyM"}]});
        let replaced =
            KeySet::from_jwks(ec.to_string().as_bytes(), &KeySet::default()).expect("parses");
        assert!(one(&["a"]).loses_keys_in(&replaced));
        assert!(!one(&["a"]).loses_keys_in(&one(&["a"])));
    }

    #[test]
    fn repeated_kids_keep_the_first_key_or_are_refused() {
        let ec = json!({"kty": "EC", "crv": "P-256", "kid": "r1", "x": "MKBCTNIcKUSDii11ySs3526iDZ8AiTo7Tu6KPAqv7D4", "y": "4Etl6SRW2YiLUrN5vfvVHuhp7x8PxltmWWlbbM4IFyM"});
        let body = json!({"keys": [rsa_jwk("r1"), ec, rsa_jwk("r2")]}).to_string();
        let set = KeySet::from_jwks(body.as_bytes(), &KeySet::default()).expect("parses");
        assert_eq!(set.len(), 2);
        assert_eq!(
            set.get("r1").expect("r1").alg,
            Algorithm::RS256,
            "the first kept"
        );
        // A PEM key of the same name takes precedence over the JWKS's.
        let mut pem = from_pem(EC_PUB.as_bytes()).expect("ec");
        pem.kid = Some("r2".into());
        let pem = KeySet::new(vec![pem]).expect("one key");
        let set = KeySet::from_jwks(body.as_bytes(), &pem).expect("parses");
        assert!(set.get("r2").is_none());
        // Two PEM keys of one name: refused.
        let twice = |kid: &str| {
            let mut key = from_pem(RSA_PUB.as_bytes()).expect("rsa");
            key.kid = Some(kid.into());
            key
        };
        assert!(KeySet::new(vec![twice("k"), twice("k")]).is_err());
        assert!(KeySet::new(vec![twice("k"), twice("l")]).is_ok());
    }

    #[test]
    fn pem_keys() {
        assert_eq!(
            from_pem(RSA_PUB.as_bytes()).expect("rsa").alg,
            Algorithm::RS256
        );
        assert_eq!(
            from_pem(EC_PUB.as_bytes()).expect("ec").alg,
            Algorithm::ES256
        );
        assert!(from_pem(b"-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n").is_err());
        // A well-formed SubjectPublicKeyInfo whose RSA key does not parse, and
        // an RSA key of 1024 bits: refused when read, not at the first token.
        let err = from_pem(RSA_1024.as_bytes()).expect_err("1024 bits");
        assert!(format!("{err:#}").contains("too small"), "{err:#}");
        let private = include_str!("../../testkit/keys/test-only-rsa-a.key.pem");
        assert!(
            from_pem(private.as_bytes()).is_err(),
            "a private key is refused"
        );
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("key-2026.pem");
        std::fs::write(&path, RSA_PUB).expect("write");
        assert_eq!(
            from_pem_file(&path).expect("file").kid.as_deref(),
            Some("key-2026")
        );
        assert!(from_pem_file(&dir.path().join("missing.pem")).is_err());
    }
}
