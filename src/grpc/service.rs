//! `idempotency.v1.IdempotencyService`: decode, call the coordinator, encode. One span per RPC
//! carries the namespace (once validated) and the outcome; payloads never enter logs.

use tonic::{Request, Response, Status};
use tracing::{Instrument, Span, field};

use super::connections::ResponseSize;
use super::convert;
use super::status::reason;
use crate::domain::{KeyState, Limits, TryStartOutcome};
use crate::proto::idempotency::v1 as pb;
use crate::proto::idempotency::v1::idempotency_service_server::IdempotencyService;
use crate::service::{Coordinator, CoordinatorError};

pub struct IdempotencyApi {
    coordinator: Coordinator,
    limits: Limits,
}

impl IdempotencyApi {
    pub fn new(coordinator: Coordinator, limits: Limits) -> Self {
        Self {
            coordinator,
            limits,
        }
    }
}

fn rpc_span(rpc: &'static str) -> Span {
    tracing::info_span!("rpc", rpc, namespace = field::Empty, outcome = field::Empty)
}

/// When the caller stops waiting, from its `grpc-timeout` header (gRPC over HTTP/2: up to 8
/// digits and a unit, H M S m u n), if it sent one.
fn deadline(metadata: &tonic::metadata::MetadataMap) -> Option<tokio::time::Instant> {
    let value = metadata.get("grpc-timeout")?.to_str().ok()?;
    let split = value.len().checked_sub(1)?;
    let (digits, unit) = (value.get(..split)?, value.get(split..)?);
    if digits.is_empty() || digits.len() > 8 {
        return None;
    }
    let amount: u64 = digits.parse().ok()?;
    let timeout = match unit {
        "H" => std::time::Duration::from_secs(amount.checked_mul(3600)?),
        "M" => std::time::Duration::from_secs(amount.checked_mul(60)?),
        "S" => std::time::Duration::from_secs(amount),
        "m" => std::time::Duration::from_millis(amount),
        "u" => std::time::Duration::from_micros(amount),
        "n" => std::time::Duration::from_nanos(amount),
        _ => return None,
    };
    tokio::time::Instant::now().checked_add(timeout)
}

fn record_scope(scope: &str) {
    Span::current().record("namespace", scope);
}

/// Records the outcome in the current span (and a refusal in the metrics) and turns a failure
/// into its status.
fn finish<T>(
    rpc: &'static str,
    result: Result<T, CoordinatorError>,
    outcome: impl FnOnce(&T) -> &'static str,
) -> Result<T, Status> {
    let span = Span::current();
    match result {
        Ok(value) => {
            let name = outcome(&value);
            span.record("outcome", name);
            tracing::debug!(outcome = name, "rpc answered");
            Ok(value)
        }
        Err(error) => {
            let name = reason(&error);
            span.record("outcome", name);
            metrics::counter!("idempotency_refusals_total", "rpc" => rpc, "reason" => name)
                .increment(1);
            tracing::debug!(outcome = name, "rpc refused");
            Err(error.into())
        }
    }
}

/// A response carrying its size, for the response budget (see `connections`). `refusable`: the
/// call wrote nothing, so its response may be refused while too many response bytes wait for
/// their clients.
fn sized<M: prost::Message>(message: M, refusable: bool) -> Response<M> {
    let size = ResponseSize {
        bytes: message.encoded_len() as u64,
        refusable,
    };
    let mut response = Response::new(message);
    response.extensions_mut().insert(size);
    response
}

/// Parses a request, recording INVALID_ARGUMENT as the outcome when it fails.
fn parsed<T>(result: Result<T, Status>) -> Result<T, Status> {
    if result.is_err() {
        Span::current().record("outcome", "INVALID_ARGUMENT");
    }
    result
}

