//! A million users' tokens in one buffer: each `Authorization` header is a slice
//! of a shared [`Bytes`], so holding every user costs the tokens' own bytes and an
//! offset each, not a heap allocation (and a `String` for the id) per user.

use std::time::Instant;

use anyhow::Context;
use bytes::{Bytes, BytesMut};
use flashsale::auth::Auth;
use hyper::header::HeaderValue;

/// Every user's `Bearer …` header, user `i` being `{prefix}{i}`.
pub struct TokenBook {
    bytes: Bytes,
    /// `ends[i]` is where user `i`'s header ends; it starts where `i - 1`'s ends.
    ends: Vec<u32>,
    /// Seconds the signing took (all threads together, wall clock).
    pub signed_in_s: f64,
}

impl TokenBook {
    /// Signs `n` tokens with the service's own signer, spread over every core.
    pub fn sign(auth: &Auth, prefix: &str, n: usize, ttl_secs: i64) -> anyhow::Result<TokenBook> {
        let started = Instant::now();
        let threads = std::thread::available_parallelism().map_or(1, |p| p.get());
        let chunk = n.div_ceil(threads.max(1)).max(1);
        let parts: Vec<anyhow::Result<(BytesMut, Vec<u32>)>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..n)
                .step_by(chunk)
                .map(|start| {
                    let end = (start + chunk).min(n);
                    scope.spawn(move || -> anyhow::Result<(BytesMut, Vec<u32>)> {
                        let mut buf = BytesMut::with_capacity((end - start) * 180);
                        let mut lens = Vec::with_capacity(end - start);
                        for i in start..end {
                            let token = auth.issue(&format!("{prefix}{i}"), ttl_secs)?;
                            buf.extend_from_slice(b"Bearer ");
                            buf.extend_from_slice(token.as_bytes());
                            lens.push(u32::try_from(7 + token.len()).context("token too long")?);
                        }
                        Ok((buf, lens))
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(anyhow::anyhow!("a signing thread panicked")))
                })
                .collect()
        });
        let mut all = BytesMut::new();
        let mut ends = Vec::with_capacity(n);
        for part in parts {
            let (buf, lens) = part?;
            let mut at = u32::try_from(all.len()).context("tokens exceed 4 GiB")?;
            for len in lens {
                at = at.checked_add(len).context("tokens exceed 4 GiB")?;
                ends.push(at);
            }
            all.extend_from_slice(&buf);
        }
        Ok(TokenBook {
            bytes: all.freeze(),
            ends,
            signed_in_s: started.elapsed().as_secs_f64(),
        })
    }

    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// Bytes held for every user together.
    pub fn bytes_held(&self) -> usize {
        self.bytes.len() + self.ends.len() * std::mem::size_of::<u32>()
    }

    /// User `i`'s `Authorization` header: a slice of the shared buffer, no copy.
    pub fn header(&self, i: usize) -> anyhow::Result<HeaderValue> {
        let end = *self.ends.get(i).context("no such user")? as usize;
        let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
        HeaderValue::from_maybe_shared(self.bytes.slice(start..end))
            .context("a token is not a valid header value")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use secrecy::SecretString;

    #[tokio::test]
    async fn every_user_gets_their_own_verifiable_token() {
        let auth = Auth::new(
            SecretString::from("a-bench-admin-token-0123"),
            &SecretString::from("a-bench-user-secret-0123"),
        )
        .expect("signer");
        let book = TokenBook::sign(&auth, "u-", 1001, 600).expect("tokens");
        assert_eq!(book.len(), 1001);
        for i in [0, 1, 500, 1000] {
            let mut headers = hyper::HeaderMap::new();
            headers.insert(
                hyper::header::AUTHORIZATION,
                book.header(i).expect("header"),
            );
            let user = auth.user(&headers).await.expect("a valid token");
            assert_eq!(&*user.id, format!("u-{i}").as_str());
        }
        assert!(book.header(1001).is_err());
    }
}
