//! Traces (`--otlp-endpoint`): the real binary exports its spans over OTLP/gRPC to a small
//! collector run by the test (the collector's own `TraceService`, from `opentelemetry-proto`).
//! A call that carries a W3C `traceparent` gets a server span that is the child of the caller's
//! span, in the caller's trace, with the caller's `tracestate`; its store statement is a child
//! of that span; a call without one starts a trace of its own; a coalesced round is one
//! statement span, the child of its first call's span and linked to the others'. The spans are
//! received after SIGTERM, so the flush at shutdown is proven too. A bad endpoint is refused at
//! start, naming the flag.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use tokio_util::sync::CancellationToken;

use crate::support::process::{ServerProcess, coordinator};
use crate::support::*;

/// A span as received, with its resource's `service.name`.
#[derive(Debug, Clone)]
struct Received {
    span: Span,
    service_name: Option<String>,
}

/// An OTLP/gRPC trace collector on a free port of the loopback, keeping what it receives.
struct Collector {
    endpoint: String,
    received: Arc<Mutex<Vec<Received>>>,
    stop: CancellationToken,
}

#[derive(Clone)]
struct Keeper(Arc<Mutex<Vec<Received>>>);

#[tonic::async_trait]
impl TraceService for Keeper {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut kept = self.0.lock().expect("the collector's spans");
        for resource_spans in request.into_inner().resource_spans {
            let service_name = resource_spans
                .resource
                .as_ref()
                .and_then(|resource| string_attribute(&resource.attributes, "service.name"));
            for scope in resource_spans.scope_spans {
                for span in scope.spans {
                    kept.push(Received {
                        span,
                        service_name: service_name.clone(),
                    });
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

impl Collector {
    async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the collector");
        let address = listener.local_addr().expect("the collector's address");
        let received = Arc::new(Mutex::new(Vec::new()));
        let stop = CancellationToken::new();
        let server = tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(Keeper(received.clone())))
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                stop.clone().cancelled_owned(),
            );
        tokio::spawn(server);
        Self {
            endpoint: format!("http://{address}"),
            received,
            stop,
        }
    }

    fn spans(&self) -> Vec<Received> {
        self.received.lock().expect("the collector's spans").clone()
    }
}

impl Drop for Collector {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn string_attribute(attributes: &[KeyValue], key: &str) -> Option<String> {
    attributes
        .iter()
        .find(|attribute| attribute.key == key)
        .and_then(|attribute| attribute.value.as_ref())
        .and_then(|value| match &value.value {
            Some(Value::StringValue(text)) => Some(text.clone()),
            Some(Value::IntValue(number)) => Some(number.to_string()),
            _ => None,
        })
}

/// Every text attribute of a span (key and value), to look for what must never be there.
fn attribute_texts(span: &Span) -> Vec<String> {
    span.attributes
        .iter()
        .flat_map(|attribute| {
            let value = match attribute.value.as_ref().and_then(|v| v.value.as_ref()) {
                Some(Value::StringValue(text)) => Some(text.clone()),
                _ => None,
            };
            std::iter::once(attribute.key.clone()).chain(value)
        })
        .collect()
}

fn random_hex(bytes: usize) -> String {
    let uuid = uuid::Uuid::new_v4();
    hex_of(&uuid.as_bytes()[..bytes])
}

fn hex_of(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// `request` with the caller's trace context in its metadata.
fn traced<T>(request: T, traceparent: &str, tracestate: &str) -> tonic::Request<T> {
    let mut request = tonic::Request::new(request);
    request.metadata_mut().insert(
        "traceparent",
        traceparent.parse().expect("a valid metadata value"),
    );
    request.metadata_mut().insert(
        "tracestate",
        tracestate.parse().expect("a valid metadata value"),
    );
    request
}

fn named<'a>(spans: &'a [Received], name: &str) -> Vec<&'a Received> {
    spans
        .iter()
        .filter(|received| received.span.name == name)
        .collect()
}

fn db_system(backend: Backend) -> &'static str {
    match backend {
        Backend::Postgres => "postgresql",
        Backend::Sqlite => "sqlite",
    }
}

/// Stops the server with SIGTERM: what it still buffers is exported before it exits.
async fn stop(mut server: ServerProcess) {
    server.signal("TERM");
    assert_eq!(server.wait(Duration::from_secs(30)).await, Some(0));
}

