//! A TCP proxy between the service and PostgreSQL that a test can cut, black-hole and restore,
//! to take the database away without touching the server that other tests share.

use std::net::SocketAddr;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Connections pass through.
    Open,
    /// Every connection is dropped and new ones are refused: the database looks down.
    Refuse,
    /// Connections stay open but nothing passes, in either direction: the database looks
    /// alive but never answers, as behind a dead network path.
    Blackhole,
}

pub struct TcpProxy {
    pub addr: SocketAddr,
    mode: watch::Sender<Mode>,
    stop: CancellationToken,
}

impl TcpProxy {
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        let (mode, _) = watch::channel(Mode::Open);
        let stop = CancellationToken::new();
        let accept_mode = mode.subscribe();
        let accept_stop = stop.clone();
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    _ = accept_stop.cancelled() => return,
                    accepted = listener.accept() => accepted,
                };
                let Ok((client, _)) = accepted else { continue };
                let mode = accept_mode.clone();
                let stop = accept_stop.clone();
                tokio::spawn(async move { forward(client, upstream, mode, stop).await });
            }
        });
        Self { addr, mode, stop }
    }

    /// Drops every connection through the proxy and refuses new ones.
    pub fn cut(&self) {
        self.set(Mode::Refuse);
    }

    /// Stops passing bytes without closing anything: calls wait for answers that never come.
    pub fn blackhole(&self) {
        self.set(Mode::Blackhole);
    }

    /// Lets connections through again (connections stalled by a black hole are dropped, as a
    /// recovering network would time them out).
    pub fn restore(&self) {
        self.set(Mode::Open);
    }

    /// Changes the mode, waking connections only on a real change: a forwarding connection
    /// that woke for nothing would drop the bytes its copy held in flight.
    fn set(&self, new: Mode) {
        self.mode.send_if_modified(|mode| {
            let changed = *mode != new;
            *mode = new;
            changed
        });
    }

    /// A PostgreSQL URL for `database` that goes through this proxy.
    pub fn database_url(&self, database: &str) -> String {
        format!("postgres://postgres@{}/{database}", self.addr)
    }
}

async fn forward(
    mut client: TcpStream,
    upstream: SocketAddr,
    mut mode: watch::Receiver<Mode>,
    stop: CancellationToken,
) {
    let current = *mode.borrow_and_update();
    match current {
        Mode::Refuse => return,
        Mode::Blackhole => {
            // Accept, then say nothing until the network comes back or the test ends.
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = mode.wait_for(|m| *m != Mode::Blackhole) => {}
            }
            return;
        }
        Mode::Open => {}
    }
    let Ok(mut server) = TcpStream::connect(upstream).await else {
        return;
    };
    tokio::select! {
        _ = stop.cancelled() => {}
        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
        changed = mode.changed() => {
            // The mode only ever changes away from Open here (see `set`).
            let now = *mode.borrow_and_update();
            if changed.is_ok() && now == Mode::Blackhole {
                // Keep both sockets open and idle until the mode changes again.
                tokio::select! {
                    _ = stop.cancelled() => {}
                    _ = mode.wait_for(|m| *m != Mode::Blackhole) => {}
                }
            }
        }
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
