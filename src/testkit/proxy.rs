//! A TCP proxy that can take a server away: the tests and the soak run put it in front of
//! Postgres (or Redis) to make the server unreachable for minutes without stopping it, the
//! way a network partition or a failover does to a `serve` host.
//!
//! While [`ProxyControl::cut`] is in force every open connection is closed and every new one
//! is accepted and closed at once (clients see a reset, as from a host that lost its
//! upstream); [`ProxyControl::restore`] lets new connections through again. Connections made
//! before a cut never come back: clients must reconnect, as they would after a real outage.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// A running proxy; it stops (and closes every connection) when dropped.
pub struct TcpProxy {
    /// Where clients connect instead of the upstream.
    pub addr: SocketAddr,
    /// Cuts and restores the upstream.
    pub control: ProxyControl,
    stop: CancellationToken,
}

/// The switch of a [`TcpProxy`], cheap to clone.
#[derive(Clone)]
pub struct ProxyControl {
    up: Arc<watch::Sender<bool>>,
    refused: Arc<AtomicU64>,
}

impl ProxyControl {
    /// Closes every open connection and refuses new ones until [`ProxyControl::restore`].
    pub fn cut(&self) {
        self.up.send_replace(false);
    }

    /// Lets new connections through again.
    pub fn restore(&self) {
        self.up.send_replace(true);
    }

    /// Connections closed on arrival while cut: proof that a client really tried.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

impl TcpProxy {
    /// Listens on an ephemeral loopback port and forwards every connection to `upstream`.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<TcpProxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (up, _) = watch::channel(true);
        let control = ProxyControl { up: Arc::new(up), refused: Arc::new(AtomicU64::new(0)) };
        let stop = CancellationToken::new();
        let tracker = TaskTracker::new();
        let (c, s, t) = (control.clone(), stop.clone(), tracker.clone());
        tracker.spawn(async move {
            loop {
                let accepted = tokio::select! {
                    _ = s.cancelled() => break,
                    a = listener.accept() => a,
                };
                let Ok((client, _)) = accepted else { continue };
                if !*c.up.borrow() {
                    c.refused.fetch_add(1, Ordering::Relaxed);
                    let _ = client.set_zero_linger();
                    drop(client);
                    continue;
                }
                let mut down = c.up.subscribe();
                let s = s.clone();
                t.spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else { return };
                    let (mut client, mut server) = (client, server);
                    tokio::select! {
                        _ = s.cancelled() => {}
                        _ = down.wait_for(|up| !*up) => {}
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                    }
                    // A reset, not a polite close: what a client sees when its server's host
                    // drops off the network mid-conversation.
                    let _ = client.set_zero_linger();
                });
            }
        });
        tracker.close();
        Ok(TcpProxy { addr, control, stop })
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
