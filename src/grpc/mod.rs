//! The gRPC edge: the only module that knows tonic. It parses requests into domain commands,
//! turns outcomes and errors into messages and statuses, and wires the server: the API, health,
//! and reflection (v1 and v1alpha, with the `google.protobuf` and `google.rpc` descriptors so
//! that grpcurl decodes error details).

mod admin;
mod auth_layer;
pub mod codec;
pub mod connections;
mod convert;
pub mod health;
mod identity;
mod service;
pub mod status;

use std::future::Future;
use std::sync::Arc;

use tokio::net::TcpListener;
use tonic::transport::{Certificate, Identity, Server, ServerTlsConfig};

use crate::auth::Authenticator;

use crate::domain::Limits;
use crate::health::HealthState;
use crate::proto::idempotency::v1::admin_service_server::AdminServiceServer;
use crate::proto::idempotency::v1::idempotency_service_server::IdempotencyServiceServer;
use crate::service::Coordinator;
use crate::service::admin::Admin;

pub use service::IdempotencyApi;

/// Room for a request's other fields beside the largest response it may carry.
const ENVELOPE_BYTES: usize = 64 * 1024;

/// The decoding limit: the response limit plus 64 KiB, so that a bigger message is refused by
/// the gRPC layer from its length prefix, before it is buffered whole. The response limit is at
/// least 256 KiB (see `config`), so the largest valid MarkProcessed (1000 ids of 255 bytes,
/// about 262 KB framed) always fits.
pub fn decoding_limit(max_response_bytes: usize) -> usize {
    max_response_bytes.saturating_add(ENVELOPE_BYTES)
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("building the reflection service failed")]
    Reflection(#[from] tonic_reflection::server::Error),
    #[error("the gRPC server failed")]
    Transport(#[from] tonic::transport::Error),
}

/// PEM files for TLS, read at start.
#[derive(Debug, Clone)]
pub struct TlsMaterial {
    pub certificate: Vec<u8>,
    pub private_key: Vec<u8>,
    /// Client certificates must chain to this CA (mTLS) when given.
    pub client_ca: Option<Vec<u8>>,
}

/// Who may connect and call, and how much one connection may ask at once.
#[derive(Debug, Clone)]
pub struct Security {
    /// Callers must present a known bearer token for the API (health and reflection stay open).
    pub authenticator: Option<Arc<Authenticator>>,
    pub tls: Option<TlsMaterial>,
    pub max_concurrent_streams: u32,
    /// How long a known caller may take to send its request.
    pub request_read_timeout: std::time::Duration,
    /// Timeouts, caps and the response budget of connections.
    pub connections: connections::ConnectionSettings,
}

/// Pings on idle connections, so that dead peers are noticed and their streams let go.
const KEEPALIVE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(30);
const KEEPALIVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// How long a TLS handshake may take.
const TLS_HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// Streams a client may open and reset before the server has accepted them, per connection,
/// before the connection is closed with GOAWAY (the "rapid reset" attack, CVE-2023-44487). h2's
/// default, set here so that it does not silently change.
const MAX_PENDING_ACCEPT_RESET_STREAMS: usize = 20;
/// Streams the server may reset because of the client's protocol errors, per connection, before
/// it closes the connection (RUSTSEC-2024-0003). tonic passes "no limit" to hyper unless told;
/// this is hyper's own default.
const MAX_LOCAL_ERROR_RESET_STREAMS: usize = 1024;

/// What the server records in the metrics.
#[derive(Debug, Clone, Copy)]
pub struct MetricsSettings {
    /// The gRPC server metrics (`--metrics-listen`).
    pub on: bool,
    /// The per-RPC counters carry the namespace (`--metrics-namespace-labels`).
    pub namespace_labels: bool,
}

/// Serves until `shutdown` completes, then stops accepting, lets calls in flight finish, and
/// returns once every connection has closed.
#[allow(clippy::too_many_arguments)]
pub async fn serve(
    listener: TcpListener,
    coordinator: Coordinator,
    admin: Admin,
    limits: Limits,
    security: Security,
    health: HealthState,
    metrics: MetricsSettings,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    let decoding_limit = decoding_limit(limits.max_response_bytes);
    let api = IdempotencyServiceServer::new(IdempotencyApi::new(
        coordinator,
        limits,
        metrics.namespace_labels,
    ))
    .max_decoding_message_size(decoding_limit);
    let admin = AdminServiceServer::new(admin::AdminApi::new(admin))
        .max_decoding_message_size(decoding_limit);
    // Without tokens the door below is absent, and the admin API keeps to loopback callers by
    // itself; with tokens the door checks every admin call's right and scope.
    let admin = auth_layer::LoopbackOnly::new(admin, security.authenticator.is_none());

    let reflection_v1 = reflection_builder().build_v1()?;
    let reflection_v1alpha = reflection_builder().build_v1alpha()?;
    let health = tonic_health::pb::health_server::HealthServer::new(health::HealthApi::new(
        health,
        security.connections.max_health_watchers,
    ));

    let connection_settings = Arc::new(security.connections.clone());
    let incoming = connections::Incoming::new(listener, connection_settings.clone());
    let budget = connections::ResponseBudget::new(connection_settings);
    let mut server = Server::builder()
        .max_concurrent_streams(security.max_concurrent_streams)
        .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
        .http2_max_pending_accept_reset_streams(Some(MAX_PENDING_ACCEPT_RESET_STREAMS))
        .http2_max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESET_STREAMS));
    if let Some(tls) = &security.tls {
        let mut config = ServerTlsConfig::new()
            .identity(Identity::from_pem(&tls.certificate, &tls.private_key))
            .timeout(TLS_HANDSHAKE_TIMEOUT);
        if let Some(ca) = &tls.client_ca {
            config = config.client_ca_root(Certificate::from_pem(ca));
        }
        server = server.tls_config(config)?;
    }
    let door = security.authenticator.map(|authenticator| {
        auth_layer::AuthLayer::new(authenticator, decoding_limit, security.request_read_timeout)
    });
    // Outermost first: every call, refused at the door or not, is counted on its connection.
    // With metrics on, the metrics layer comes first, so that refusals at the door are counted.
    let layers = tower::ServiceBuilder::new()
        .layer(crate::metrics::GrpcMetricsLayer { on: metrics.on })
        .layer(connections::ConnectionLayer::new(budget))
        .option_layer(door);
    server
        .layer(layers)
        .add_service(health)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(api)
        .add_service(admin)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await?;
    Ok(())
}

fn reflection_builder() -> tonic_reflection::server::Builder<'static> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_types::pb::FILE_DESCRIPTOR_SET)
}