async fn an_rpc_span_joins_the_callers_trace_and_its_statement_is_its_child(backend: Backend) {
    let collector = Collector::start().await;
    let database = TestDatabase::create(backend).await;
    let server =
        ServerProcess::start(&database.url, &["--otlp-endpoint", &collector.endpoint]).await;
    let mut client = server.client_when_serving().await;

    let trace_id = random_hex(16);
    let caller_span = random_hex(8);
    let traceparent = format!("00-{trace_id}-{caller_span}-01");
    let key = unique_key("traced-secret-key");
    let claimed = client
        .try_start(traced(try_start(&key), &traceparent, "congo=t61rcWkgMzE"))
        .await
        .expect("TryStart")
        .into_inner();
    let started = expect_started(claimed);
    let response = b"the-secret-response";
    client
        .complete(traced(
            complete(&key, started.lease_token, response),
            &traceparent,
            "congo=t61rcWkgMzE",
        ))
        .await
        .expect("Complete");
    // Without a trace context: a trace of its own. Another key: this one is completed, and its
    // Lookup would be answered from the replay cache, without a statement.
    key_state(&client, &unique_key("untraced")).await;
    stop(server).await;

    let spans = collector.spans();
    let try_starts = named(&spans, "idempotency.v1.IdempotencyService/TryStart");
    assert_eq!(try_starts.len(), 1, "{spans:#?}");
    let rpc = &try_starts[0].span;
    assert_eq!(hex_of(&rpc.trace_id), trace_id, "the caller's trace");
    assert_eq!(
        hex_of(&rpc.parent_span_id),
        caller_span,
        "the caller's span"
    );
    assert_eq!(rpc.trace_state, "congo=t61rcWkgMzE");
    assert_eq!(rpc.kind, SpanKind::Server as i32);
    assert_eq!(
        string_attribute(&rpc.attributes, "rpc.method").as_deref(),
        Some("TryStart")
    );
    assert_eq!(
        string_attribute(&rpc.attributes, "namespace").as_deref(),
        Some(NAMESPACE)
    );
    assert_eq!(
        string_attribute(&rpc.attributes, "outcome").as_deref(),
        Some("started")
    );
    assert_eq!(
        string_attribute(&rpc.attributes, "rpc.grpc.status_code").as_deref(),
        Some("0")
    );
    assert_eq!(
        try_starts[0].service_name.as_deref(),
        Some("idempotency-coordinator")
    );

    let statements = named(&spans, "store TryStart");
    assert_eq!(statements.len(), 1, "{spans:#?}");
    let statement = &statements[0].span;
    assert_eq!(statement.trace_id, rpc.trace_id);
    assert_eq!(
        statement.parent_span_id, rpc.span_id,
        "a child of the RPC's span"
    );
    assert_eq!(statement.kind, SpanKind::Client as i32);
    assert_eq!(
        string_attribute(&statement.attributes, "db.system.name").as_deref(),
        Some(db_system(backend))
    );
    assert!(statement.start_time_unix_nano >= rpc.start_time_unix_nano);

    // Complete, in the same trace, as another child of the caller's span.
    let completes = named(&spans, "idempotency.v1.IdempotencyService/Complete");
    assert_eq!(completes.len(), 1, "{spans:#?}");
    assert_eq!(hex_of(&completes[0].span.trace_id), trace_id);
    assert_eq!(hex_of(&completes[0].span.parent_span_id), caller_span);
    let complete_statement = named(&spans, "store Complete");
    assert_eq!(complete_statement.len(), 1, "{spans:#?}");
    assert_eq!(
        complete_statement[0].span.parent_span_id,
        completes[0].span.span_id
    );

    // The Lookup without a trace context is a root, in a new trace, with its statement.
    let lookups = named(&spans, "idempotency.v1.IdempotencyService/Lookup");
    assert_eq!(lookups.len(), 1, "{spans:#?}");
    let root = &lookups[0].span;
    assert!(root.parent_span_id.is_empty(), "a root span: {root:?}");
    assert_ne!(hex_of(&root.trace_id), trace_id);
    assert_eq!(root.trace_id.len(), 16);
    let lookup_statement = named(&spans, "store Lookup");
    assert_eq!(lookup_statement.len(), 1, "{spans:#?}");
    assert_eq!(lookup_statement[0].span.parent_span_id, root.span_id);
    assert_eq!(lookup_statement[0].span.trace_id, root.trace_id);

    // No key, fingerprint, response or token in any attribute.
    let token = started.lease_token.to_string();
    let fingerprint = String::from_utf8_lossy(FINGERPRINT).into_owned();
    for received in &spans {
        for text in attribute_texts(&received.span) {
            for secret in [key.as_str(), fingerprint.as_str(), "the-secret-response"] {
                assert!(
                    !text.contains(secret),
                    "{secret} in a span attribute: {:?}",
                    received.span
                );
            }
            assert!(
                text != token && !text.contains("token"),
                "a lease token in a span: {:?}",
                received.span
            );
        }
    }
}

