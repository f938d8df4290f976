//! A TCP proxy between the service and PostgreSQL that a test can cut and restore, to take the
//! database away without touching the server that other tests share.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

pub struct TcpProxy {
    pub addr: SocketAddr,
    state: Arc<Mutex<ProxyState>>,
    stop: CancellationToken,
}

struct ProxyState {
    open: bool,
    /// Cancelled by `cut` to drop every connection passing through.
    connections: CancellationToken,
}

impl TcpProxy {
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        let state = Arc::new(Mutex::new(ProxyState {
            open: true,
            connections: CancellationToken::new(),
        }));
        let stop = CancellationToken::new();
        let accept_state = state.clone();
        let accept_stop = stop.clone();
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    _ = accept_stop.cancelled() => return,
                    accepted = listener.accept() => accepted,
                };
                let Ok((client, _)) = accepted else { continue };
                let (open, connections) = {
                    let state = accept_state.lock().expect("proxy state");
                    (state.open, state.connections.clone())
                };
                if !open {
                    // Accept and hang up at once: the client sees the connection fail.
                    drop(client);
                    continue;
                }
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (mut client, mut server) = (client, server);
                    tokio::select! {
                        _ = connections.cancelled() => {}
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                    }
                });
            }
        });
        Self { addr, state, stop }
    }

    /// Drops every connection through the proxy and refuses new ones.
    pub fn cut(&self) {
        let mut state = self.state.lock().expect("proxy state");
        state.open = false;
        state.connections.cancel();
        state.connections = CancellationToken::new();
    }

    /// Lets connections through again.
    pub fn restore(&self) {
        self.state.lock().expect("proxy state").open = true;
    }

    /// A PostgreSQL URL for `database` that goes through this proxy.
    pub fn database_url(&self, database: &str) -> String {
        format!("postgres://postgres@{}/{database}", self.addr)
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.stop.cancel();
        self.cut();
    }
}
