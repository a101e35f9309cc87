//! A TCP relay on loopback between a service and one of its dependencies. A test
//! cuts it (an outage that refuses new connections and drops open ones) or points
//! it at another server (a failover behind one address, as a virtual IP does), or
//! holds what the service sends for a while (a request stalled on its way). It
//! counts the bytes the service sends through it, so a test can see how much
//! work the dependency was given.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

pub struct Relay {
    pub port: u16,
    up: Arc<AtomicBool>,
    refused: Arc<AtomicUsize>,
    cut: Arc<tokio::sync::Notify>,
    upstream: Arc<Mutex<String>>,
    stop: Arc<tokio::sync::Notify>,
    held: Arc<tokio::sync::watch::Sender<bool>>,
    sent: Arc<AtomicU64>,
}

impl Relay {
    /// A relay on a free port forwarding to `upstream` (`host:port`).
    pub async fn start(upstream: &str) -> Self {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a relay port");
        listener
            .set_nonblocking(true)
            .expect("a non-blocking relay socket");
        let port = listener.local_addr().expect("relay address").port();
        let relay = Relay {
            port,
            up: Arc::new(AtomicBool::new(true)),
            refused: Arc::new(AtomicUsize::new(0)),
            cut: Arc::new(tokio::sync::Notify::new()),
            upstream: Arc::new(Mutex::new(upstream.to_owned())),
            stop: Arc::new(tokio::sync::Notify::new()),
            held: Arc::new(tokio::sync::watch::Sender::new(false)),
            sent: Arc::new(AtomicU64::new(0)),
        };
        let shared = Shared {
            up: relay.up.clone(),
            refused: relay.refused.clone(),
            cut: relay.cut.clone(),
            upstream: relay.upstream.clone(),
            held: relay.held.clone(),
            sent: relay.sent.clone(),
        };
        let stop = relay.stop.clone();
        // A thread and a runtime of its own: the relay keeps forwarding while the
        // test's runtime is busy or blocked.
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime for the relay");
            rt.block_on(async move {
                tokio::select! {
                    _ = stop.notified() => {}
                    _ = accept(listener, shared) => {}
                }
            });
        });
        relay
    }

    /// Holds what the service sends from now on (its requests wait in the relay,
    /// connections stay open) until `release`.
    pub fn hold(&self) {
        self.held.send_replace(true);
    }

    pub fn release(&self) {
        self.held.send_replace(false);
    }

    /// Bytes the service has sent to the dependency through the relay so far
    /// (every request it made, on every connection).
    pub fn bytes_sent(&self) -> u64 {
        self.sent.load(Ordering::SeqCst)
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
}

impl Drop for Relay {
    fn drop(&mut self) {
        // A stored permit: the relay stops even if it is not waiting yet.
        self.stop.notify_one();
    }
}

/// What the relay's thread shares with its handle.
#[derive(Clone)]
struct Shared {
    up: Arc<AtomicBool>,
    refused: Arc<AtomicUsize>,
    cut: Arc<tokio::sync::Notify>,
    upstream: Arc<Mutex<String>>,
    held: Arc<tokio::sync::watch::Sender<bool>>,
    sent: Arc<AtomicU64>,
}

/// Takes connections while up (refuses them while down), each forwarded to
/// the upstream of the moment.
async fn accept(listener: std::net::TcpListener, shared: Shared) {
    let listener = tokio::net::TcpListener::from_std(listener).expect("a tokio relay socket");
    loop {
        let Ok((inbound, _)) = listener.accept().await else {
            continue;
        };
        if !shared.up.load(Ordering::SeqCst) {
            shared.refused.fetch_add(1, Ordering::SeqCst);
            drop(inbound);
            continue;
        }
        let target = shared
            .upstream
            .lock()
            .map(|t| t.clone())
            .unwrap_or_else(|p| p.into_inner().clone());
        let (cut, held, sent) = (
            shared.cut.clone(),
            shared.held.subscribe(),
            shared.sent.clone(),
        );
        tokio::spawn(forward(inbound, target, cut, held, sent));
    }
}

/// One connection both ways until either side closes it or the relay cuts it.
async fn forward(
    mut inbound: tokio::net::TcpStream,
    target: String,
    cut: Arc<tokio::sync::Notify>,
    mut held: tokio::sync::watch::Receiver<bool>,
    sent: Arc<AtomicU64>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(outbound) = tokio::net::TcpStream::connect(&target).await else {
        return;
    };
    let (mut from_service, mut to_service) = inbound.split();
    let (mut from_upstream, mut to_upstream) = outbound.into_split();
    // What the service sends waits here while the relay is held.
    let requests = async {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match from_service.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            sent.fetch_add(n as u64, Ordering::SeqCst);
            if held.wait_for(|h| !*h).await.is_err()
                || to_upstream.write_all(&buf[..n]).await.is_err()
            {
                break;
            }
        }
        let _ = to_upstream.shutdown().await;
    };
    let answers = tokio::io::copy(&mut from_upstream, &mut to_service);
    tokio::select! {
        _ = async { tokio::join!(requests, answers) } => {}
        _ = cut.notified() => {}
    }
}