async fn a_coalesced_round_is_one_statement_span_linked_to_every_call(backend: Backend) {
    let collector = Collector::start().await;
    let database = TestDatabase::create(backend).await;
    let server = ServerProcess::start(
        &database.url,
        &[
            "--otlp-endpoint",
            &collector.endpoint,
            "--coalesce-executors",
            "1",
            "--metrics-listen",
            "127.0.0.1:0",
            "--operation-timeout",
            "30s",
        ],
    )
    .await;
    let client = server.client_when_serving().await;
    let metrics_address = metrics_address(&server);

    // The one executor is kept busy by a claim whose statement the database does not answer
    // (a key held from outside would not do: its claim leaves the shared path after 20 ms);
    // the calls that queue meanwhile go to the store together, as one round, once it answers.
    claim(&mut client.clone(), try_start(&unique_key("warm"))).await;
    let hold = database.stall_writes().await;
    let blocked_key = unique_key("stalled");
    let blocked = {
        let mut client = client.clone();
        let request = try_start(&blocked_key);
        tokio::spawn(async move { client.try_start(request).await })
    };
    queue_depth_reaches(metrics_address, 1).await;
    let trace_ids: Vec<String> = (0..3).map(|_| random_hex(16)).collect();
    let mut queued = Vec::new();
    for trace_id in &trace_ids {
        let mut client = client.clone();
        let request = traced(
            try_start(&unique_key("queued")),
            &format!("00-{trace_id}-{}-01", random_hex(8)),
            "",
        );
        queued.push(tokio::spawn(async move { client.try_start(request).await }));
    }
    queue_depth_reaches(metrics_address, 4).await;
    hold.end().await;
    blocked
        .await
        .expect("the blocked call's task")
        .expect("the blocked TryStart");
    for call in queued {
        expect_started(
            call.await
                .expect("a queued call's task")
                .expect("a queued TryStart")
                .into_inner(),
        );
    }
    stop(server).await;

    let spans = collector.spans();
    let rpc_of = |trace_id: &str| {
        named(&spans, "idempotency.v1.IdempotencyService/TryStart")
            .into_iter()
            .find(|received| hex_of(&received.span.trace_id) == trace_id)
            .map(|received| received.span.clone())
            .unwrap_or_else(|| panic!("no TryStart span in trace {trace_id}: {spans:#?}"))
    };
    let rpcs: Vec<Span> = trace_ids.iter().map(|id| rpc_of(id)).collect();
    // The one statement of the three: a child of one of them, linked to the two others.
    let rounds: Vec<&Received> = named(&spans, "store TryStart")
        .into_iter()
        .filter(|received| {
            rpcs.iter()
                .any(|rpc| rpc.span_id == received.span.parent_span_id)
        })
        .collect();
    assert_eq!(
        rounds.len(),
        1,
        "one statement for the three calls: {spans:#?}"
    );
    let round = &rounds[0].span;
    assert_eq!(
        string_attribute(&round.attributes, "db.operation.batch.size").as_deref(),
        Some("3")
    );
    let parent = rpcs
        .iter()
        .find(|rpc| rpc.span_id == round.parent_span_id)
        .expect("the round's parent is one of the calls");
    assert_eq!(round.trace_id, parent.trace_id);
    let mut linked: Vec<(Vec<u8>, Vec<u8>)> = round
        .links
        .iter()
        .map(|link| (link.trace_id.clone(), link.span_id.clone()))
        .collect();
    linked.sort();
    let mut others: Vec<(Vec<u8>, Vec<u8>)> = rpcs
        .iter()
        .filter(|rpc| rpc.span_id != parent.span_id)
        .map(|rpc| (rpc.trace_id.clone(), rpc.span_id.clone()))
        .collect();
    others.sort();
    assert_eq!(linked, others, "linked to the other calls' spans");
}

fn metrics_address(server: &ServerProcess) -> std::net::SocketAddr {
    let output = server.output();
    let line = output
        .lines()
        .find(|line| line.contains("serving metrics at /metrics"))
        .unwrap_or_else(|| panic!("the metrics address is logged: {output}"));
    let address = line
        .split("address=")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("an address in {line}"));
    address.parse().expect("a socket address")
}

