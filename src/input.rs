//! What the service accepts from outside, checked the same way wherever it
//! arrives: identifiers and SKUs (in paths, tokens and Kafka messages) and whole
//! numbers (in JSON bodies). The ground floor: it knows no other module.

/// `[A-Za-z0-9_-]{1,64}`: activity ids (and operators' names in the config).
pub fn is_valid_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// The longest user id, in bytes of UTF-8 (MySQL keeps ids in `VARBINARY(255)`).
pub const USER_ID_MAX_BYTES: usize = 255;

/// A user id as identity providers issue them (`auth0|…`, `google-oauth2|…`,
/// e-mail addresses, UUIDs): 1 to 255 bytes of UTF-8 (a `&str` is UTF-8
/// already) without control characters (C0, DEL, C1), which could forge lines
/// in a log, nor bidirectional-text controls, which could make one id read as
/// another on a page. Compared byte for byte everywhere: `a`, `A` and `a ` are
/// three users.
pub fn is_valid_user_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= USER_ID_MAX_BYTES
        && !s.chars().any(|c| c.is_control() || is_bidi_control(c))
}

/// Unicode's bidirectional formatting characters (UAX #9): the marks, the
/// embeddings and overrides, and the isolates.
fn is_bidi_control(c: char) -> bool {
    matches!(
        c,
        '\u{061C}' | '\u{200E}' | '\u{200F}' | '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}'
    )
}

/// SKUs travel in URL paths: printable ASCII without `/`, 1 to 128 characters.
pub fn is_valid_sku(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':'))
}

/// A whole number as JSON Schema counts them: `5` and `5.0` alike.
pub fn whole_number(v: &serde_json::Value) -> Option<u64> {
    v.as_u64().or_else(|| {
        v.as_f64()
            .filter(|f| f.fract() == 0.0 && *f >= 0.0 && *f <= 9_007_199_254_740_992.0)
            .map(|f| f as u64)
    })
}

/// Serde: an `i64` field that also takes whole numbers written as `5.0`.
pub fn whole_i64<'de, D: serde::Deserializer<'de>>(d: D) -> Result<i64, D::Error> {
    use serde::Deserialize;
    let v = serde_json::Value::deserialize(d)?;
    v.as_i64()
        .or_else(|| {
            v.as_f64()
                .filter(|f| f.fract() == 0.0 && f.abs() <= 9_007_199_254_740_992.0)
                .map(|f| f as i64)
        })
        .ok_or_else(|| serde::de::Error::custom(format!("expected a whole number, got {v}")))
}

/// Serde: an optional `i64` written as a JSON integer (`null` or absent:
/// `None`). No float is taken, whole or not: `1e-400` reads as `0.0`, and a
/// price must never become 0 that way.
pub fn integer_i64_opt<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<i64>, D::Error> {
    use serde::Deserialize;
    match Option::<serde_json::Value>::deserialize(d)? {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v) => v
            .as_i64()
            .map(Some)
            .ok_or_else(|| serde::de::Error::custom(format!("expected an integer, got {v}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids() {
        assert!(is_valid_id("user_1-A"));
        assert!(!is_valid_id(""));
        assert!(!is_valid_id("a b"));
        assert!(!is_valid_id(&"a".repeat(65)));
        assert!(is_valid_id(&"a".repeat(64)));
    }

    #[test]
    fn user_ids_as_providers_issue_them() {
        for ok in [
            "auth0|5f7c8ec7c33c6c004bbafe82",
            "google-oauth2|104117843231219472000",
            "ann@example.com",
            "9b2f6c1e-7d1a-4c8e-9a55-0f1d2c3b4a59",
            "a b",
            "a ",
            "Zoë",
            "用户",
            "x",
        ] {
            assert!(is_valid_user_id(ok), "{ok:?}");
        }
        assert!(is_valid_user_id(&"é".repeat(127)), "254 bytes");
        assert!(!is_valid_user_id(&"é".repeat(128)), "256 bytes");
        assert!(is_valid_user_id(&"a".repeat(255)));
        assert!(!is_valid_user_id(&"a".repeat(256)));
        for bad in [
            "",
            "a\nb",
            "a\rb",
            "a\u{0}",
            "a\u{7f}",
            "a\u{85}",
            "a\u{9b}",
            "a\tb",
            "admin\u{202E}gpj",
            "a\u{2066}b",
            "a\u{200F}",
            "a\u{061C}",
        ] {
            assert!(!is_valid_user_id(bad), "{bad:?}");
        }
    }
}
