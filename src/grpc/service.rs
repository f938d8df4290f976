//! `idempotency.v1.IdempotencyService`: decode, call the coordinator, encode. One span per RPC
//! (at DEBUG without traces, see `rpc_span`) carries the namespace (once validated) and the
//! outcome; payloads never enter logs. With
//! traces on (`--otlp-endpoint`), the span also carries OpenTelemetry's RPC names and continues
//! the caller's trace when the call's metadata has a W3C `traceparent` (and `tracestate`).

use opentelemetry::propagation::Extractor;
use tonic::metadata::{KeyRef, MetadataMap};
use tonic::{Request, Response, Status};
use tracing::{Instrument, Span, field};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use super::connections::ResponseSize;
use super::convert;
use super::identity::CallerIdentity;
use super::status::{failed, reason};
use crate::domain::{ClaimKind, KeyState, Limits, Scope, TryStartOutcome};
use crate::proto::idempotency::v1 as pb;
use crate::proto::idempotency::v1::idempotency_service_server::IdempotencyService;
use crate::service::{Coordinator, CoordinatorError};

pub struct IdempotencyApi {
    coordinator: Coordinator,
    limits: Limits,
    /// `--metrics-namespace-labels`: the per-RPC counters carry the namespace.
    namespace_labels: bool,
}

impl IdempotencyApi {
    pub fn new(coordinator: Coordinator, limits: Limits, namespace_labels: bool) -> Self {
        Self {
            coordinator,
            limits,
            namespace_labels,
        }
    }
}

const SERVICE: &str = "idempotency.v1.IdempotencyService";

/// The RPC's span. With traces on, it is an OpenTelemetry server span named
/// `idempotency.v1.IdempotencyService/<Method>`, the child of the caller's span when `metadata`
/// carries its trace context (a root otherwise). Off, it is the log's span only, at DEBUG, and
/// the metadata is not read: at the default level no line of a call's own is written (the
/// lines of a failure name the RPC and namespace themselves, see `status::failed`), and a span
/// that no line shows would cost each call more than the rest of its logging (its fields
/// formatted on creation and on each record, then freed: about 8% of a lone TryStart's
/// instructions, BENCHMARKS.md).
fn rpc_span(rpc: &'static str, metadata: &MetadataMap) -> Span {
    if !crate::telemetry::traces_on() {
        return tracing::debug_span!("rpc", rpc, namespace = field::Empty, outcome = field::Empty);
    }
    let span = tracing::info_span!(
        "rpc",
        rpc,
        namespace = field::Empty,
        outcome = field::Empty,
        otel.name = format!("{SERVICE}/{rpc}"),
        otel.kind = "server",
        otel.status_code = field::Empty,
        rpc.system = "grpc",
        rpc.service = SERVICE,
        rpc.method = rpc,
        rpc.grpc.status_code = field::Empty,
    );
    let caller = opentelemetry::global::get_text_map_propagator(|propagator| {
        propagator.extract(&TraceHeaders(metadata))
    });
    // Fails only when the span is not exported, which traces_on rules out.
    let _ = span.set_parent(caller);
    span
}

/// The call's metadata as the W3C propagator reads it (`traceparent`, `tracestate`).
struct TraceHeaders<'a>(&'a MetadataMap);

