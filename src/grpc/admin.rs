//! `idempotency.v1.AdminService`: decode, call the service's [`Admin`], encode. The door
//! (`auth_layer`) has already checked the caller's admin right and scope, and says who it is
//! ([`AdminCaller`]); each call counts `idempotency_admin_actions_total{action,outcome}`.

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

/// Who changes which key, and why: the checked namespace, key and reason of a change to one key
/// (every bad field reported at once).
fn key_change(
    name: String,
    namespace: String,
    key: String,
    reason: String,
) -> Result<(Actor, Scope, Key), Status> {
    let mut violations = Violations::default();
    let namespace = violations.check("namespace", Scope::parse(namespace));
    let key = violations.check("key", Key::parse(key));
    let reason = violations.check("reason", Reason::parse(reason));
    let (Some(namespace), Some(key), Some(reason)) = (namespace, key, reason) else {
        return Err(violations.into_status());
    };
    Ok((Actor { name, reason }, namespace, key))
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

#[tonic::async_trait]
impl AdminService for AdminApi {
    async fn list_keys(
        &self,
        request: Request<pb::ListKeysRequest>,
    ) -> Result<Response<pb::ListKeysResponse>, Status> {
        let request = request.into_inner();
        let answer = async {
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
            let by_completion =
                completed_after.flatten().is_some() || completed_before.flatten().is_some();
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
            let (
                Some(namespace),
                Some(state),
                Some(key_prefix),
                Some(completed_after),
                Some(completed_before),
                Some(claimed_after),
                Some(claimed_before),
                Some(page),
            ) = (
                namespace,
                state,
                key_prefix,
                completed_after,
                completed_before,
                claimed_after,
                claimed_before,
                page,
            )
            else {
                return Err(violations.into_status());
            };
            violations.done()?;
            let filter = KeyFilter {
                namespace,
                state,
                key_prefix,
                completed_after,
                completed_before,
                claimed_after,
                claimed_before,
            };
            let after = if request.page_token.is_empty() {
                None
            } else {
                Some(
                    PageCursor::decode(&request.page_token, filter.order())
                        .map_err(|Invalid(description)| bad_field("page_token", description))?,
                )
            };
            let (keys, next) = self
                .admin
                .list_keys(&filter, after.as_ref(), page)
                .await
                .map_err(|error| store_failed(error, "ListKeys", filter.namespace.as_str()))?;
            Ok(Response::new(pb::ListKeysResponse {
                keys: keys.into_iter().map(key_entry).collect(),
                next_page_token: next.map(|cursor| cursor.encode()).unwrap_or_default(),
            }))
        };
        counted("list_keys", answer.await)
    }

    async fn get_key(
        &self,
        request: Request<pb::GetKeyRequest>,
    ) -> Result<Response<pb::GetKeyResponse>, Status> {
        let request = request.into_inner();
        let answer = async {
            let mut violations = Violations::default();
            let namespace = violations.check("namespace", Scope::parse(request.namespace));
            let key = violations.check("key", Key::parse(request.key));
            let (Some(namespace), Some(key)) = (namespace, key) else {
                return Err(violations.into_status());
            };
            let found = self
                .admin
                .get_key(&namespace, &key)
                .await
                .map_err(|error| store_failed(error, "GetKey", namespace.as_str()))?
                .ok_or_else(|| Status::not_found("the key is absent"))?;
            Ok(Response::new(pb::GetKeyResponse {
                key: Some(key_entry(found.summary)),
                response: found.response.unwrap_or_default(),
                checkpoint: found.checkpoint,
            }))
        };
        counted("get_key", answer.await)
    }

    async fn namespace_stats(
        &self,
        request: Request<pb::NamespaceStatsRequest>,
    ) -> Result<Response<pb::NamespaceStatsResponse>, Status> {
        let request = request.into_inner();
        let answer = async {
            let namespace = Scope::parse(request.namespace)
                .map_err(|Invalid(description)| bad_field("namespace", description))?;
            let stats = self
                .admin
                .namespace_stats(&namespace)
                .await
                .map_err(|error| store_failed(error, "NamespaceStats", namespace.as_str()))?;
            let (oldest_key, oldest_at) = match stats.oldest_stuck {
                Some((key, at)) => (key, Some(timestamp(at))),
                None => (String::new(), None),
            };
            Ok(Response::new(pb::NamespaceStatsResponse {
                in_progress_keys: stats.in_progress,
                stuck_keys: stats.stuck,
                released_keys: stats.released,
                completed_keys: stats.completed,
                processed_events: stats.processed_events,
                oldest_stuck_key: oldest_key,
                oldest_stuck_lease_expired_at: oldest_at,
                stored_bytes: stats.stored_bytes,
                read_at: Some(timestamp(stats.read_at)),
            }))
        };
        counted("namespace_stats", answer.await)
    }

    async fn force_release(
        &self,
        request: Request<pb::ForceReleaseRequest>,
    ) -> Result<Response<pb::ForceReleaseResponse>, Status> {
        let answer = async {
            let name = caller(&request)?;
            let request = request.into_inner();
            let (actor, namespace, key) =
                key_change(name, request.namespace, request.key, request.reason)?;
            match self
                .admin
                .force_release(&actor, &namespace, &key)
                .await
                .map_err(|error| store_failed(error, "ForceRelease", namespace.as_str()))?
            {
                ForceReleased::Released { before, audit_id } => {
                    Ok(Response::new(pb::ForceReleaseResponse {
                        released: Some(key_entry(*before)),
                        audit_event_id: audit_id.unsigned_abs(),
                    }))
                }
                ForceReleased::Completed => Err(Status::failed_precondition(
                    "the key is completed: only an in-progress key can be released (EraseKey \
                     deletes a completed one)",
                )),
                ForceReleased::Absent => Err(Status::not_found("the key is absent")),
            }
        };
        counted("force_release", answer.await)
    }

    async fn erase_key(
        &self,
        request: Request<pb::EraseKeyRequest>,
    ) -> Result<Response<pb::EraseKeyResponse>, Status> {
        let answer = async {
            let name = caller(&request)?;
            let request = request.into_inner();
            let (actor, namespace, key) =
                key_change(name, request.namespace, request.key, request.reason)?;
            let (before, audit_id) = self
                .admin
                .erase_key(&actor, &namespace, &key)
                .await
                .map_err(|error| store_failed(error, "EraseKey", namespace.as_str()))?;
            Ok(Response::new(pb::EraseKeyResponse {
                erased: before.map(key_entry),
                audit_event_id: audit_id.unsigned_abs(),
            }))
        };
        counted("erase_key", answer.await)
    }

    type EraseNamespaceStream = EraseStream;

    async fn erase_namespace(
        &self,
        request: Request<pb::EraseNamespaceRequest>,
    ) -> Result<Response<Self::EraseNamespaceStream>, Status> {
        let answer = async {
            let name = caller(&request)?;
            let request = request.into_inner();
            let mut violations = Violations::default();
            let namespace = violations.check("namespace", Scope::parse(request.namespace));
            let reason = violations.check("reason", Reason::parse(request.reason));
            let batch = violations.check("batch_size", EraseBatch::parse(request.batch_size));
            let (Some(namespace), Some(reason), Some(batch)) = (namespace, reason, batch) else {
                return Err(violations.into_status());
            };
            let actor = Actor { name, reason };
            let mut progress = self
                .admin
                .erase_namespace(&actor, &namespace, batch)
                .await
                .map_err(|error| store_failed(error, "EraseNamespace", namespace.as_str()))?;
            let (sender, receiver) = tokio::sync::mpsc::channel(PROGRESS_QUEUED);
            // Forwards progress until the erasure is done or the caller has gone; the erasure
            // itself goes on either way.
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
            let stream: EraseStream =
                Box::pin(tokio_stream::wrappers::ReceiverStream::new(receiver));
            Ok(Response::new(stream))
        };
        counted("erase_namespace", answer.await)
    }

    async fn list_audit_events(
        &self,
        request: Request<pb::ListAuditEventsRequest>,
    ) -> Result<Response<pb::ListAuditEventsResponse>, Status> {
        let request = request.into_inner();
        let answer = async {
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
            let (events, next) = self
                .admin
                .list_audit(&filter, before, page)
                .await
                .map_err(|error| store_failed(error, "ListAuditEvents", namespace.as_str()))?;
            Ok(Response::new(pb::ListAuditEventsResponse {
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
            }))
        };
        counted("list_audit_events", answer.await)
    }
}
