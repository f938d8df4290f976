//! The admin API (`idempotency.v1.AdminService`) through its generated client against the real
//! server, on both stores: listings and their filters, orders and pages (`keys`), the recorded
//! changes and the audit trail (`changes`; its filters by key and operator, `audit_filters`), who may call it (`access`), its metrics
//! (`metrics`), the CLI as a real process (`cli`), its
//! own refusals (`cli_checks`) and its guarded erasures (`erase_guard`), an erasure honoured by
//! every replica before it returns (`honoured`, PostgreSQL), a released key shown
//! as released (`released`), the operations guide's walkthrough run as
//! written (`walkthrough`), and its cost on a large table (`scale`,
//! PostgreSQL).

mod access;
mod audit_filters;
mod changes;
mod cli;
mod cli_checks;
mod erase_guard;
mod holders;
mod honoured;
mod keys;
mod metrics;
mod released;
mod scale;
mod walkthrough;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

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
    AdminServiceClient::with_interceptor(channel_to(endpoint).await, bearer)
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

/// A listing of the audit trail of `namespace`, unfiltered, newest first.
pub fn audit_of(namespace: &str) -> pb::ListAuditEventsRequest {
    pb::ListAuditEventsRequest {
        namespace: namespace.into(),
        ..Default::default()
    }
}

/// The newest audit events of the test namespace.
pub async fn audit_events(admin: &AdminClient) -> Vec<pb::AuditEvent> {
    let trail = admin.clone().list_audit_events(audit_of(NAMESPACE)).await;
    answered(trail, "ListAuditEvents").events
}

/// Every page of a listing (at most `request.page_size` keys each), in order: the keys of each.
pub async fn pages_of(
    admin: &AdminClient,
    request: pb::ListKeysRequest,
) -> Vec<Vec<pb::AdminKeyEntry>> {
    let mut pages = Vec::new();
    let mut page_token = String::new();
    loop {
        let page = pb::ListKeysRequest {
            page_token,
            ..request.clone()
        };
        let page = answered(admin.clone().list_keys(page).await, "ListKeys");
        pages.push(page.keys);
        if page.next_page_token.is_empty() {
            return pages;
        }
        page_token = page.next_page_token;
    }
}

pub fn get_key(key: &str) -> pb::GetKeyRequest {
    pb::GetKeyRequest {
        namespace: NAMESPACE.into(),
        key: key.into(),
    }
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

/// ForceRelease of `key` (of the test namespace) for `reason`, which must answer.
pub async fn released(admin: &AdminClient, key: &str, reason: &str) -> pb::ForceReleaseResponse {
    answered(
        admin
            .clone()
            .force_release(force_release(key, reason))
            .await,
        "ForceRelease",
    )
}

/// EraseKey of `key` (of the test namespace) for `reason`, which must answer.
pub async fn erased(admin: &AdminClient, key: &str, reason: &str) -> pb::EraseKeyResponse {
    answered(
        admin.clone().erase_key(erase_key(key, reason)).await,
        "EraseKey",
    )
}

/// Begins erasing `namespace`; answers its stream of progress messages.
pub async fn erase_stream(
    admin: &AdminClient,
    namespace: &str,
    batch_size: u32,
) -> tonic::Streaming<pb::EraseNamespaceResponse> {
    answered(
        admin
            .clone()
            .erase_namespace(pb::EraseNamespaceRequest {
                namespace: namespace.into(),
                reason: "the tenant left".into(),
                batch_size,
            })
            .await,
        "EraseNamespace",
    )
}

/// Erases `namespace` and answers every progress message of its stream.
pub async fn erase_namespace(
    admin: &AdminClient,
    namespace: &str,
    batch_size: u32,
) -> Vec<pb::EraseNamespaceResponse> {
    let mut stream = erase_stream(admin, namespace, batch_size).await;
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

/// Callers that keep claiming fresh keys of namespace `live-traffic` until stopped, counting
/// the calls answered and failed: the traffic an erasure must not stall.
pub struct Traffic {
    stop: Arc<AtomicBool>,
    answered: Arc<AtomicUsize>,
    failed: Arc<AtomicUsize>,
    callers: Vec<tokio::task::JoinHandle<()>>,
}

impl Traffic {
    pub fn start(client: &Client, callers: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let (answered, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let callers = (0..callers)
            .map(|caller| {
                let mut client = client.clone();
                let (stop, answered, failed) = (stop.clone(), answered.clone(), failed.clone());
                tokio::spawn(async move {
                    let mut index = 0;
                    while !stop.load(Ordering::Relaxed) {
                        index += 1;
                        let request = try_start(&format!("live-{caller}-{index}"))
                            .in_namespace("live-traffic".into());
                        match client.try_start(request).await {
                            Ok(_) => answered.fetch_add(1, Ordering::Relaxed),
                            Err(_) => failed.fetch_add(1, Ordering::Relaxed),
                        };
                    }
                })
            })
            .collect();
        Self {
            stop,
            answered,
            failed,
            callers,
        }
    }

    /// Stops the callers; answers how many calls were answered and how many failed.
    pub async fn stop(self) -> (usize, usize) {
        self.stop.store(true, Ordering::Relaxed);
        for caller in self.callers {
            caller.await.expect("caller");
        }
        (
            self.answered.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
        )
    }
}
