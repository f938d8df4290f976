//! Prometheus metrics, served as text at `GET /metrics` on a port of their own
//! (`--metrics-listen`). Off unless asked for: then no recorder is installed and every
//! `metrics::counter!` in the code is a no-op.
//!
//! Recording goes through the `metrics` facade; `metrics-exporter-prometheus` keeps the values
//! and renders the exposition. The recorder is process-wide (the facade's global), installed by
//! the first service that asks for it. Gauges that describe a state (pool connections, waiters,
//! health, tokens, dropped log lines) are read from their source at each scrape, so that the hot
//! path pays nothing for them.
//!
//! No key, fingerprint, response or token ever becomes a label: labels are method names, status
//! codes, outcome and reason names, all from fixed sets.
//!
//! `grpc` counts and times every call at the edge (a tower layer); this file installs the
//! recorder, describes every series, and serves the exposition.

mod grpc;

pub use grpc::GrpcMetricsLayer;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use metrics::{Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::codegen::http;

/// Buckets of `grpc_server_handling_seconds` and the store's statement durations, in seconds:
/// from 0.1 ms (a coalesced call on an idle store) to 60 s (the longest TryStart wait).
const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0,
];
/// Buckets of the coalesced batch size (calls, or event ids for MarkProcessed).
const BATCH_BUCKETS: &[f64] = &[
    1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0,
];
/// How long a scraper may take to send its request and read the answer.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("the metrics recorder could not be built")]
    Build(#[from] metrics_exporter_prometheus::BuildError),
    #[error("another metrics recorder is installed in this process")]
    OtherRecorder,
}

static HANDLE: Mutex<Option<PrometheusHandle>> = Mutex::new(None);

/// Installs the process's Prometheus recorder (once; later calls share it) and describes every
/// metric. Every method's `grpc_server_started_total` starts at zero.
pub fn install() -> Result<PrometheusHandle, MetricsError> {
    let mut installed = HANDLE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(handle) = installed.as_ref() {
        return Ok(handle.clone());
    }
    let recorder = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".to_owned()), LATENCY_BUCKETS)?
        .set_buckets_for_metric(
            Matcher::Full("idempotency_coalesced_batch_size".to_owned()),
            BATCH_BUCKETS,
        )?
        .build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder).map_err(|_| MetricsError::OtherRecorder)?;
    describe();
    grpc::start_counts_at_zero();
    *installed = Some(handle.clone());
    Ok(handle)
}

