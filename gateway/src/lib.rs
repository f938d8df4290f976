//! An HTTP reverse proxy that gives any HTTP API the semantics of the `Idempotency-Key` header
//! (draft-ietf-httpapi-idempotency-key-header), with every decision made by the idempotency
//! coordinator through its Rust client (`idempotency-client`): so scopes, tokens and TLS apply
//! to the gateway as to any caller, and two replicas in front of one coordinator agree.
//!
//! `idempotency-coordinator gateway --listen … --upstream … --coordinator … --namespace …`
//! runs it; [`Args`], [`Gateway::bind`] and [`Gateway::serve`] embed it. See
//! `docs/gateway.md` for every setting and decision.

mod body;
mod config;
mod key;
mod problem;
mod proxy;
mod record;

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client as HttpClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::graceful::GracefulShutdown;
use idempotency_client::{Certificate, Client, ClientTlsConfig, RetryPolicy};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use config::{Args, MAX_KEY_LENGTH, Settings, Upstream};
pub use idempotency_settings::SettingError;
pub use problem::TYPE_PREFIX as PROBLEM_TYPE_PREFIX;
pub use proxy::{LEASE_TOKEN_HEADER, REPLAYED_HEADER, WARNING_HEADER, is_final};

/// Room in a coordinator message beyond the stored response (the rest of the message).
const MESSAGE_OVERHEAD: usize = 64 * 1024;

/// The gateway, bound to its address and ready to serve.
pub struct Gateway {
    listener: TcpListener,
    local_addr: SocketAddr,
    proxy: Arc<proxy::Proxy>,
}

impl Gateway {
    /// Binds the listening socket and prepares the clients. The coordinator is connected to
    /// on the first request, so that the gateway starts (and fails closed or open) while it is
    /// down.
    pub async fn bind(settings: Settings) -> anyhow::Result<Self> {
        let mut builder = Client::builder(settings.coordinator.clone())
            .call_timeout(settings.coordinator_timeout)
            .connect_timeout(settings.coordinator_timeout)
            .retry(RetryPolicy {
                total: settings.coordinator_retry,
                ..RetryPolicy::default()
            })
            .max_decoding_message_size(settings.max_stored_response_bytes + MESSAGE_OVERHEAD);
        if let Some(token) = &settings.token {
            builder = builder.token(token.clone());
        }
        if let Some(ca) = &settings.coordinator_ca {
            builder = builder.tls(ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca)));
        }
        let coordinator = builder
            .build_lazy()
            .context("preparing the coordinator client")?;
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(settings.upstream_timeout));
        let upstream = HttpClient::builder(TokioExecutor::new()).build(connector);
        let listener = TcpListener::bind(settings.listen)
            .await
            .with_context(|| format!("listening on {}", settings.listen))?;
        let local_addr = listener.local_addr().context("reading the bound address")?;
        Ok(Self {
            listener,
            local_addr,
            proxy: Arc::new(proxy::Proxy {
                settings,
                coordinator,
                upstream,
            }),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Serves until `shutdown` fires, then stops accepting, lets requests in flight finish
    /// (their claims completed or released) for at most the shutdown grace, and returns.
    pub async fn serve(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let graceful = GracefulShutdown::new();
        let server = http1::Builder::new();
        loop {
            let (stream, peer) = tokio::select! {
                () = shutdown.cancelled() => break,
                accepted = self.listener.accept() => match accepted {
                    Ok(accepted) => accepted,
                    Err(error) => {
                        // Out of file descriptors and the like: pause rather than spin.
                        tracing::warn!(%error, "accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            // Best effort: a socket that refuses it still works.
            let _ = stream.set_nodelay(true);
            let proxy = self.proxy.clone();
            let service = service_fn(move |request| {
                let proxy = proxy.clone();
                async move { Ok::<_, std::convert::Infallible>(proxy.handle(request).await) }
            });
            let connection = graceful.watch(server.serve_connection(TokioIo::new(stream), service));
            tokio::spawn(async move {
                if let Err(error) = connection.await {
                    tracing::debug!(%peer, %error, "connection ended with an error");
                }
            });
        }
        let grace = self.proxy.settings.shutdown_grace;
        tracing::info!(?grace, "stopping: finishing requests in flight");
        if tokio::time::timeout(grace, graceful.shutdown())
            .await
            .is_err()
        {
            tracing::warn!(
                ?grace,
                "requests still in flight after the grace; their claims free when their leases run out"
            );
        }
        Ok(())
    }
}

/// Checks `args`, binds, writes the address file if asked, and serves until `shutdown`.
pub async fn run(args: Args, shutdown: CancellationToken) -> anyhow::Result<()> {
    let settings = args.settings()?;
    let address_file = settings.address_file.clone();
    let namespace = settings.namespace.clone();
    let gateway = Gateway::bind(settings).await?;
    tracing::info!(address = %gateway.local_addr(), %namespace, "gateway listening");
    if let Some(path) = address_file {
        write_address_file(&path, gateway.local_addr())
            .with_context(|| format!("writing the address file {}", path.display()))?;
    }
    gateway.serve(shutdown).await
}

/// Writes `address` through a file beside `path` and a rename, so that whoever polls the file
/// reads either nothing or the whole address.
fn write_address_file(path: &std::path::Path, address: SocketAddr) -> std::io::Result<()> {
    let mut aside = path.as_os_str().to_owned();
    aside.push(".tmp");
    let aside = std::path::PathBuf::from(aside);
    std::fs::write(&aside, format!("{address}\n"))?;
    std::fs::rename(&aside, path)
}
