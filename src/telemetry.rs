//! Logging through `tracing`: text for people, JSON for collectors, level from `RUST_LOG`;
//! and, with `--otlp-endpoint`, traces: the same spans exported over OTLP/gRPC
//! (`tracing-opentelemetry` into the OpenTelemetry SDK's batch processor and its tonic
//! exporter). Span attributes are names from fixed sets and the namespace, never a key,
//! fingerprint, response or token.
//! Logs carry namespaces, outcomes and causes, never keys' payloads, responses or fingerprints.
//!
//! Logging can never take a task down. A log line goes to stdout through [`LossyStdout`]: when
//! the sink fails (a closed pipe, a full disk), the line is dropped and counted
//! ([`dropped_log_lines`]), and nothing is reported anywhere else. tracing-subscriber's own
//! fallback (`eprintln!` of the write error) is switched off, because it panics once stderr is
//! broken too, and a panic in `tracing::info!` ends whichever task was logging: the signal
//! handler, the health monitor.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Log lines the sink refused since the process started (for a metric to come).
static DROPPED_LOG_LINES: AtomicU64 = AtomicU64::new(0);

/// How many log lines were dropped because writing them failed.
pub fn dropped_log_lines() -> u64 {
    DROPPED_LOG_LINES.load(Ordering::Relaxed)
}

/// Standard output that never fails: a line it cannot write is dropped and counted. (A sink
/// that blocks, such as a pipe nobody reads, still blocks the writer: that is back-pressure,
/// which a log collector is expected to relieve, not a failure.)
#[derive(Debug, Clone, Copy, Default)]
pub struct LossyStdout;

impl<'a> MakeWriter<'a> for LossyStdout {
    type Writer = LossyLine;

    fn make_writer(&'a self) -> Self::Writer {
        LossyLine { failed: false }
    }
}

/// One log line on its way to stdout. tracing-subscriber formats a line whole and writes it
/// with one `write_all`, so one failure is one dropped line.
#[derive(Debug)]
pub struct LossyLine {
    failed: bool,
}

impl Write for LossyLine {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if !self.failed && std::io::stdout().lock().write_all(buf).is_err() {
            self.failed = true;
            DROPPED_LOG_LINES.fetch_add(1, Ordering::Relaxed);
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if std::io::stdout().lock().flush().is_err() && !self.failed {
            self.failed = true;
            DROPPED_LOG_LINES.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }
}

/// Installs the global subscriber: log lines, and with `traces` the spans exported over
/// OTLP/gRPC. `RUST_LOG` sets the level of the log lines (default `info`); it does not filter
/// the spans exported, which are the service's own (RPCs and store statements) whatever the
/// level. Must run inside the Tokio runtime when `traces` is given (the exporter's channel
/// lives there).
pub fn init(format: LogFormat, traces: Option<&TraceSettings>) -> Result<Telemetry, TraceError> {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let Some(traces) = traces else {
        // Without traces, the one layer is filtered globally: disabled call sites cost nothing.
        let builder = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(LossyStdout)
            .log_internal_errors(false);
        // A second init (tests start several servers in one process) keeps the first subscriber.
        let _ = match format {
            LogFormat::Text => builder
                .with_ansi(std::io::stdout().is_terminal())
                .try_init(),
            LogFormat::Json => builder.json().flatten_event(true).try_init(),
        };
        return Ok(Telemetry { provider: None });
    };

    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::{Layer, Registry};
    let provider = tracer_provider(traces)?;
    // Each layer has a filter of its own: the log lines follow RUST_LOG, the spans exported do
    // not.
    let lines = tracing_subscriber::fmt::layer()
        .with_writer(LossyStdout)
        .log_internal_errors(false);
    let lines: Box<dyn Layer<Registry> + Send + Sync> = match format {
        LogFormat::Text => Box::new(
            lines
                .with_ansi(std::io::stdout().is_terminal())
                .with_filter(Rechecked(filter)),
        ),
        LogFormat::Json => Box::new(
            lines
                .json()
                .flatten_event(true)
                .with_filter(Rechecked(filter)),
        ),
    };
    let spans = {
        use opentelemetry::trace::TracerProvider as _;
        tracing_opentelemetry::layer()
            .with_tracer(provider.tracer(SERVICE_NAME))
            .with_location(false)
            .with_threads(false)
            .with_tracked_inactivity(false)
            .with_context_activation(false)
            .with_filter(Rechecked(tracing_subscriber::filter::filter_fn(exported)))
    };
    if tracing_subscriber::registry()
        .with(lines)
        .with(spans)
        .try_init()
        .is_ok()
    {
        opentelemetry::global::set_text_map_propagator(
            opentelemetry_sdk::propagation::TraceContextPropagator::new(),
        );
        TRACES_ON.store(true, Ordering::Release);
    }
    Ok(Telemetry {
        provider: Some(provider),
    })
}

/// A per-layer filter whose decision is taken again at every span and event of the call sites
/// it enables, never cached as "always". tracing-subscriber hands a per-layer filter's decision
/// from `enabled` to the span's creation through a thread-local; a call site cached as "always"
/// skips `enabled`, so a stale decision left by an unrelated check (sqlx asks `enabled` about
/// its query log after every statement) would silently drop the span from the layer
/// (tokio-rs/tracing#2519). Call sites the filter rejects stay cached as "never".
struct Rechecked<F>(F);

impl<S, F: tracing_subscriber::layer::Filter<S>> tracing_subscriber::layer::Filter<S>
    for Rechecked<F>
{
    fn enabled(
        &self,
        metadata: &tracing::Metadata<'_>,
        cx: &tracing_subscriber::layer::Context<'_, S>,
    ) -> bool {
        self.0.enabled(metadata, cx)
    }

    fn callsite_enabled(
        &self,
        metadata: &'static tracing::Metadata<'static>,
    ) -> tracing::subscriber::Interest {
        if self.0.callsite_enabled(metadata).is_never() {
            tracing::subscriber::Interest::never()
        } else {
            tracing::subscriber::Interest::sometimes()
        }
    }

    fn event_enabled(
        &self,
        event: &tracing::Event<'_>,
        cx: &tracing_subscriber::layer::Context<'_, S>,
    ) -> bool {
        self.0.event_enabled(event, cx)
    }

    fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
        self.0.max_level_hint()
    }

    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        id: &tracing::span::Id,
        ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        self.0.on_new_span(attrs, id, ctx);
    }

    fn on_record(
        &self,
        id: &tracing::span::Id,
        values: &tracing::span::Record<'_>,
        ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        self.0.on_record(id, values, ctx);
    }

    fn on_enter(&self, id: &tracing::span::Id, ctx: tracing_subscriber::layer::Context<'_, S>) {
        self.0.on_enter(id, ctx);
    }

    fn on_exit(&self, id: &tracing::span::Id, ctx: tracing_subscriber::layer::Context<'_, S>) {
        self.0.on_exit(id, ctx);
    }

    fn on_close(&self, id: tracing::span::Id, ctx: tracing_subscriber::layer::Context<'_, S>) {
        self.0.on_close(id, ctx);
    }
}