impl Extractor for TraceHeaders<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|value| value.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|key| match key {
                KeyRef::Ascii(key) => Some(key.as_str()),
                KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

/// Records the answer's status code in the current span; an error of the server's (not the
/// caller's) marks the span failed, as OpenTelemetry's gRPC conventions say.
fn record_code(code: tonic::Code) {
    let span = Span::current();
    span.record("rpc.grpc.status_code", code as i32);
    if matches!(
        code,
        tonic::Code::Unknown
            | tonic::Code::DeadlineExceeded
            | tonic::Code::Unimplemented
            | tonic::Code::Internal
            | tonic::Code::Unavailable
            | tonic::Code::DataLoss
    ) {
        span.record("otel.status_code", "ERROR");
    }
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

/// A call of one RPC in one scope (its namespace, or consumer), once its request is parsed: what
/// its span, its log lines and its counters say of it.
struct Called {
    rpc: &'static str,
    scope: Scope,
}

impl IdempotencyApi {
    /// `rpc` called in `scope`, which the current span records.
    fn called(&self, rpc: &'static str, scope: &Scope) -> Called {
        Span::current().record("namespace", scope.as_str());
        Called {
            rpc,
            scope: scope.clone(),
        }
    }

    /// Adds `by` to the counter `name` with `labels`, and the namespace's label when
    /// `--metrics-namespace-labels` asks for it.
    fn count(
        &self,
        name: &'static str,
        labels: &[(&'static str, &'static str)],
        called: &Called,
        by: u64,
    ) {
        let mut all: Vec<metrics::Label> = labels
            .iter()
            .map(|&(key, value)| metrics::Label::from_static_parts(key, value))
            .collect();
        if self.namespace_labels {
            all.push(metrics::Label::new(
                "namespace",
                called.scope.as_str().to_owned(),
            ));
        }
        metrics::counter!(name, all).increment(by);
    }

    /// Records the outcome in the current span (and a refusal in the metrics) and turns a
    /// failure into its status.
    fn finish<T>(
        &self,
        called: &Called,
        result: Result<T, CoordinatorError>,
        outcome: impl FnOnce(&T) -> &'static str,
    ) -> Result<T, Status> {
        let span = Span::current();
        match result {
            Ok(value) => {
                let name = outcome(&value);
                span.record("outcome", name);
                record_code(tonic::Code::Ok);
                tracing::debug!(outcome = name, "rpc answered");
                Ok(value)
            }
            Err(error) => {
                let name = reason(&error);
                span.record("outcome", name);
                self.count(
                    "idempotency_refusals_total",
                    &[("rpc", called.rpc), ("reason", name)],
                    called,
                    1,
                );
                if matches!(error, CoordinatorError::Busy) {
                    // STORE_UNAVAILABLE because this coalescer's queue was full, told apart
                    // from a store that does not answer (the coalescers bear the RPCs' names).
                    metrics::counter!("idempotency_coalescer_refusals_total", "coalescer" => called.rpc)
                        .increment(1);
                }
                tracing::debug!(outcome = name, "rpc refused");
                let status = failed(error, called.rpc, called.scope.as_str());
                record_code(status.code());
                Err(status)
            }
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
    if let Err(status) = &result {
        Span::current().record("outcome", "INVALID_ARGUMENT");
        record_code(status.code());
    }
    result
}

#[tonic::async_trait]
impl IdempotencyService for IdempotencyApi {
    async fn try_start(
        &self,
        request: Request<pb::TryStartRequest>,
    ) -> Result<Response<pb::TryStartResponse>, Status> {
        let span = rpc_span("TryStart", request.metadata());
        async {
            let deadline = deadline(request.metadata());
            let holder = CallerIdentity::of(&request);
            let mut call = parsed(convert::try_start_call(request.into_inner(), &self.limits))?;
            call.command.holder = holder;
            let called = self.called("TryStart", &call.command.namespace);
            let outcome = self.finish(
                &called,
                self.coordinator
                    .try_start_waiting(call.command, call.wait, deadline)
                    .await,
                |o| o.name(),
            )?;
            self.count(
                "idempotency_try_start_total",
                &[("outcome", outcome.name())],
                &called,
                1,
            );
            if let TryStartOutcome::Started(claim) = &outcome {
                let counter = match claim.kind {
                    ClaimKind::Fresh => None,
                    ClaimKind::Takeover => Some("idempotency_try_start_takeovers_total"),
                    ClaimKind::Reentry => Some("idempotency_try_start_reentries_total"),
                };
                if let Some(counter) = counter {
                    self.count(counter, &[], &called, 1);
                }
            }
            let response = convert::try_start_response(outcome);
            // Only a new claim (or re-entry) is a write; the other answers read the key.
            let wrote = matches!(
                response.outcome,
                Some(pb::try_start_response::Outcome::Started(_))
            );
            Ok(sized(response, !wrote))
        }
        .instrument(span)
        .await
    }

    async fn complete(
        &self,
        request: Request<pb::CompleteRequest>,
    ) -> Result<Response<pb::CompleteResponse>, Status> {
        let span = rpc_span("Complete", request.metadata());
        async {
            let command = parsed(convert::complete_command(
                request.into_inner(),
                &self.limits,
            ))?;
            let called = self.called("Complete", &command.namespace);
            let completion = self.finish(
                &called,
                self.coordinator.complete(command).await,
                |_| "completed",
            )?;
            Ok(sized(convert::complete_response(completion), false))
        }
        .instrument(span)
        .await
    }

    async fn release(
        &self,
        request: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        let span = rpc_span("Release", request.metadata());
        async {
            let command = parsed(convert::release_command(request.into_inner()))?;
            let called = self.called("Release", &command.namespace);
            self.finish(
                &called,
                self.coordinator.release(command).await,
                |_| "released",
            )?;
            Ok(sized(pb::ReleaseResponse {}, false))
        }
        .instrument(span)
        .await
    }

    async fn extend_lease(
        &self,
        request: Request<pb::ExtendLeaseRequest>,
    ) -> Result<Response<pb::ExtendLeaseResponse>, Status> {
        let span = rpc_span("ExtendLease", request.metadata());
        async {
            let command = parsed(convert::extend_lease_command(
                request.into_inner(),
                &self.limits,
            ))?;
            let called = self.called("ExtendLease", &command.namespace);
            let lease_expires_at = self.finish(
                &called,
                self.coordinator.extend_lease(command).await,
                |_| "extended",
            )?;
            let response = pb::ExtendLeaseResponse {
                lease_expires_at: Some(convert::timestamp(lease_expires_at)),
            };
            Ok(sized(response, false))
        }
        .instrument(span)
        .await
    }

    async fn lookup(
        &self,
        request: Request<pb::LookupRequest>,
    ) -> Result<Response<pb::LookupResponse>, Status> {
        let span = rpc_span("Lookup", request.metadata());
        async {
            let query = parsed(convert::lookup_query(request.into_inner()))?;
            let called = self.called("Lookup", &query.namespace);
            let state =
                self.finish(
                    &called,
                    self.coordinator.lookup(query).await,
                    |state| match state {
                        KeyState::Absent => "absent",
                        KeyState::InProgress { .. } => "in_progress",
                        KeyState::Completed { .. } => "completed",
                    },
                )?;
            Ok(sized(convert::lookup_response(state), true))
        }
        .instrument(span)
        .await
    }

    async fn mark_processed(
        &self,
        request: Request<pb::MarkProcessedRequest>,
    ) -> Result<Response<pb::MarkProcessedResponse>, Status> {
        let span = rpc_span("MarkProcessed", request.metadata());
        async {
            let command = parsed(convert::mark_processed_command(
                request.into_inner(),
                &self.limits,
            ))?;
            let called = self.called("MarkProcessed", &command.consumer);
            let results = self.finish(
                &called,
                self.coordinator.mark_processed(command).await,
                |_| "marked",
            )?;
            let repeated = results
                .iter()
                .filter(|result| result.already_processed)
                .count();
            self.count(
                "idempotency_events_total",
                &[("result", "already_processed")],
                &called,
                repeated as u64,
            );
            self.count(
                "idempotency_events_total",
                &[("result", "new")],
                &called,
                (results.len() - repeated) as u64,
            );
            Ok(sized(convert::mark_processed_response(results), false))
        }
        .instrument(span)
        .await
    }
}
