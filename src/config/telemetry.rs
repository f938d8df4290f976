//! Metrics and traces: where `/metrics` is served, whether the service's counters carry the
//! namespace, and where spans are exported.

use std::net::SocketAddr;

use clap::Args;
use idempotency_settings::SettingError;

use crate::telemetry::TraceSettings;

#[derive(Debug, Clone, Args)]
pub struct TelemetryArgs {
    /// Serve Prometheus metrics at GET /metrics on this address (e.g. 127.0.0.1:9464), a port
    /// of its own. Off unless set. Port 0 picks a free port (the log says which).
    #[arg(long, env = "IDEMPOTENCY_METRICS_LISTEN")]
    pub metrics_listen: Option<SocketAddr>,

    /// Label the service's own per-RPC counters (TryStart outcomes, refusals, events) with the
    /// namespace (the consumer for MarkProcessed). Off by default: each namespace is a series
    /// of its own, and how many there are is the operator's to bound.
    #[arg(
        long,
        env = "IDEMPOTENCY_METRICS_NAMESPACE_LABELS",
        requires = "metrics_listen"
    )]
    pub metrics_namespace_labels: bool,

    /// Export traces over OTLP/gRPC to this collector, e.g. http://127.0.0.1:4317 (https:// is
    /// verified against the system's roots). Off unless set; OTEL_EXPORTER_OTLP_ENDPOINT is
    /// used when this is not.
    #[arg(long, env = "IDEMPOTENCY_OTLP_ENDPOINT", value_parser = parse_otlp_endpoint)]
    pub otlp_endpoint: Option<String>,
}

impl TelemetryArgs {
    /// Where spans are exported: `--otlp-endpoint`, else `OTEL_EXPORTER_OTLP_ENDPOINT` (checked
    /// alike), else nowhere.
    pub fn traces(&self) -> Result<Option<TraceSettings>, SettingError> {
        let endpoint = match &self.otlp_endpoint {
            Some(endpoint) => Some(endpoint.clone()),
            None => match std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT") {
                Ok(text) if !text.trim().is_empty() => {
                    Some(parse_otlp_endpoint(text.trim()).map_err(|problem| {
                        SettingError::new(
                            "otlp-endpoint",
                            format!("OTEL_EXPORTER_OTLP_ENDPOINT {problem}"),
                        )
                    })?)
                }
                _ => None,
            },
        };
        Ok(endpoint.map(|endpoint| TraceSettings { endpoint }))
    }
}

/// An OTLP/gRPC endpoint: `http://` or `https://`, a host, a port if not the scheme's, no path.
fn parse_otlp_endpoint(text: &str) -> Result<String, String> {
    let uri: hyper::Uri = text
        .parse()
        .map_err(|error| format!("not a URL ({error}); e.g. http://127.0.0.1:4317"))?;
    match uri.scheme_str() {
        Some("http" | "https") => {}
        _ => return Err("must start with http:// or https://, e.g. http://127.0.0.1:4317".into()),
    }
    match uri.authority() {
        Some(authority) if !authority.host().is_empty() => {}
        _ => return Err("names no host, e.g. http://127.0.0.1:4317".into()),
    }
    if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
        return Err("takes no path: OTLP/gRPC has its own, e.g. http://127.0.0.1:4317".into());
    }
    Ok(text.trim_end_matches('/').to_owned())
}
