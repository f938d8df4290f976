//! What one connection, and all of them together, may hold: the handshake, idle and send
//! timeouts, the connection cap, response bytes not yet taken, and health Watch streams.

use std::time::Duration;

use clap::Args;
use idempotency_settings::{Bounds, SettingError, parse_duration};

const MIB: u64 = 1024 * 1024;

/// The limits on connections, checked from the flags below, which the gRPC edge's connections
/// enforce (`grpc::connections`).
#[derive(Debug, Clone)]
pub struct ConnectionSettings {
    pub handshake_timeout: Duration,
    pub idle_timeout: Duration,
    /// `None`: no cap.
    pub max_connections: Option<u32>,
    pub response_send_timeout: Duration,
    pub max_pending_response_bytes: u64,
    pub max_connection_pending_response_bytes: u64,
    /// Health Watch streams open at once, server-wide.
    pub max_health_watchers: u32,
}

const HANDSHAKE_TIMEOUT: Bounds =
    Bounds::new(Duration::from_millis(100), Duration::from_secs(5 * 60));
const IDLE_TIMEOUT: Bounds = Bounds::new(Duration::from_secs(1), Duration::from_secs(24 * 3600));
const RESPONSE_SEND_TIMEOUT: Bounds =
    Bounds::new(Duration::from_secs(1), Duration::from_secs(3600));

#[derive(Debug, Clone, Args)]
pub struct ConnectionArgs {
    /// How long a new connection may take to send the HTTP/2 preface (100ms-5m); one that
    /// stays silent longer is closed. (TLS handshakes have their own 10 s bound.)
    #[arg(long, env = "IDEMPOTENCY_CONNECTION_HANDSHAKE_TIMEOUT", default_value = "10s",
          value_parser = parse_duration)]
    pub connection_handshake_timeout: Duration,

    /// A connection with no call open for this long is closed (1s-24h).
    #[arg(long, env = "IDEMPOTENCY_CONNECTION_IDLE_TIMEOUT", default_value = "5m",
          value_parser = parse_duration)]
    pub connection_idle_timeout: Duration,

    /// The most connections open at once (1-1000000); more wait in the kernel's backlog until
    /// one closes. No cap when absent.
    #[arg(long, env = "IDEMPOTENCY_MAX_CONNECTIONS",
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub max_connections: Option<u32>,

    /// A response its client has not taken (read) within this is given up, and its connection
    /// closed (1s-1h).
    #[arg(long, env = "IDEMPOTENCY_RESPONSE_SEND_TIMEOUT", default_value = "30s",
          value_parser = parse_duration)]
    pub response_send_timeout: Duration,

    /// Response bytes produced and not yet taken by their clients, server-wide (1 MiB-64 GiB).
    /// Beyond it, calls that wrote nothing are refused RESOURCE_EXHAUSTED / OVERLOADED.
    #[arg(long, env = "IDEMPOTENCY_MAX_PENDING_RESPONSE_BYTES", default_value_t = 256 * MIB,
          value_parser = clap::value_parser!(u64).range(MIB..=64 * 1024 * MIB))]
    pub max_pending_response_bytes: u64,

    /// The same, per connection (1 MiB-64 GiB, at most --max-pending-response-bytes).
    #[arg(long, env = "IDEMPOTENCY_MAX_CONNECTION_PENDING_RESPONSE_BYTES",
          default_value_t = 32 * MIB,
          value_parser = clap::value_parser!(u64).range(MIB..=64 * 1024 * MIB))]
    pub max_connection_pending_response_bytes: u64,

    /// Health Watch streams open at once, server-wide (1-100000); more are refused
    /// RESOURCE_EXHAUSTED. Health is open to callers without a token, so it is bounded.
    #[arg(long, env = "IDEMPOTENCY_MAX_HEALTH_WATCHERS", default_value_t = 1000,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub max_health_watchers: u32,
}

impl ConnectionArgs {
    pub fn settings(&self) -> Result<ConnectionSettings, SettingError> {
        if self.max_connection_pending_response_bytes > self.max_pending_response_bytes {
            return Err(SettingError::new(
                "max-connection-pending-response-bytes",
                format!(
                    "must not exceed --max-pending-response-bytes ({})",
                    self.max_pending_response_bytes
                ),
            ));
        }
        Ok(ConnectionSettings {
            handshake_timeout: HANDSHAKE_TIMEOUT.check_setting(
                "connection-handshake-timeout",
                self.connection_handshake_timeout,
            )?,
            idle_timeout: IDLE_TIMEOUT
                .check_setting("connection-idle-timeout", self.connection_idle_timeout)?,
            max_connections: self.max_connections,
            response_send_timeout: RESPONSE_SEND_TIMEOUT
                .check_setting("response-send-timeout", self.response_send_timeout)?,
            max_pending_response_bytes: self.max_pending_response_bytes,
            max_connection_pending_response_bytes: self.max_connection_pending_response_bytes,
            max_health_watchers: self.max_health_watchers,
        })
    }
}
