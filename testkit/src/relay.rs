//! A TCP relay on loopback between a service and one of its dependencies. A test
//! cuts it (an outage that refuses new connections and drops open ones) or points
//! it at another server (a failover behind one address, as a virtual IP does).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

pub struct Relay {
    pub port: u16,
    up: Arc<AtomicBool>,
    refused: Arc<AtomicUsize>,
    cut: Arc<tokio::sync::Notify>,
    upstream: Arc<Mutex<String>>,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    /// A relay on a free port forwarding to `upstream` (`host:port`).
    pub async fn start(upstream: &str) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a relay port");
        let port = listener.local_addr().expect("relay address").port();
        let up = Arc::new(AtomicBool::new(true));
        let refused = Arc::new(AtomicUsize::new(0));
        let cut = Arc::new(tokio::sync::Notify::new());
        let upstream = Arc::new(Mutex::new(upstream.to_owned()));
        let (up2, refused2, cut2, upstream2) =
            (up.clone(), refused.clone(), cut.clone(), upstream.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
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
        });
        Relay {
            port,
            up,
            refused,
            cut,
            upstream,
            task,
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
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}
