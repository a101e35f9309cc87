//! What the service accepts from outside, checked the same way wherever it
//! arrives: identifiers and SKUs (in paths, tokens and Kafka messages) and whole
//! numbers (in JSON bodies). The ground floor: it knows no other module.

/// `[A-Za-z0-9_-]{1,64}`: activity ids and user ids.
pub fn is_valid_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
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
}
