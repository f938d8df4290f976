//! `idempotency.v1.AdminService`: decode, call the service's [`Admin`], encode. The door
//! (`auth_layer`) has already checked the caller's admin right and scope, and says who it is
//! ([`AdminCaller`]); each call counts `idempotency_admin_actions_total{action,outcome}`.

mod placement;

use std::pin::Pin;

use tokio_stream::Stream;
use tonic::{Code, Request, Response, Status};

use super::auth_layer::AdminCaller;
use super::convert::timestamp;
use super::status::{failed, invalid_argument};
use crate::domain::admin::{
    AdminKeyState, AuditFilter, EraseBatch, ForceReleased, KeyFilter, KeyPrefix, KeySummary,
    PageCursor, PageSize, Reason, decode_audit_token, encode_audit_token, parse_actor_filter,
};
use crate::domain::{Instant, Invalid, Key, Scope};
use crate::proto::idempotency::v1 as pb;
use crate::proto::idempotency::v1::admin_service_server::AdminService;
use crate::service::CoordinatorError;
use crate::service::admin::{Actor, Admin, EraseProgress};
use crate::store::StoreError;
use placement::{get_placement, move_placement};

pub struct AdminApi {
    admin: Admin,
}

impl AdminApi {
    pub fn new(admin: Admin) -> Self {
        Self { admin }
    }
}

/// Counts one admin call by its action and outcome (fixed sets: never a caller's value).
fn count(action: &'static str, outcome: &'static str) {
    metrics::counter!("idempotency_admin_actions_total", "action" => action, "outcome" => outcome)
        .increment(1);
}

/// The outcome label of a status.
fn outcome_of(status: &Status) -> &'static str {
    match status.code() {
        Code::Ok => "ok",
        Code::InvalidArgument => "invalid_argument",
        Code::NotFound => "not_found",
        Code::FailedPrecondition => "failed_precondition",
        Code::PermissionDenied => "permission_denied",
        Code::Unavailable => "unavailable",
        _ => "error",
    }
}

/// Counts `result` under `action` and passes it on.
fn counted<T>(action: &'static str, result: Result<T, Status>) -> Result<T, Status> {
    match &result {
        Ok(_) => count(action, "ok"),
        Err(status) => count(action, outcome_of(status)),
    }
    result
}

/// Every bad field of a request, at once (like the API's own requests).
#[derive(Default)]
struct Violations(Vec<(String, String)>);

impl Violations {
    fn check<T>(&mut self, field: &str, parsed: Result<T, Invalid>) -> Option<T> {
        match parsed {
            Ok(value) => Some(value),
            Err(Invalid(description)) => {
                self.0.push((field.to_owned(), description));
                None
            }
        }
    }

    fn done(self) -> Result<(), Status> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(self.into_status())
        }
    }

    /// The refusal of a request some field of which was refused.
    fn into_status(self) -> Status {
        invalid_argument(self.0)
    }

    /// A change `caller` asks for in a namespace, once its fields are checked: who changes what
    /// (`target`) in which namespace, or the refusal naming every bad field.
    fn into_change<T>(
        self,
        caller: String,
        namespace: Option<Scope>,
        target: Option<T>,
        reason: Option<Reason>,
    ) -> Result<(Actor, Scope, T), Status> {
        match (namespace, target, reason) {
            (Some(namespace), Some(target), Some(reason)) => Ok((
                Actor {
                    name: caller,
                    reason,
                },
                namespace,
                target,
            )),
            _ => Err(self.into_status()),
        }
    }
}

/// A bad field found after the others were checked: one violation.
fn bad_field(field: &str, description: String) -> Status {
    invalid_argument(vec![(field.to_owned(), description)])
}

fn instant(raw: prost_types::Timestamp) -> Result<Instant, Invalid> {
    let nanos = u32::try_from(raw.nanos)
        .ok()
        .filter(|nanos| *nanos < 1_000_000_000);
    nanos
        .and_then(|nanos| chrono::DateTime::from_timestamp(raw.seconds, nanos))
        .ok_or_else(|| Invalid("is not a valid timestamp".to_owned()))
}

