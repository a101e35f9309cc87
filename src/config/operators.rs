//! `auth.operators`: named admin credentials, beside the shared `auth.admin_token`.
//!
//! In a TOML file, an array of tables:
//!
//! ```toml
//! [[auth.operators]]
//! name = "alice"
//! token = "a-long-random-token-of-alices"
//! ```
//!
//! As an environment variable, a comma-separated list of `name:token` pairs
//! (`FLASHSALE__AUTH__OPERATORS=alice:tok…,bob:tok…`): a name never holds a
//! `:` and a token never holds a `,`, so the list reads one way only.
//!
//! What one credential must be (checked by `Settings::validate`, so a bad list
//! stops the process at start with the entry named):
//! - a name of 1 to 64 characters of `A-Z a-z 0-9 _ - .`, not `admin_token`
//!   (the name the audit trail gives the shared token), unique in the list;
//! - a token of 16 to 256 visible ASCII characters without `,`, at least 8 of
//!   them different (no `aaaa…` placeholders), unique in the list, not the shared
//!   `auth.admin_token` (the trail could not tell who used it) and not a
//!   published development value.

use std::collections::HashSet;

use anyhow::bail;
use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Deserializer};

use super::{DEV_ADMIN_TOKEN, DEV_USER_TOKEN_SECRET};

/// The name the audit trail records for the shared `auth.admin_token`; no
/// operator may take it.
pub const SHARED_TOKEN_NAME: &str = "admin_token";

const MIN_TOKEN_LEN: usize = 16;
const MAX_TOKEN_LEN: usize = 256;
const MIN_DISTINCT_CHARS: usize = 8;
const MAX_NAME_LEN: usize = 64;

/// One named admin credential. The token is a secret: `Debug` does not show it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OperatorCredential {
    pub name: String,
    pub token: SecretString,
}

/// The configured operators, in the order given.
#[derive(Debug, Clone, Default)]
pub struct OperatorCredentials(pub Vec<OperatorCredential>);