#[tonic::async_trait]
impl IdempotencyService for IdempotencyApi {
    async fn try_start(
        &self,
        request: Request<pb::TryStartRequest>,
    ) -> Result<Response<pb::TryStartResponse>, Status> {
        async {
            let deadline = deadline(request.metadata());
            let call = parsed(convert::try_start_call(request.into_inner(), &self.limits))?;
            record_scope(call.command.namespace.as_str());
            let outcome = finish(
                "TryStart",
                self.coordinator
                    .try_start_waiting(call.command, call.wait, deadline)
                    .await,
                |o| o.name(),
            )?;
            metrics::counter!("idempotency_try_start_total", "outcome" => outcome.name())
                .increment(1);
            if let TryStartOutcome::Started(claim) = &outcome
                && claim.attempt > 1
            {
                metrics::counter!("idempotency_try_start_takeovers_total").increment(1);
            }
            let response = convert::try_start_response(outcome);
            // Only a new claim (or re-entry) is a write; the other answers read the key.
            let wrote = matches!(
                response.outcome,
                Some(pb::try_start_response::Outcome::Started(_))
            );
            Ok(sized(response, !wrote))
        }
        .instrument(rpc_span("TryStart"))
        .await
    }

    async fn complete(
        &self,
        request: Request<pb::CompleteRequest>,
    ) -> Result<Response<pb::CompleteResponse>, Status> {
        async {
            let command = parsed(convert::complete_command(
                request.into_inner(),
                &self.limits,
            ))?;
            record_scope(command.namespace.as_str());
            let completion = finish(
                "Complete",
                self.coordinator.complete(command).await,
                |_| "completed",
            )?;
            Ok(sized(convert::complete_response(completion), false))
        }
        .instrument(rpc_span("Complete"))
        .await
    }

    async fn release(
        &self,
        request: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        async {
            let command = parsed(convert::release_command(request.into_inner()))?;
            record_scope(command.namespace.as_str());
            finish(
                "Release",
                self.coordinator.release(command).await,
                |_| "released",
            )?;
            Ok(sized(pb::ReleaseResponse {}, false))
        }
        .instrument(rpc_span("Release"))
        .await
    }

    async fn extend_lease(
        &self,
        request: Request<pb::ExtendLeaseRequest>,
    ) -> Result<Response<pb::ExtendLeaseResponse>, Status> {
        async {
            let command = parsed(convert::extend_lease_command(
                request.into_inner(),
                &self.limits,
            ))?;
            record_scope(command.namespace.as_str());
            let lease_expires_at = finish(
                "ExtendLease",
                self.coordinator.extend_lease(command).await,
                |_| "extended",
            )?;
            let response = pb::ExtendLeaseResponse {
                lease_expires_at: Some(convert::timestamp(lease_expires_at)),
            };
            Ok(sized(response, false))
        }
        .instrument(rpc_span("ExtendLease"))
        .await
    }

    async fn lookup(
        &self,
        request: Request<pb::LookupRequest>,
    ) -> Result<Response<pb::LookupResponse>, Status> {
        async {
            let query = parsed(convert::lookup_query(request.into_inner()))?;
            record_scope(query.namespace.as_str());
            let state = finish(
                "Lookup",
                self.coordinator.lookup(query).await,
                |state| match state {
                    KeyState::Absent => "absent",
                    KeyState::InProgress { .. } => "in_progress",
                    KeyState::Completed { .. } => "completed",
                },
            )?;
            Ok(sized(convert::lookup_response(state), true))
        }
        .instrument(rpc_span("Lookup"))
        .await
    }

    async fn mark_processed(
        &self,
        request: Request<pb::MarkProcessedRequest>,
    ) -> Result<Response<pb::MarkProcessedResponse>, Status> {
        async {
            let command = parsed(convert::mark_processed_command(
                request.into_inner(),
                &self.limits,
            ))?;
            record_scope(command.consumer.as_str());
            let results = finish(
                "MarkProcessed",
                self.coordinator.mark_processed(command).await,
                |_| "marked",
            )?;
            let repeated = results
                .iter()
                .filter(|result| result.already_processed)
                .count();
            metrics::counter!("idempotency_events_total", "result" => "already_processed")
                .increment(repeated as u64);
            metrics::counter!("idempotency_events_total", "result" => "new")
                .increment((results.len() - repeated) as u64);
            Ok(sized(convert::mark_processed_response(results), false))
        }
        .instrument(rpc_span("MarkProcessed"))
        .await
    }
}