fn state_filter(raw: i32) -> Result<Option<AdminKeyState>, Invalid> {
    match pb::AdminKeyState::try_from(raw) {
        Ok(pb::AdminKeyState::Unspecified) => Ok(None),
        Ok(pb::AdminKeyState::InProgress) => Ok(Some(AdminKeyState::InProgress)),
        Ok(pb::AdminKeyState::Stuck) => Ok(Some(AdminKeyState::Stuck)),
        Ok(pb::AdminKeyState::Completed) => Ok(Some(AdminKeyState::Completed)),
        Ok(pb::AdminKeyState::Released) => Ok(Some(AdminKeyState::Released)),
        Err(_) => Err(Invalid(format!("{raw} is not an AdminKeyState"))),
    }
}

fn state_message(state: AdminKeyState) -> pb::AdminKeyState {
    match state {
        AdminKeyState::InProgress => pb::AdminKeyState::InProgress,
        AdminKeyState::Stuck => pb::AdminKeyState::Stuck,
        AdminKeyState::Completed => pb::AdminKeyState::Completed,
        AdminKeyState::Released => pb::AdminKeyState::Released,
    }
}

pub fn key_entry(summary: KeySummary) -> pb::AdminKeyEntry {
    pb::AdminKeyEntry {
        key: summary.key,
        state: state_message(summary.state).into(),
        attempt: summary.attempt,
        lease_token: summary.lease_token.get().unsigned_abs(),
        lease_expires_at: Some(timestamp(summary.lease_expires_at)),
        completed_at: summary.completed_at.map(timestamp),
        expires_at: Some(timestamp(summary.expires_at)),
        retention: prost_types::Duration::try_from(summary.retention).ok(),
        fingerprint_hex: hex::encode(&summary.fingerprint),
        response_bytes: summary.response_bytes,
        checkpoint_bytes: summary.checkpoint_bytes,
        attempt_id: summary.attempt_id.unwrap_or_default(),
        claimed_at: summary.claimed_at.map(timestamp),
        holder: summary.holder.unwrap_or_default(),
        released_by: summary
            .released
            .as_ref()
            .map(|(by, _)| by.clone())
            .unwrap_or_default(),
        released_at: summary.released.map(|(_, at)| timestamp(at)),
    }
}

/// The status of a store failure in an admin call.
fn store_failed(error: StoreError, rpc: &'static str, namespace: &str) -> Status {
    failed(CoordinatorError::Store(error), rpc, namespace)
}

/// A request to change one key: `ForceRelease` and `EraseKey` name the key and give a reason.
trait KeyChangeRequest {
    /// The request's namespace, key and reason, unchecked.
    fn fields(self) -> (String, String, String);
}

impl KeyChangeRequest for pb::ForceReleaseRequest {
    fn fields(self) -> (String, String, String) {
        (self.namespace, self.key, self.reason)
    }
}

impl KeyChangeRequest for pb::EraseKeyRequest {
    fn fields(self) -> (String, String, String) {
        (self.namespace, self.key, self.reason)
    }
}

/// Who changes which key, and why: the caller, and the checked namespace, key and reason of a
/// change to one key (every bad field reported at once).
fn key_change(name: String, request: impl KeyChangeRequest) -> Result<(Actor, Scope, Key), Status> {
    let (namespace, key, reason) = request.fields();
    let mut violations = Violations::default();
    let namespace = violations.check("namespace", Scope::parse(namespace));
    let key = violations.check("key", Key::parse(key));
    let reason = violations.check("reason", Reason::parse(reason));
    violations.into_change(name, namespace, key, reason)
}

/// Who is calling, as the door said.
fn caller<T>(request: &Request<T>) -> Result<String, Status> {
    request
        .extensions()
        .get::<AdminCaller>()
        .map(|caller| caller.0.as_str().to_owned())
        .ok_or_else(|| Status::permission_denied("the admin API's door did not admit this call"))
}