/// Waits until the TryStart coalescer holds `depth` calls (queued or running).
async fn queue_depth_reaches(metrics: std::net::SocketAddr, depth: u32) {
    let series = "idempotency_coalescer_queue_depth{coalescer=\"TryStart\"}";
    eventually(
        Duration::from_secs(10),
        &format!("{series} reaches {depth}"),
        || async move {
            let (_, body) = crate::metrics::http_get(metrics, "/metrics").await;
            crate::metrics::samples(&body).get(series).copied() == Some(f64::from(depth))
        },
    )
    .await;
}

for_each_backend!(
    an_rpc_span_joins_the_callers_trace_and_its_statement_is_its_child,
    a_coalesced_round_is_one_statement_span_linked_to_every_call
);

#[tokio::test]
async fn otel_service_name_and_the_standard_endpoint_variable_are_honoured() {
    let collector = Collector::start().await;
    let database = TestDatabase::create(Backend::Sqlite).await;
    let mut command = coordinator().command();
    command
        .args(["serve", "--database-url", &database.url])
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &collector.endpoint)
        .env("OTEL_SERVICE_NAME", "payments-idempotency")
        .env_remove("IDEMPOTENCY_OTLP_ENDPOINT");
    let server = ServerProcess::spawn(command, &[]).await;
    let client = server.client_when_serving().await;
    key_state(&client, &unique_key("named")).await;
    stop(server).await;
    let spans = collector.spans();
    let lookups = named(&spans, "idempotency.v1.IdempotencyService/Lookup");
    assert_eq!(lookups.len(), 1, "{spans:#?}");
    assert_eq!(
        lookups[0].service_name.as_deref(),
        Some("payments-idempotency")
    );
}

#[tokio::test]
async fn a_malformed_traceparent_starts_a_trace_of_its_own() {
    let collector = Collector::start().await;
    let database = TestDatabase::create(Backend::Sqlite).await;
    let server =
        ServerProcess::start(&database.url, &["--otlp-endpoint", &collector.endpoint]).await;
    let mut client = server.client_when_serving().await;
    let malformed = format!("00-{}-zz-01", random_hex(16));
    client
        .lookup(traced(lookup(&unique_key("malformed")), &malformed, "x"))
        .await
        .expect("a malformed trace context changes no answer");
    stop(server).await;
    let spans = collector.spans();
    let lookups = named(&spans, "idempotency.v1.IdempotencyService/Lookup");
    assert_eq!(lookups.len(), 1, "{spans:#?}");
    assert!(
        lookups[0].span.parent_span_id.is_empty(),
        "{:?}",
        lookups[0]
    );
    assert!(lookups[0].span.trace_state.is_empty(), "{:?}", lookups[0]);
}

async fn start_refused(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_idempotency-coordinator"));
    command
        .args(args)
        .env_remove("IDEMPOTENCY_OTLP_ENDPOINT")
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT");
    for (name, value) in env {
        command.env(name, value);
    }
    command.output().await.expect("run the binary")
}

#[tokio::test]
async fn an_endpoint_that_is_not_an_otlp_url_is_refused_at_start() {
    for endpoint in [
        "not a url",
        "127.0.0.1:4317",
        "ftp://collector:4317",
        "http://",
        "http://collector:4317/v1/traces",
    ] {
        let output = start_refused(&["--otlp-endpoint", endpoint], &[]).await;
        assert_eq!(output.status.code(), Some(2), "{endpoint}: {output:?}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains("--otlp-endpoint"), "{endpoint}: {stderr}");
    }
    let output = start_refused(&[], &[("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4317")]).await;
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--otlp-endpoint") && stderr.contains("OTEL_EXPORTER_OTLP_ENDPOINT"),
        "{stderr}"
    );
}

#[tokio::test]
async fn a_collector_that_never_answers_does_not_hold_up_the_exit() {
    // Accepts connections and never answers: every export waits for its timeout.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let endpoint = format!("http://{}", silent.local_addr().expect("address"));
    let holding = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = silent.accept().await {
            held.push(stream);
        }
    });
    let database = TestDatabase::create(Backend::Sqlite).await;
    let server = ServerProcess::start(&database.url, &["--otlp-endpoint", &endpoint]).await;
    let mut client = server.client_when_serving().await;
    client
        .lookup(lookup(&unique_key("unheard")))
        .await
        .expect("Lookup answers whatever the collector does");
    let began = std::time::Instant::now();
    stop(server).await;
    holding.abort();
    // The flush is bounded (3 s), the rest of the shutdown is quick.
    assert!(
        began.elapsed() < Duration::from_secs(10),
        "took {:?}",
        began.elapsed()
    );
}
