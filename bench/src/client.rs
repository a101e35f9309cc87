//! One HTTP/1.1 keep-alive connection, and a one-shot JSON call for the admin API.
//!
//! The load generator owns one `Conn` per worker: a fixed set of connections, each
//! carrying one request at a time, exactly like a fleet of browsers with keep-alive.
//! hyper's connection-level API is used instead of a pooled client so that "64
//! connections" means 64 sockets, not whatever a pool decides, and so the client
//! spends as little CPU as possible per request.

use std::net::SocketAddr;

use anyhow::{bail, Context};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper::header::{HeaderValue, AUTHORIZATION, CONTENT_TYPE, HOST, RETRY_AFTER};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::net::TcpStream;

/// One open keep-alive connection to `addr`.
pub struct Conn {
    sender: SendRequest<Full<Bytes>>,
    host: HeaderValue,
}

impl Conn {
    pub async fn connect(addr: SocketAddr) -> anyhow::Result<Conn> {
        let stream = TcpStream::connect(addr)
            .await
            .with_context(|| format!("failed to connect to {addr}"))?;
        // Small requests and answers: without NODELAY, Nagle's algorithm and delayed
        // ACKs would add up to 40 ms to some of them.
        stream
            .set_nodelay(true)
            .context("failed to set TCP_NODELAY")?;
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .context("HTTP/1.1 handshake failed")?;
        // The connection future does the socket I/O; it ends when the sender is dropped
        // or the server closes the socket, and the sender then reports the error.
        tokio::spawn(async move {
            let _ = connection.await;
        });
        let host = HeaderValue::from_str(&addr.to_string()).context("bad host header")?;
        Ok(Conn { sender, host })
    }

    /// Sends one request and reads the whole answer.
    pub async fn send(
        &mut self,
        method: Method,
        path: &str,
        authorization: Option<&HeaderValue>,
        json: Option<Bytes>,
    ) -> anyhow::Result<(StatusCode, Bytes)> {
        let (status, _, body) = self
            .send_with_retry_after(method, path, authorization, json)
            .await?;
        Ok((status, body))
    }

    /// Like [`Conn::send`], with the answer's `Retry-After` in seconds.
    pub async fn send_with_retry_after(
        &mut self,
        method: Method,
        path: &str,
        authorization: Option<&HeaderValue>,
        json: Option<Bytes>,
    ) -> anyhow::Result<(StatusCode, Option<u64>, Bytes)> {
        let mut builder = Request::builder()
            .method(method)
            .uri(path)
            .header(HOST, self.host.clone());
        if let Some(auth) = authorization {
            builder = builder.header(AUTHORIZATION, auth.clone());
        }
        let body = match json {
            Some(b) => {
                builder = builder.header(CONTENT_TYPE, "application/json");
                Full::new(b)
            }
            None => Full::new(Bytes::new()),
        };
        let request = builder.body(body).context("invalid request")?;
        // A keep-alive connection carries one request at a time; `ready` waits for
        // the previous answer to be fully read (it always is here) or reports a close.
        self.sender
            .ready()
            .await
            .context("connection closed by the server")?;
        let response = self
            .sender
            .send_request(request)
            .await
            .context("request failed")?;
        let status = response.status();
        let retry_after = response
            .headers()
            .get(RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse().ok());
        let bytes = response
            .into_body()
            .collect()
            .await
            .context("failed to read the answer")?
            .to_bytes();
        Ok((status, retry_after, bytes))
    }
}

/// One request on a fresh connection, with a JSON body and answer: for the few admin
/// and control calls around a run, where connection reuse does not matter.
pub async fn call_json(
    addr: SocketAddr,
    method: Method,
    path: &str,
    bearer: Option<&str>,
    body: Option<&Value>,
) -> anyhow::Result<(StatusCode, Value)> {
    let mut conn = Conn::connect(addr).await?;
    let auth = bearer
        .map(|t| HeaderValue::from_str(&format!("Bearer {t}")))
        .transpose()
        .context("token is not a valid header value")?;
    let json = body
        .map(|b| serde_json::to_vec(b).map(Bytes::from))
        .transpose()
        .context("failed to encode the body")?;
    let (status, bytes) = conn
        .send(method.clone(), path, auth.as_ref(), json)
        .await
        .with_context(|| format!("{method} {path}"))?;
    let value = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes)
            .with_context(|| format!("{method} {path}: the answer is not JSON"))?
    };
    Ok((status, value))
}

/// Like [`call_json`], but any status other than `expect` is an error that quotes
/// the answer.
pub async fn expect_json(
    addr: SocketAddr,
    method: Method,
    path: &str,
    bearer: Option<&str>,
    body: Option<&Value>,
    expect: StatusCode,
) -> anyhow::Result<Value> {
    let (status, value) = call_json(addr, method.clone(), path, bearer, body).await?;
    if status != expect {
        bail!("{method} {path}: expected {expect}, got {status}: {value}");
    }
    Ok(value)
}

/// The `code` of a documented error body (`{"code": "sold_out", ...}`), found by a
/// plain scan: cheaper than parsing JSON for every answer of a load test.
pub fn error_code(body: &[u8]) -> Option<&str> {
    const KEY: &[u8] = b"\"code\":\"";
    let start = body.windows(KEY.len()).position(|w| w == KEY)? + KEY.len();
    let len = body[start..].iter().position(|b| *b == b'"')?;
    std::str::from_utf8(&body[start..start + len]).ok()
}

#[cfg(test)]
mod tests {
    use super::error_code;

    #[test]
    fn finds_the_code() {
        assert_eq!(
            error_code(br#"{"code":"sold_out","message":"sold out"}"#),
            Some("sold_out")
        );
        assert_eq!(
            error_code(br#"{"message":"x","code":"paused"}"#),
            Some("paused")
        );
        assert_eq!(error_code(br#"{"reservation_id":"x"}"#), None);
        assert_eq!(error_code(b""), None);
    }
}
