//! The admin API (`idempotency.v1.AdminService`) through its generated client against the real
//! server, on both stores: listings and their filters, orders and pages (`keys`), the recorded
//! changes and the audit trail (`changes`), who may call it (`access`), its metrics
//! (`metrics`), the CLI as a real process (`cli`), and its cost on a large table (`scale`,
//! PostgreSQL).

mod access;
mod changes;
mod cli;
mod holders;
mod keys;
mod metrics;
mod scale;

use idempotency_coordinator::proto::idempotency::v1::{
    self as pb, admin_service_client::AdminServiceClient,
};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

use crate::support::security::Bearer;
use crate::support::*;

pub type AdminClient = AdminServiceClient<Channel>;

/// A client of the admin API that sends `bearer`'s token with every call.
pub type AuthedAdmin = AdminServiceClient<InterceptedService<Channel, Bearer>>;

pub async fn authed_admin(endpoint: String, bearer: Bearer) -> AuthedAdmin {
    let channel = Channel::from_shared(endpoint)
        .expect("endpoint")
        .connect()
        .await
        .expect("connect");
    AdminServiceClient::with_interceptor(channel, bearer)
}

/// A client of the admin API of `app`, which listens on loopback without a tokens file: the
/// admin API answers it (as `loopback`).
pub async fn admin_client(app: &TestApp) -> AdminClient {
    AdminServiceClient::connect(app.endpoint())
        .await
        .expect("connect to the test server")
}

pub fn list(state: pb::AdminKeyState) -> pb::ListKeysRequest {
    pb::ListKeysRequest {
        namespace: NAMESPACE.into(),
        state: state.into(),
        ..Default::default()
    }
}

/// The keys a listing answers, in its order.
pub async fn listed(admin: &AdminClient, request: pb::ListKeysRequest) -> Vec<pb::AdminKeyEntry> {
    answered(admin.clone().list_keys(request).await, "ListKeys").keys
}

pub fn names(entries: &[pb::AdminKeyEntry]) -> Vec<String> {
    entries.iter().map(|entry| entry.key.clone()).collect()
}

/// The newest audit events of the test namespace.
pub async fn audit_events(admin: &AdminClient) -> Vec<pb::AuditEvent> {
    answered(
        admin
            .clone()
            .list_audit_events(pb::ListAuditEventsRequest {
                namespace: NAMESPACE.into(),
                ..Default::default()
            })
            .await,
        "ListAuditEvents",
    )
    .events
}

pub fn force_release(key: &str, reason: &str) -> pb::ForceReleaseRequest {
    pb::ForceReleaseRequest {
        namespace: NAMESPACE.into(),
        key: key.into(),
        reason: reason.into(),
    }
}

pub fn erase_key(key: &str, reason: &str) -> pb::EraseKeyRequest {
    pb::EraseKeyRequest {
        namespace: NAMESPACE.into(),
        key: key.into(),
        reason: reason.into(),
    }
}

/// Erases `namespace` and answers every progress message of its stream.
pub async fn erase_namespace(
    admin: &AdminClient,
    namespace: &str,
    batch_size: u32,
) -> Vec<pb::EraseNamespaceResponse> {
    let mut stream = answered(
        admin
            .clone()
            .erase_namespace(pb::EraseNamespaceRequest {
                namespace: namespace.into(),
                reason: "the tenant left".into(),
                batch_size,
            })
            .await,
        "EraseNamespace",
    );
    let mut messages = Vec::new();
    while let Some(message) = stream.message().await.expect("a progress message") {
        messages.push(message);
    }
    messages
}

/// Asserts INVALID_ARGUMENT naming exactly `fields`, in order.
pub fn assert_bad_fields<T: std::fmt::Debug>(answer: Result<T, tonic::Status>, fields: &[&str]) {
    let status = answer.expect_err("refused as invalid");
    assert_invalid(&status, fields);
}