/// The `service.name` of the spans, unless `OTEL_SERVICE_NAME` names another.
pub const SERVICE_NAME: &str = "idempotency-coordinator";

/// The longest the spans still buffered may take to be sent at shutdown.
pub const TRACE_FLUSH_LIMIT: Duration = Duration::from_secs(3);

/// How long one export may take before it is abandoned (its spans are lost, the service goes on).
const EXPORT_TIMEOUT: Duration = Duration::from_secs(3);

/// Where spans are exported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceSettings {
    /// The collector's OTLP/gRPC endpoint, `http://` or `https://` host and port.
    pub endpoint: String,
}

#[derive(Debug, thiserror::Error)]
#[error("the OTLP trace exporter could not be built")]
pub struct TraceError(#[from] opentelemetry_otlp::ExporterBuildError);

/// What the subscriber holds that must be let go of at exit: the spans not yet exported.
pub struct Telemetry {
    provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
}

impl Telemetry {
    /// Exports the spans still buffered, within [`TRACE_FLUSH_LIMIT`] (a collector that does not
    /// answer costs that much at most, never a hung exit).
    pub async fn shutdown(self) {
        let Some(provider) = self.provider else {
            return;
        };
        // The SDK's batch processor works on a thread of its own and its shutdown blocks until
        // that thread has exported; the export itself runs on this runtime's tasks.
        let flushed =
            tokio::task::spawn_blocking(move || provider.shutdown_with_timeout(TRACE_FLUSH_LIMIT));
        match tokio::time::timeout(TRACE_FLUSH_LIMIT + Duration::from_millis(500), flushed).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(error))) => tracing::warn!(%error, "exporting the last spans failed"),
            Ok(Err(_)) | Err(_) => tracing::warn!(
                limit = ?TRACE_FLUSH_LIMIT,
                "the last spans were not exported in time"
            ),
        }
    }
}

/// Whether spans are exported (`--otlp-endpoint`). Off, the spans that only traces need are not
/// created at all and no trace context is read from calls.
pub fn traces_on() -> bool {
    TRACES_ON.load(Ordering::Relaxed)
}

static TRACES_ON: AtomicBool = AtomicBool::new(false);

/// The spans exported: the service's own (never its events, nor the spans of the libraries
/// under it, the exporter's own gRPC client among them). Decided from metadata alone, so the
/// answer is cached per call site.
fn exported(metadata: &tracing::Metadata<'_>) -> bool {
    metadata.is_span()
        && *metadata.level() <= tracing::Level::DEBUG
        && metadata.target().starts_with("idempotency_coordinator")
}

fn tracer_provider(
    settings: &TraceSettings,
) -> Result<opentelemetry_sdk::trace::SdkTracerProvider, TraceError> {
    use opentelemetry_otlp::{WithExportConfig, WithTonicConfig};
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(settings.endpoint.clone())
        .with_timeout(EXPORT_TIMEOUT);
    // A collector behind TLS is verified against the system's roots.
    let exporter = if settings.endpoint.starts_with("https://") {
        exporter.with_tls_config(
            opentelemetry_otlp::tonic_types::transport::ClientTlsConfig::new().with_native_roots(),
        )
    } else {
        exporter
    };
    let exporter = exporter.build()?;
    let resource = opentelemetry_sdk::Resource::builder();
    // The resource's detectors read OTEL_SERVICE_NAME (and OTEL_RESOURCE_ATTRIBUTES); a name
    // given there wins over ours.
    let named = std::env::var_os("OTEL_SERVICE_NAME").is_some_and(|name| !name.is_empty());
    let resource = if named {
        resource
    } else {
        resource.with_service_name(SERVICE_NAME)
    };
    let resource = resource
        .with_attribute(opentelemetry::KeyValue::new(
            "service.version",
            env!("CARGO_PKG_VERSION"),
        ))
        .build();
    Ok(opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build())
}

/// An error with its chain of causes on one line, for logs.
pub fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
