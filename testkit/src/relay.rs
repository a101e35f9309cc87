//! A TCP relay on loopback between a service and one of its dependencies. A test
//! cuts it (an outage that refuses new connections and drops open ones) or points
//! it at another server (a failover behind one address, as a virtual IP does). It
//! counts the bytes the service sends through it, so a test can see how much
//! work the dependency was given.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

pub struct Relay {
    pub port: u16,
    up: Arc<AtomicBool>,
    refused: Arc<AtomicUsize>,
    sent: Arc<AtomicU64>,
    cut: Arc<tokio::sync::Notify>,
    upstream: Arc<Mutex<String>>,
    stop: Arc<tokio::sync::Notify>,
}

impl Relay {
    /// A relay on a free port forwarding to `upstream` (`host:port`).
    pub async fn start(upstream: &str) -> Self {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a relay port");
        listener
            .set_nonblocking(true)
            .expect("a non-blocking relay socket");
        let port = listener.local_addr().expect("relay address").port();
        let up = Arc::new(AtomicBool::new(true));
        let refused = Arc::new(AtomicUsize::new(0));
        let sent = Arc::new(AtomicU64::new(0));
        let cut = Arc::new(tokio::sync::Notify::new());
        let stop = Arc::new(tokio::sync::Notify::new());
        let upstream = Arc::new(Mutex::new(upstream.to_owned()));
        let (up2, refused2, sent2, cut2, upstream2, stop2) = (
            up.clone(),
            refused.clone(),
            sent.clone(),
            cut.clone(),
            upstream.clone(),
            stop.clone(),
        );
        let accept = async move {
            let listener =
                tokio::net::TcpListener::from_std(listener).expect("a tokio relay socket");
            loop {
                let Ok((inbound, _)) = listener.accept().await else {
                    continue;
                };
                if !up2.load(Ordering::SeqCst) {
                    refused2.fetch_add(1, Ordering::SeqCst);
                    drop(inbound);
                    continue;
                }
                let target = upstream2
                    .lock()
                    .map(|t| t.clone())
                    .unwrap_or_else(|p| p.into_inner().clone());
                let cut = cut2.clone();
                let mut inbound = Counted {
                    inner: inbound,
                    read: sent2.clone(),
                };
                tokio::spawn(async move {
                    let Ok(mut outbound) = tokio::net::TcpStream::connect(&target).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = cut.notified() => {}
                    }
                });
            }
        };
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime for the relay");
            rt.block_on(async move {
                tokio::select! {
                    _ = stop2.notified() => {}
                    _ = accept => {}
                }
            });
        });
        Relay {
            port,
            up,
            refused,
            sent,
            cut,
            upstream,
            stop,
        }
    }

    /// Refuses new connections and drops the open ones.
    pub fn down(&self) {
        self.up.store(false, Ordering::SeqCst);
        self.cut.notify_waiters();
    }

    pub fn up(&self) {
        self.up.store(true, Ordering::SeqCst);
    }

    /// Drops the open connections and sends new ones to `upstream`.
    pub fn retarget(&self, upstream: &str) {
        if let Ok(mut t) = self.upstream.lock() {
            *t = upstream.to_owned();
        }
        self.cut.notify_waiters();
    }

    /// Connections refused while down.
    pub fn refused(&self) -> usize {
        self.refused.load(Ordering::SeqCst)
    }

    /// Bytes the service has sent to the dependency through the relay so far
    /// (every request it made, on every connection).
    pub fn bytes_sent(&self) -> u64 {
        self.sent.load(Ordering::SeqCst)
    }
}

/// A stream that counts the bytes read from it.
struct Counted<S> {
    inner: S,
    read: Arc<AtomicU64>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Counted<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        let got = buf.filled().len().saturating_sub(before);
        self.read.fetch_add(got as u64, Ordering::SeqCst);
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Counted<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        // A stored permit: the relay stops even if it is not waiting yet.
        self.stop.notify_one();
    }
}