fn erase_message(progress: EraseProgress) -> pb::EraseNamespaceResponse {
    pb::EraseNamespaceResponse {
        keys_erased: progress.keys,
        events_erased: progress.events,
        done: progress.done,
        audit_event_id: progress.audit_id.unsigned_abs(),
    }
}

/// A progress message, or for the end of an erasure that stopped before its namespace was
/// empty (a store failure, rows held longer than it waits, shutdown), `UNAVAILABLE` saying what
/// was erased: `done` promises that nothing of the namespace is left.
fn erase_item(progress: EraseProgress) -> Result<pb::EraseNamespaceResponse, Status> {
    if progress.done && progress.incomplete {
        return Err(Status::unavailable(format!(
            "the erasure stopped before the namespace was empty: {} keys and {} processed \
             events erased, the rest is still stored (audit event {}); erase the namespace again",
            progress.keys, progress.events, progress.audit_id
        )));
    }
    Ok(erase_message(progress))
}

type EraseStream = Pin<Box<dyn Stream<Item = Result<pb::EraseNamespaceResponse, Status>> + Send>>;

/// How many progress messages may wait for a slow reader; a slower one misses intermediate
/// ones (each carries the totals so far), never the last.
const PROGRESS_QUEUED: usize = 4;

/// What an RPC answers: its message, or the status it fails with.
type Answer<T> = Result<T, Status>;

/// The service's methods, all of one shape: each hands its request's message (and, for a
/// change, the caller) to the function of the same name below, which checks it, calls the
/// service and encodes its answer, and counts that answer under the method's name (the `action`
/// label).
macro_rules! counted_rpcs {
    ($($rpc:ident($request:ty $(, $who:ident)?) -> $response:ty;)*) => {
        #[tonic::async_trait]
        impl AdminService for AdminApi {
            type EraseNamespaceStream = EraseStream;

            $(
                async fn $rpc(
                    &self,
                    request: Request<$request>,
                ) -> Result<Response<$response>, Status> {
                    let answer = async {
                        $rpc(&self.admin, $($who(&request)?,)? request.into_inner()).await
                    };
                    counted(stringify!($rpc), answer.await.map(Response::new))
                }
            )*
        }
    };
}

counted_rpcs! {
    list_keys(pb::ListKeysRequest) -> pb::ListKeysResponse;
    get_key(pb::GetKeyRequest) -> pb::GetKeyResponse;
    namespace_stats(pb::NamespaceStatsRequest) -> pb::NamespaceStatsResponse;
    force_release(pb::ForceReleaseRequest, caller) -> pb::ForceReleaseResponse;
    erase_key(pb::EraseKeyRequest, caller) -> pb::EraseKeyResponse;
    erase_namespace(pb::EraseNamespaceRequest, caller) -> EraseStream;
    list_audit_events(pb::ListAuditEventsRequest) -> pb::ListAuditEventsResponse;
    move_placement(pb::MovePlacementRequest, caller) -> pb::MovePlacementResponse;
    get_placement(pb::GetPlacementRequest) -> pb::GetPlacementResponse;
}