fn describe() {
    describe_counter!("grpc_server_started_total", "RPCs started on the server.");
    describe_counter!(
        "grpc_server_handled_total",
        "RPCs completed on the server, regardless of success or failure."
    );
    describe_histogram!(
        "grpc_server_handling_seconds",
        Unit::Seconds,
        "Response latency of RPCs handled by the server, until the status was sent."
    );
    describe_counter!(
        "grpc_server_msg_received_total",
        "RPC stream messages received on the server."
    );
    describe_counter!(
        "grpc_server_msg_sent_total",
        "gRPC stream messages sent by the server."
    );
    describe_counter!(
        "idempotency_try_start_total",
        "TryStart answers by outcome (started, in_progress, completed, fingerprint_mismatch)."
    );
    describe_counter!(
        "idempotency_try_start_takeovers_total",
        "TryStarts that took over a key whose lease had run out (a new token, attempt + 1)."
    );
    describe_counter!(
        "idempotency_try_start_reentries_total",
        "TryStarts by the holder's own attempt_id: the same claim, its lease renewed."
    );
    describe_counter!(
        "idempotency_coalescer_refusals_total",
        "Calls refused STORE_UNAVAILABLE at once because their coalescer's queue was full, by coalescer."
    );
    describe_gauge!(
        "idempotency_coalescer_queue_depth",
        "Weight (calls, or event ids for MarkProcessed) queued or running in each coalescer now."
    );
    describe_gauge!(
        "idempotency_coalescer_queue_capacity",
        "The most weight each coalescer takes; beyond it, calls are refused."
    );
    describe_gauge!(
        "idempotency_store_commits_wait_for_standby",
        "PostgreSQL: 1 when the store's commits wait for a synchronous standby, else 0 (a failover can then lose acknowledged keys); read at every health check."
    );
    describe_gauge!(
        "idempotency_store_synchronous_standbys",
        "PostgreSQL: synchronous standbys attached to the primary (state=attached), and standbys whose state the role may not read (state=unknown)."
    );
    describe_gauge!(
        "idempotency_reaper_lag_seconds",
        Unit::Seconds,
        "Age of the oldest expired row not yet deleted, by table, read after each reaper sweep (0: none)."
    );
    describe_gauge!(
        "idempotency_stuck_keys",
        "Keys in progress whose lease ran out and that nobody took over, all namespaces, read after each reaper sweep."
    );
    describe_gauge!(
        "idempotency_oldest_stuck_key_seconds",
        Unit::Seconds,
        "How long ago the lease of the oldest stuck key ran out (0: none), read after each reaper sweep."
    );
    describe_counter!(
        "idempotency_admin_actions_total",
        "Calls of the admin API, by action (list_keys, get_key, namespace_stats, list_audit_events, force_release, erase_key, erase_namespace) and outcome."
    );
    describe_counter!(
        "idempotency_refusals_total",
        "Calls refused by the service, by RPC and ErrorInfo reason (LEASE_LOST, ALREADY_COMPLETED, ...)."
    );
    describe_counter!(
        "idempotency_events_total",
        "Event ids answered by MarkProcessed, by result (new, already_processed)."
    );
    describe_histogram!(
        "idempotency_store_seconds",
        Unit::Seconds,
        "Time the store took per statement, by operation (a coalesced round is one statement)."
    );
    describe_counter!(
        "idempotency_reaped_rows_total",
        "Expired rows deleted by the reaper, by table (keys, events)."
    );
    describe_counter!(
        "idempotency_coalesced_followers_total",
        "TryStarts answered from the store's last answer for their key in the batch, without a statement of their own, by coalescer."
    );
    describe_histogram!(
        "idempotency_coalesced_batch_size",
        "Weight of each coalesced batch (calls, or event ids for MarkProcessed), by coalescer."
    );
    describe_counter!(
        "idempotency_auth_refusals_total",
        "Calls refused at the door, by reason (unauthenticated, permission_denied, rate_limited)."
    );
    describe_gauge!(
        "idempotency_waiters",
        "TryStarts waiting for a key's holder now."
    );
    describe_gauge!(
        "idempotency_cluster_ready",
        "With --cluster: 1 while the cluster's last probe succeeded (its namespaces are served), else 0, by cluster."
    );
    describe_gauge!(
        "idempotency_pool_connections",
        "Store pool connections, by state (in_use, idle)."
    );
    describe_gauge!(
        "idempotency_health_status",
        "Serving status: 1 for the status the service reports now (SERVING, NOT_SERVING), 0 for the other."
    );
    describe_gauge!(
        "idempotency_tokens_loaded",
        "Tokens in the tokens file now in force (0 without a tokens file)."
    );
    describe_counter!(
        "idempotency_log_lines_dropped_total",
        "Log lines dropped because standard output refused them."
    );
    describe_counter!(
        "idempotency_replay_cache_lookups_total",
        "TryStarts and Lookups the replay cache answered (hit) or passed to the store (miss; unconfirmed: not looked at, no heartbeat heard back lately)."
    );
    describe_gauge!(
        "idempotency_replay_cache_bytes",
        "Bytes the replay cache holds, by its weights."
    );
    describe_gauge!(
        "idempotency_replay_cache_confirmed",
        "1 while a heartbeat heard back within the last second confirms that the replay cache has applied every erasure announced before it (it may serve), else 0."
    );
    describe_gauge!(
        "idempotency_held_keys",
        "Keys and event ids found locked by an outside transaction, whose calls wait on their own now."
    );
    describe_counter!(
        "idempotency_held_key_calls_total",
        "Calls that waited on their own (the held-key lane) for their key, locked by an outside transaction."
    );
    describe_counter!(
        "idempotency_stalled_statements_total",
        "Batches that waited 50 ms for a coalescer executor (the running statements stalled) and ran beside the executors instead."
    );
    describe_counter!(
        "idempotency_held_key_reruns_total",
        "Calls run again alone because their shared statement met a key locked by an outside transaction."
    );
}

