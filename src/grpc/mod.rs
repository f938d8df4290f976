//! The gRPC edge: the only module that knows tonic. It parses requests into domain commands,
//! turns outcomes and errors into messages and statuses, and wires the server: the API, health,
//! and reflection (v1 and v1alpha, with the `google.protobuf` and `google.rpc` descriptors so
//! that grpcurl decodes error details).

mod convert;
pub mod health;
mod service;
pub mod status;

use std::future::Future;

use tokio::net::TcpListener;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;

use crate::coordinator::Coordinator;
use crate::domain::Limits;
use crate::health::HealthState;
use crate::proto::idempotency::v1::idempotency_service_server::IdempotencyServiceServer;
use crate::store::Store;

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

/// Serves until `shutdown` completes, then stops accepting, lets calls in flight finish, and
/// returns once every connection has closed.
pub async fn serve<S: Store>(
    listener: TcpListener,
    coordinator: Coordinator<S>,
    limits: Limits,
    health: HealthState,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    let decoding_limit = decoding_limit(limits.max_response_bytes);
    let api = IdempotencyServiceServer::new(IdempotencyApi::new(coordinator, limits))
        .max_decoding_message_size(decoding_limit);

    let reflection_v1 = reflection_builder().build_v1()?;
    let reflection_v1alpha = reflection_builder().build_v1alpha()?;
    let health = tonic_health::pb::health_server::HealthServer::new(health::HealthApi::new(health));

    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    Server::builder()
        .add_service(health)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(api)
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