async fn list_keys(admin: &Admin, request: pb::ListKeysRequest) -> Answer<pb::ListKeysResponse> {
    let mut violations = Violations::default();
    let namespace = violations.check("namespace", Scope::parse(request.namespace));
    let state = violations.check("state", state_filter(request.state));
    let key_prefix = violations.check("key_prefix", KeyPrefix::parse(request.key_prefix));
    let mut instant_field = |field: &str, raw: Option<prost_types::Timestamp>| match raw {
        None => Some(None),
        Some(raw) => violations.check(field, instant(raw)).map(Some),
    };
    let completed_after = instant_field("completed_after", request.completed_after);
    let completed_before = instant_field("completed_before", request.completed_before);
    let claimed_after = instant_field("claimed_after", request.claimed_after);
    let claimed_before = instant_field("claimed_before", request.claimed_before);
    let page = violations.check("page_size", PageSize::parse(request.page_size));
    let by_completion = completed_after.flatten().is_some() || completed_before.flatten().is_some();
    let by_claim = claimed_after.flatten().is_some() || claimed_before.flatten().is_some();
    let state_given = state.flatten();
    if state_given.is_some_and(|s| s != AdminKeyState::Completed) && by_completion {
        violations.0.push((
            "state".to_owned(),
            "completed_after and completed_before select completed keys only".to_owned(),
        ));
    }
    if by_claim && (by_completion || state_given == Some(AdminKeyState::Completed)) {
        violations.0.push((
            "claimed_after".to_owned(),
            "claimed_after and claimed_before select keys in progress only (a completed \
             key is found by completed_after and completed_before)"
                .to_owned(),
        ));
    }
    // The filter where every field of it was accepted (a refused one is None, and said).
    let filter = (|| {
        Some(KeyFilter {
            namespace: namespace?,
            state: state?,
            key_prefix: key_prefix?,
            completed_after: completed_after?,
            completed_before: completed_before?,
            claimed_after: claimed_after?,
            claimed_before: claimed_before?,
        })
    })();
    let (Some(filter), Some(page)) = (filter, page) else {
        return Err(violations.into_status());
    };
    violations.done()?;
    let after = if request.page_token.is_empty() {
        None
    } else {
        Some(
            PageCursor::decode(&request.page_token, filter.order())
                .map_err(|Invalid(description)| bad_field("page_token", description))?,
        )
    };
    let (keys, next) = admin
        .list_keys(&filter, after.as_ref(), page)
        .await
        .map_err(|error| store_failed(error, "ListKeys", filter.namespace.as_str()))?;
    Ok(pb::ListKeysResponse {
        keys: keys.into_iter().map(key_entry).collect(),
        next_page_token: next.map(|cursor| cursor.encode()).unwrap_or_default(),
    })
}

async fn get_key(admin: &Admin, request: pb::GetKeyRequest) -> Answer<pb::GetKeyResponse> {
    let mut violations = Violations::default();
    let namespace = violations.check("namespace", Scope::parse(request.namespace));
    let key = violations.check("key", Key::parse(request.key));
    let (Some(namespace), Some(key)) = (namespace, key) else {
        return Err(violations.into_status());
    };
    let found = admin
        .get_key(&namespace, &key)
        .await
        .map_err(|error| store_failed(error, "GetKey", namespace.as_str()))?
        .ok_or_else(|| Status::not_found("the key is absent"))?;
    Ok(pb::GetKeyResponse {
        key: Some(key_entry(found.summary)),
        response: found.response.unwrap_or_default(),
        checkpoint: found.checkpoint,
    })
}

async fn namespace_stats(
    admin: &Admin,
    request: pb::NamespaceStatsRequest,
) -> Answer<pb::NamespaceStatsResponse> {
    let namespace = Scope::parse(request.namespace)
        .map_err(|Invalid(description)| bad_field("namespace", description))?;
    let stats = admin
        .namespace_stats(&namespace)
        .await
        .map_err(|error| store_failed(error, "NamespaceStats", namespace.as_str()))?;
    let (oldest_key, oldest_at) = match stats.oldest_stuck {
        Some((key, at)) => (key, Some(timestamp(at))),
        None => (String::new(), None),
    };
    Ok(pb::NamespaceStatsResponse {
        in_progress_keys: stats.in_progress,
        stuck_keys: stats.stuck,
        released_keys: stats.released,
        completed_keys: stats.completed,
        processed_events: stats.processed_events,
        oldest_stuck_key: oldest_key,
        oldest_stuck_lease_expired_at: oldest_at,
        stored_bytes: stats.stored_bytes,
        read_at: Some(timestamp(stats.read_at)),
    })
}

async fn force_release(
    admin: &Admin,
    caller: String,
    request: pb::ForceReleaseRequest,
) -> Answer<pb::ForceReleaseResponse> {
    let (actor, namespace, key) = key_change(caller, request)?;
    match admin
        .force_release(&actor, &namespace, &key)
        .await
        .map_err(|error| store_failed(error, "ForceRelease", namespace.as_str()))?
    {
        ForceReleased::Released { before, audit_id } => Ok(pb::ForceReleaseResponse {
            released: Some(key_entry(*before)),
            audit_event_id: audit_id.unsigned_abs(),
        }),
        ForceReleased::Completed => Err(Status::failed_precondition(
            "the key is completed: only an in-progress key can be released (EraseKey deletes a \
             completed one)",
        )),
        ForceReleased::Absent => Err(Status::not_found("the key is absent")),
    }
}