impl OperatorCredentials {
    /// Parses the environment's form: `name:token[,name:token…]`; blanks around
    /// entries are ignored, an empty text is no operator.
    pub fn parse_list(text: &str) -> Result<Self, String> {
        let mut out = Vec::new();
        for (i, entry) in text.split(',').map(str::trim).enumerate() {
            if entry.is_empty() {
                continue;
            }
            let (name, token) = entry.split_once(':').ok_or_else(|| {
                format!(
                    "auth.operators entry {} is not name:token (the list is name:token,name:token)",
                    i + 1
                )
            })?;
            out.push(OperatorCredential {
                name: name.trim().to_owned(),
                token: SecretString::from(token.trim().to_owned()),
            });
        }
        Ok(OperatorCredentials(out))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Refuses weak, malformed or duplicate names and tokens, and a token equal
    /// to the shared one; the error names the entry, never a token.
    pub fn validate(&self, admin_token: &SecretString) -> anyhow::Result<()> {
        let mut names = HashSet::new();
        let mut tokens = HashSet::new();
        for (i, op) in self.0.iter().enumerate() {
            let which = format!("auth.operators entry {} ({:?})", i + 1, op.name);
            let name = op.name.as_str();
            if name.is_empty()
                || name.len() > MAX_NAME_LEN
                || !name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
            {
                bail!("{which}: a name is 1 to {MAX_NAME_LEN} characters of A-Z, a-z, 0-9, '_', '-' or '.'");
            }
            if name == SHARED_TOKEN_NAME {
                bail!("{which}: the name {SHARED_TOKEN_NAME:?} is the shared token's in the audit trail; choose another");
            }
            if !names.insert(name) {
                bail!("{which}: the name appears twice; each operator needs a name of their own");
            }
            let token = op.token.expose_secret();
            if token.len() < MIN_TOKEN_LEN || token.len() > MAX_TOKEN_LEN {
                bail!("{which}: a token is {MIN_TOKEN_LEN} to {MAX_TOKEN_LEN} characters");
            }
            if !token.bytes().all(|b| b.is_ascii_graphic() && b != b',') {
                bail!("{which}: a token is visible ASCII characters without spaces or ','");
            }
            if token.bytes().collect::<HashSet<u8>>().len() < MIN_DISTINCT_CHARS {
                bail!("{which}: the token is too weak (fewer than {MIN_DISTINCT_CHARS} different characters); use a random one");
            }
            if token == DEV_ADMIN_TOKEN || token == DEV_USER_TOKEN_SECRET {
                bail!("{which}: the token is a published development value; use a random one");
            }
            if token == admin_token.expose_secret() {
                bail!("{which}: the token is auth.admin_token's; an operator's token must be their own");
            }
            if !tokens.insert(token) {
                bail!("{which}: the token is another operator's too; each operator needs a token of their own");
            }
        }
        Ok(())
    }
}

/// Either form: the TOML array of tables, or the environment's text.
impl<'de> Deserialize<'de> for OperatorCredentials {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Form {
            Text(String),
            Tables(Vec<OperatorCredential>),
        }
        match Form::deserialize(d).map_err(|_| {
            serde::de::Error::custom(
                "auth.operators is a list of {name, token} tables, or the text name:token,name:token",
            )
        })? {
            Form::Text(text) => Self::parse_list(&text).map_err(serde::de::Error::custom),
            Form::Tables(list) => Ok(OperatorCredentials(list)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admin() -> SecretString {
        SecretString::from("the-shared-admin-token-0123")
    }

    fn one(name: &str, token: &str) -> OperatorCredentials {
        OperatorCredentials(vec![OperatorCredential {
            name: name.into(),
            token: SecretString::from(token.to_owned()),
        }])
    }

    #[test]
    fn the_environment_form_parses() {
        let ops = OperatorCredentials::parse_list(
            " alice:Alice-token-0123456789 , bob:b0b:token-with-colon-99 ,",
        )
        .expect("parses");
        assert_eq!(ops.0.len(), 2);
        assert_eq!(ops.0[0].name, "alice");
        assert_eq!(ops.0[0].token.expose_secret(), "Alice-token-0123456789");
        assert_eq!(ops.0[1].name, "bob");
        assert_eq!(ops.0[1].token.expose_secret(), "b0b:token-with-colon-99");
        assert!(ops.validate(&admin()).is_ok());
        assert!(OperatorCredentials::parse_list("")
            .expect("empty")
            .is_empty());
        let err = OperatorCredentials::parse_list("alice").expect_err("no token");
        assert!(err.contains("name:token"), "{err}");
    }

    #[test]
    fn weak_malformed_and_duplicate_credentials_are_refused() {
        let good = "Alice-token-0123456789";
        for (ops, needle) in [
            (one("", good), "a name is"),
            (one("al ice", good), "a name is"),
            (one(&"a".repeat(65), good), "a name is"),
            (one("admin_token", good), "shared token's"),
            (one("alice", "short-0123"), "16 to 256"),
            (one("alice", "aaaaaaaaaaaaaaaaaaaaaaaa"), "too weak"),
            (one("alice", "Alice token 0123456789"), "visible ASCII"),
            (one("alice", DEV_ADMIN_TOKEN), "published"),
            (
                one("alice", "the-shared-admin-token-0123"),
                "auth.admin_token's",
            ),
            (
                OperatorCredentials::parse_list(&format!(
                    "alice:{good},alice:Other-token-0123456789"
                ))
                .expect("parses"),
                "name appears twice",
            ),
            (
                OperatorCredentials::parse_list(&format!("alice:{good},bob:{good}"))
                    .expect("parses"),
                "another operator's",
            ),
        ] {
            let err = ops.validate(&admin()).expect_err(needle).to_string();
            assert!(err.contains(needle), "{err}");
            assert!(!err.contains(good), "no token in {err}");
        }
    }

    #[test]
    fn tokens_are_not_in_debug_output() {
        let ops = one("alice", "Alice-token-0123456789");
        assert!(!format!("{ops:?}").contains("Alice-token-0123456789"));
    }
}
