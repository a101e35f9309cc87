//! A Stripe webhook's `Stripe-Signature` header, checked as API version 4
//! says: `t=<unix time>,v1=<hex HMAC-SHA256 of "<t>.<raw body>">`, keyed with
//! the endpoint's webhook secret. Several `v1` may come (Stripe sends one per
//! secret while a secret is being rolled); one that matches is enough. Other
//! schemes (`v0`, Stripe's test scheme) are ignored. `t` must lie within
//! [`TOLERANCE_SECS`] of the deployment's shared clock, either side, so that a
//! captured delivery cannot be replayed later. The comparison takes the same
//! time whatever the bytes (the MAC's own constant-time check).

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// How far `t` may lie from the shared clock.
pub const TOLERANCE_SECS: i64 = 300;

/// Why a delivery is refused (`400 invalid_signature`, nothing changes).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    #[error("the Stripe-Signature header has no timestamp t=<unix time>")]
    NoTimestamp,
    #[error("the Stripe-Signature header has no v1 signature")]
    NoSignature,
    #[error("the signature's timestamp is more than {TOLERANCE_SECS} s from the service's clock")]
    OutsideTolerance,
    #[error("no v1 signature matches the body")]
    Mismatch,
}

/// Checks `header` (the `Stripe-Signature` value) over the raw `body` with
/// `secret`, at `now` (unix seconds, the shared clock).
pub fn verify(header: &str, body: &[u8], secret: &[u8], now: i64) -> Result<(), SignatureError> {
    let mut timestamp = None;
    let mut signatures = Vec::new();
    for part in header.split(',') {
        match part.trim().split_once('=') {
            // The first, as Stripe's own libraries read it.
            Some(("t", t)) if timestamp.is_none() => timestamp = Some(t.parse::<i64>().ok()),
            Some(("v1", hex)) => signatures.push(hex),
            _ => {}
        }
    }
    let t = timestamp.flatten().ok_or(SignatureError::NoTimestamp)?;
    // An empty secret would let anyone sign.
    if secret.is_empty() {
        return Err(SignatureError::Mismatch);
    }
    if signatures.is_empty() {
        return Err(SignatureError::NoSignature);
    }
    if now.abs_diff(t) > TOLERANCE_SECS.unsigned_abs() {
        return Err(SignatureError::OutsideTolerance);
    }
    let mac = {
        let mut mac =
            Hmac::<Sha256>::new_from_slice(secret).map_err(|_| SignatureError::Mismatch)?;
        mac.update(t.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        mac
    };
    let matches = signatures
        .iter()
        .filter_map(|hex| decode_hex(hex))
        .any(|sig| mac.clone().verify_slice(&sig).is_ok());
    if matches {
        Ok(())
    } else {
        Err(SignatureError::Mismatch)
    }
}

/// Lower- or upper-case hex; `None` for anything else.
fn decode_hex(hex: &str) -> Option<Vec<u8>> {
    if hex.len() % 2 != 0 {
        return None;
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &[u8] = b"whsec_test_secret";
    const BODY: &[u8] = br#"{"id":"evt_1","type":"checkout.session.completed"}"#;
    const T: i64 = 1_700_000_000;
    /// HMAC-SHA256 of "1700000000." and BODY under SECRET, computed apart
    /// (Python's hmac module).
    const GOOD: &str = "a13d4b1f9003bc2fb6c06224e878b6056185eaa50d40e1e7dc05517f8af41d7b";

    #[test]
    fn a_signature_stripe_would_send_is_accepted() {
        let header = format!("t={T},v1={GOOD}");
        assert_eq!(verify(&header, BODY, SECRET, T), Ok(()));
        assert_eq!(verify(&header, BODY, SECRET, T + TOLERANCE_SECS), Ok(()));
        assert_eq!(verify(&header, BODY, SECRET, T - TOLERANCE_SECS), Ok(()));
        // Upper-case hex, spaces after the commas, a v0 beside it.
        let header = format!("t={T}, v0=abcd, v1={}", GOOD.to_uppercase());
        assert_eq!(verify(&header, BODY, SECRET, T), Ok(()));
    }

    #[test]
    fn one_matching_v1_among_several_is_enough() {
        let other = "0".repeat(64);
        let header = format!("t={T},v1={other},v1={GOOD}");
        assert_eq!(verify(&header, BODY, SECRET, T), Ok(()));
        let header = format!("t={T},v1={GOOD},v1=nothex");
        assert_eq!(verify(&header, BODY, SECRET, T), Ok(()));
    }

    #[test]
    fn another_body_secret_or_timestamp_is_refused() {
        let header = format!("t={T},v1={GOOD}");
        let body = br#"{"id":"evt_1","type":"checkout.session.completed" }"#;
        assert_eq!(
            verify(&header, body, SECRET, T),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            verify(&header, BODY, b"whsec_other", T),
            Err(SignatureError::Mismatch)
        );
        // The same signature under another timestamp: the timestamp is signed.
        let moved = format!("t={},v1={GOOD}", T + 1);
        assert_eq!(
            verify(&moved, BODY, SECRET, T),
            Err(SignatureError::Mismatch)
        );
        // A signature one bit off.
        let mut flipped = GOOD.to_owned();
        flipped.replace_range(63..64, "a");
        let header = format!("t={T},v1={flipped}");
        assert_eq!(
            verify(&header, BODY, SECRET, T),
            Err(SignatureError::Mismatch)
        );
    }

    #[test]
    fn an_empty_secret_verifies_nothing() {
        let header = format!("t={T},v1={GOOD}");
        assert_eq!(verify(&header, BODY, b"", T), Err(SignatureError::Mismatch));
    }

    #[test]
    fn timestamps_at_the_ends_of_the_range_do_not_overflow() {
        for (t, now) in [(i64::MIN, i64::MAX), (i64::MAX, i64::MIN), (i64::MIN, 0)] {
            let header = format!("t={t},v1={GOOD}");
            assert_eq!(
                verify(&header, BODY, SECRET, now),
                Err(SignatureError::OutsideTolerance)
            );
        }
    }

    #[test]
    fn a_timestamp_past_the_tolerance_either_side_is_refused() {
        let header = format!("t={T},v1={GOOD}");
        for now in [T + TOLERANCE_SECS + 1, T - TOLERANCE_SECS - 1] {
            assert_eq!(
                verify(&header, BODY, SECRET, now),
                Err(SignatureError::OutsideTolerance)
            );
        }
    }

    #[test]
    fn a_malformed_header_is_refused() {
        for (header, why) in [
            (String::new(), SignatureError::NoTimestamp),
            (format!("v1={GOOD}"), SignatureError::NoTimestamp),
            (format!("t=soon,v1={GOOD}"), SignatureError::NoTimestamp),
            (format!("t={T}"), SignatureError::NoSignature),
            (format!("t={T},v0={GOOD}"), SignatureError::NoSignature),
            (format!("t={T},v1="), SignatureError::Mismatch),
            (format!("t={T},v1={}", &GOOD[1..]), SignatureError::Mismatch),
            (
                format!("t=soon,t={T},v1={GOOD}"),
                SignatureError::NoTimestamp,
            ),
        ] {
            assert_eq!(verify(&header, BODY, SECRET, T), Err(why), "{header:?}");
        }
    }
}