async fn erase_key(
    admin: &Admin,
    caller: String,
    request: pb::EraseKeyRequest,
) -> Answer<pb::EraseKeyResponse> {
    let (actor, namespace, key) = key_change(caller, request)?;
    let (before, audit_id) = admin
        .erase_key(&actor, &namespace, &key)
        .await
        .map_err(|error| store_failed(error, "EraseKey", namespace.as_str()))?;
    Ok(pb::EraseKeyResponse {
        erased: before.map(key_entry),
        audit_event_id: audit_id.unsigned_abs(),
    })
}

async fn erase_namespace(
    admin: &Admin,
    caller: String,
    request: pb::EraseNamespaceRequest,
) -> Answer<EraseStream> {
    let mut violations = Violations::default();
    let namespace = violations.check("namespace", Scope::parse(request.namespace));
    let reason = violations.check("reason", Reason::parse(request.reason));
    let batch = violations.check("batch_size", EraseBatch::parse(request.batch_size));
    let (actor, namespace, batch) = violations.into_change(caller, namespace, batch, reason)?;
    let mut progress = admin
        .erase_namespace(&actor, &namespace, batch)
        .await
        .map_err(|error| store_failed(error, "EraseNamespace", namespace.as_str()))?;
    let (sender, receiver) = tokio::sync::mpsc::channel(PROGRESS_QUEUED);
    // Forwards progress until the erasure is done or the caller has gone; the erasure itself
    // goes on either way.
    tokio::spawn(async move {
        loop {
            let now = *progress.borrow_and_update();
            if sender.send(erase_item(now)).await.is_err() || now.done {
                return;
            }
            if progress.changed().await.is_err() {
                let last = *progress.borrow();
                if last != now {
                    let _ = sender.send(erase_item(last)).await;
                }
                return;
            }
        }
    });
    Ok(Box::pin(tokio_stream::wrappers::ReceiverStream::new(
        receiver,
    )))
}

async fn list_audit_events(
    admin: &Admin,
    request: pb::ListAuditEventsRequest,
) -> Answer<pb::ListAuditEventsResponse> {
    let mut violations = Violations::default();
    let namespace = violations.check("namespace", Scope::parse(request.namespace));
    let page = violations.check("page_size", PageSize::parse(request.page_size));
    let before = violations.check("page_token", decode_audit_token(&request.page_token));
    let key = if request.key.is_empty() {
        Some(None)
    } else {
        violations.check("key", Key::parse(request.key)).map(Some)
    };
    let actor = violations.check("actor", parse_actor_filter(request.actor));
    let (Some(namespace), Some(page), Some(before), Some(key), Some(actor)) =
        (namespace, page, before, key, actor)
    else {
        return Err(violations.into_status());
    };
    let filter = AuditFilter {
        namespace,
        key,
        actor,
    };
    let namespace = &filter.namespace;
    let (events, next) = admin
        .list_audit(&filter, before, page)
        .await
        .map_err(|error| store_failed(error, "ListAuditEvents", namespace.as_str()))?;
    Ok(pb::ListAuditEventsResponse {
        events: events
            .into_iter()
            .map(|event| pb::AuditEvent {
                id: event.id.unsigned_abs(),
                at: Some(timestamp(event.at)),
                actor: event.actor,
                action: event.action,
                namespace: event.namespace,
                key: event.key.unwrap_or_default(),
                reason: event.reason,
                record_before_json: event.record_before_json.unwrap_or_default(),
                outcome_json: event.outcome_json.unwrap_or_default(),
            })
            .collect(),
        next_page_token: next.map(encode_audit_token).unwrap_or_default(),
    })
}
