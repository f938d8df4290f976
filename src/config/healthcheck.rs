//! `healthcheck`'s flags: the coordinator in the forms `admin` takes (`--coordinator` and its
//! TLS flags, checked by `coordinator`), the older `--addr host:port` (plaintext) kept for the
//! container definitions that use it, and the time the whole check may take.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use idempotency_settings::{Bounds, SettingError, parse_duration};

use super::coordinator::{CoordinatorTarget, TargetFlags};

#[derive(Debug, Clone, Args)]
pub struct HealthcheckArgs {
    /// The coordinator's gRPC endpoint: http://host:port, or https://host:port with
    /// --coordinator-ca [default: http://127.0.0.1:50051].
    #[arg(
        long,
        env = "IDEMPOTENCY_HEALTHCHECK_COORDINATOR",
        conflicts_with = "addr"
    )]
    pub coordinator: Option<String>,

    /// The service's address as host:port, spoken to in plaintext: the older form of
    /// --coordinator http://host:port.
    #[arg(long, env = "IDEMPOTENCY_HEALTHCHECK_ADDR")]
    pub addr: Option<SocketAddr>,

    /// The CA certificate (PEM) that signed the coordinator's TLS certificate (https:// only).
    #[arg(long, env = "IDEMPOTENCY_HEALTHCHECK_COORDINATOR_CA")]
    pub coordinator_ca: Option<PathBuf>,

    /// A client certificate (PEM), for a coordinator that requires mutual TLS
    /// (`--tls-client-ca`). Needs --client-key and an https:// --coordinator.
    #[arg(
        long,
        env = "IDEMPOTENCY_HEALTHCHECK_CLIENT_CERT",
        requires = "client_key"
    )]
    pub client_cert: Option<PathBuf>,

    /// The private key (PEM) of --client-cert.
    #[arg(
        long,
        env = "IDEMPOTENCY_HEALTHCHECK_CLIENT_KEY",
        requires = "client_cert"
    )]
    pub client_key: Option<PathBuf>,

    /// How long connecting and the check may take together (100ms-60s).
    #[arg(long, env = "IDEMPOTENCY_HEALTHCHECK_TIMEOUT", default_value = "5s",
          value_parser = parse_healthcheck_timeout)]
    pub timeout: Duration,
}

impl HealthcheckArgs {
    /// The coordinator to check: --coordinator, else http:// and --addr, else the default.
    pub fn target(&self) -> Result<CoordinatorTarget, SettingError> {
        let coordinator = match (&self.coordinator, self.addr) {
            (Some(coordinator), _) => coordinator.clone(),
            (None, Some(addr)) => format!("http://{addr}"),
            (None, None) => "http://127.0.0.1:50051".to_owned(),
        };
        TargetFlags {
            coordinator: &coordinator,
            coordinator_ca: self.coordinator_ca.as_deref(),
            client_cert: self.client_cert.as_deref(),
            client_key: self.client_key.as_deref(),
        }
        .check()
    }
}

/// How long `healthcheck` may take: connecting and the check together.
const HEALTHCHECK_TIMEOUT: Bounds =
    Bounds::new(Duration::from_millis(100), Duration::from_secs(60));

fn parse_healthcheck_timeout(text: &str) -> Result<Duration, String> {
    HEALTHCHECK_TIMEOUT.check(parse_duration(text)?)
}