/// The states read at each scrape.
#[derive(Clone)]
pub struct Sources {
    pub store: crate::store::AnyStore,
    pub health: crate::health::HealthState,
    pub waiters: Option<crate::service::waiting::Waiters>,
    pub authenticator: Option<Arc<crate::auth::Authenticator>>,
    pub coordinator: crate::service::Coordinator,
}

impl Sources {
    fn sample(&self) {
        // Each cluster's pool on its own (labelled with its name), or the one store's.
        for (cluster, part) in self.store.parts() {
            let (in_use, idle) = part.pool_connections();
            for (state, connections) in [("in_use", in_use), ("idle", idle)] {
                let labels: Vec<metrics::Label> = std::iter::once(("state", state.to_owned()))
                    .chain(cluster.clone().map(|name| ("cluster", name)))
                    .map(|(key, value)| metrics::Label::new(key, value))
                    .collect();
                gauge!("idempotency_pool_connections", labels).set(connections as f64);
            }
        }
        let serving = self.health.current() == crate::health::ServingStatus::Serving;
        gauge!("idempotency_health_status", "status" => "SERVING")
            .set(f64::from(u8::from(serving)));
        gauge!("idempotency_health_status", "status" => "NOT_SERVING")
            .set(f64::from(u8::from(!serving)));
        gauge!("idempotency_waiters")
            .set(self.waiters.as_ref().map_or(0, |waiters| waiters.waiting()) as f64);
        gauge!("idempotency_tokens_loaded").set(
            self.authenticator
                .as_ref()
                .map_or(0, |authenticator| authenticator.tokens_loaded()) as f64,
        );
        counter!("idempotency_log_lines_dropped_total")
            .absolute(crate::telemetry::dropped_log_lines());
        gauge!("idempotency_held_keys").set(self.coordinator.held_keys() as f64);
        for (coalescer, queued, capacity) in self.coordinator.coalescer_queues() {
            gauge!("idempotency_coalescer_queue_depth", "coalescer" => coalescer)
                .set(queued as f64);
            gauge!("idempotency_coalescer_queue_capacity", "coalescer" => coalescer)
                .set(capacity as f64);
        }
    }
}

/// Serves `GET /metrics` (HTTP/1.1) on `listener` until `shutdown`.
pub async fn serve(
    listener: TcpListener,
    handle: PrometheusHandle,
    sources: Sources,
    shutdown: CancellationToken,
) {
    let connections = tokio_util::task::TaskTracker::new();
    loop {
        let accepted = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(error) => {
                tracing::warn!(%error, "accepting a metrics connection failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let handle = handle.clone();
        let sources = sources.clone();
        let shutdown = shutdown.clone();
        connections.spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                let answer = answer(&request, &handle, &sources);
                async move { Ok::<_, std::convert::Infallible>(answer) }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .keep_alive(false)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            tokio::select! {
                () = shutdown.cancelled() => {}
                _ = tokio::time::timeout(SCRAPE_TIMEOUT, connection) => {}
            }
        });
    }
    connections.close();
    connections.wait().await;
}

fn answer<B>(
    request: &http::Request<B>,
    handle: &PrometheusHandle,
    sources: &Sources,
) -> http::Response<http_body_util::Full<Bytes>> {
    let respond = |status: http::StatusCode, content_type: &'static str, body: String| {
        let mut response = http::Response::new(http_body_util::Full::new(Bytes::from(body)));
        *response.status_mut() = status;
        response.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static(content_type),
        );
        response
    };
    if request.uri().path() != "/metrics" {
        return respond(
            http::StatusCode::NOT_FOUND,
            "text/plain",
            "not found\n".into(),
        );
    }
    if request.method() != http::Method::GET && request.method() != http::Method::HEAD {
        return respond(
            http::StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "GET only\n".into(),
        );
    }
    sources.sample();
    handle.run_upkeep();
    respond(
        http::StatusCode::OK,
        "text/plain; version=0.0.4; charset=utf-8",
        handle.render(),
    )
}

/// Binds the metrics listener.
pub async fn bind(address: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(address).await
}
