//! The gateway's flags. Every setting is a flag with an environment variable
//! (`IDEMPOTENCY_GATEWAY_*`), checked once here, with an error that names the flag, so that the
//! proxy works with settings it can trust.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args as ClapArgs;
use hyper::Method;
use hyper::Uri;
use hyper::header::HeaderName;
use idempotency_settings::{Bounds, SettingError, parse_duration, read_file, read_token_file};

/// `idempotency-coordinator gateway`'s flags.
#[derive(Debug, Clone, ClapArgs)]
pub struct Args {
    /// Where the gateway serves HTTP/1.1.
    #[arg(
        long,
        env = "IDEMPOTENCY_GATEWAY_LISTEN",
        default_value = "127.0.0.1:8080"
    )]
    pub listen: SocketAddr,

    /// Once listening, write the bound address to this file (for port 0 and supervisors).
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_ADDRESS_FILE")]
    pub address_file: Option<PathBuf>,

    /// The API behind the gateway: http://host:port (plain HTTP/1.1; a path prefix is kept in
    /// front of every request's path).
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_UPSTREAM")]
    pub upstream: String,

    /// The coordinator's gRPC endpoint: http://host:port, or https://host:port with
    /// --coordinator-ca (required for https://).
    #[arg(
        long,
        env = "IDEMPOTENCY_GATEWAY_COORDINATOR",
        default_value = "http://127.0.0.1:50051"
    )]
    pub coordinator: String,

    /// The CA certificate (PEM) that signed the coordinator's TLS certificate, for an https://
    /// --coordinator.
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_COORDINATOR_CA")]
    pub coordinator_ca: Option<PathBuf>,

    /// The coordinator namespace the keys live in (1-64 characters of A-Z a-z 0-9 . _ - :).
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_NAMESPACE")]
    pub namespace: String,

    /// A file holding the bearer token for the coordinator (`idempotency-coordinator token
    /// new`); surrounding whitespace is ignored.
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,

    /// The methods whose requests get idempotency (comma-separated, 1-16); others pass through.
    #[arg(
        long,
        env = "IDEMPOTENCY_GATEWAY_METHODS",
        default_value = "POST,PATCH",
        value_delimiter = ','
    )]
    pub methods: Vec<String>,

    /// The request header that carries the key.
    #[arg(
        long,
        env = "IDEMPOTENCY_GATEWAY_HEADER",
        default_value = "Idempotency-Key"
    )]
    pub header: String,

    /// Path prefixes (comma-separated, at most 64, each starting with /) under which a guarded
    /// request without a key is refused with 400; elsewhere it passes through without
    /// idempotency.
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_REQUIRE_KEY", value_delimiter = ',')]
    pub require_key: Vec<String>,

    /// The longest key accepted (1-190 bytes; 190 leaves room for the identity scope within the
    /// coordinator's 255).
    #[arg(
        long,
        env = "IDEMPOTENCY_GATEWAY_MAX_KEY_LENGTH",
        default_value_t = 128
    )]
    pub max_key_length: usize,

    /// The request header that identifies the caller (e.g. X-Api-Key, Authorization): keys are
    /// scoped per identity (its SHA-256, never stored in clear); a guarded request without it
    /// is refused with 400. Without this flag all callers share one key space.
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_IDENTITY_HEADER")]
    pub identity_header: Option<String>,

    /// How long a request waits for another request with the same key to finish before it is
    /// answered 409 with Retry-After (0s-60s).
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_WAIT", default_value = "5s",
          value_parser = parse_duration)]
    pub wait: Duration,

    /// The lease a running request holds; renewed every third of it while the upstream works
    /// (100ms-24h).
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_LEASE", default_value = "30s",
          value_parser = parse_duration)]
    pub lease: Duration,

    /// How long a key and its stored response are kept (1s-30d).
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_RETENTION", default_value = "24h",
          value_parser = parse_duration)]
    pub retention: Duration,

    /// The largest request body of a guarded request, in bytes (1 KiB-64 MiB); larger → 413.
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_MAX_REQUEST_BYTES", default_value_t = 1024 * 1024)]
    pub max_request_bytes: usize,

    /// The largest stored response (status, headers and body as stored), in bytes (1 KiB-64
    /// MiB). Keep it at most the coordinator's --max-response-bytes. A larger response is
    /// answered once and recorded as not replayable (see docs/gateway.md).
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_MAX_STORED_RESPONSE_BYTES", default_value_t = 1024 * 1024)]
    pub max_stored_response_bytes: usize,

    /// How long the upstream may take to answer a request, body included (100ms-1h).
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_UPSTREAM_TIMEOUT", default_value = "60s",
          value_parser = parse_duration)]
    pub upstream_timeout: Duration,

    /// The deadline of each call to the coordinator (100ms-60s).
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_COORDINATOR_TIMEOUT", default_value = "5s",
          value_parser = parse_duration)]
    pub coordinator_timeout: Duration,

    /// How long calls to an unavailable coordinator are retried before the gateway gives up
    /// (0s-60s); then it fails closed (503) or open (--fail-open).
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_COORDINATOR_RETRY", default_value = "2s",
          value_parser = parse_duration)]
    pub coordinator_retry: Duration,

    /// When the coordinator is unavailable, forward guarded requests without idempotency
    /// (marked with an Idempotency-Warning header) instead of answering 503 with Retry-After.
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_FAIL_OPEN")]
    pub fail_open: bool,

    /// On SIGTERM or SIGINT, how long requests in flight may take to finish (0s-10m).
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_SHUTDOWN_GRACE", default_value = "30s",
          value_parser = parse_duration)]
    pub shutdown_grace: Duration,

    /// Log format: text or json.
    #[arg(long, env = "IDEMPOTENCY_GATEWAY_LOG_FORMAT", default_value = "text",
          value_parser = ["text", "json"])]
    pub log_format: String,
}

/// The checked settings.
#[derive(Debug, Clone)]
pub struct Settings {
    pub listen: SocketAddr,
    pub address_file: Option<PathBuf>,
    pub upstream: Upstream,
    pub coordinator: String,
    pub coordinator_ca: Option<Vec<u8>>,
    pub namespace: String,
    pub token: Option<String>,
    pub methods: Vec<Method>,
    pub header: HeaderName,
    pub require_key: Vec<String>,
    pub max_key_length: usize,
    pub identity_header: Option<HeaderName>,
    pub wait: Duration,
    pub lease: Duration,
    pub retention: Duration,
    pub max_request_bytes: usize,
    pub max_stored_response_bytes: usize,
    pub upstream_timeout: Duration,
    pub coordinator_timeout: Duration,
    pub coordinator_retry: Duration,
    pub fail_open: bool,
    pub shutdown_grace: Duration,
}

/// The upstream's scheme and authority, and the path prefix requests are put under.
#[derive(Debug, Clone)]
pub struct Upstream {
    pub authority: hyper::http::uri::Authority,
    pub path_prefix: String,
}

fn invalid(flag: &'static str, problem: impl Into<String>) -> SettingError {
    SettingError::new(flag, problem)
}

/// The bounds of the gateway's own durations (the lease, retention and wait the gateway asks
/// the coordinator for are held to the contract's bounds, `idempotency_settings::LEASE_TTL` etc.).
const UPSTREAM_TIMEOUT: Bounds = Bounds::new(Duration::from_millis(100), Duration::from_secs(3600));
const COORDINATOR_TIMEOUT: Bounds =
    Bounds::new(Duration::from_millis(100), Duration::from_secs(60));
const COORDINATOR_RETRY: Bounds = Bounds::new(Duration::ZERO, Duration::from_secs(60));
const SHUTDOWN_GRACE: Bounds = Bounds::new(Duration::ZERO, Duration::from_secs(600));

const KIB: usize = 1024;
const MIB: usize = 1024 * 1024;

/// The longest key the gateway accepts: the identity scope (64 hex digits and a colon) and the
/// key must fit in the coordinator's 255 bytes.
pub const MAX_KEY_LENGTH: usize = 190;

impl Args {
    /// Checks every setting, reads the token and CA files, and answers the settings the
    /// gateway runs with.
    pub fn settings(&self) -> Result<Settings, SettingError> {
        let methods = self.methods()?;
        let header = header_name("header", &self.header)?;
        let identity_header = match &self.identity_header {
            Some(name) => Some(header_name("identity-header", name)?),
            None => None,
        };
        if !(1..=MAX_KEY_LENGTH).contains(&self.max_key_length) {
            return Err(invalid(
                "max-key-length",
                format!("must be between 1 and {MAX_KEY_LENGTH}"),
            ));
        }
        let max_request_bytes = body_limit("max-request-bytes", self.max_request_bytes)?;
        let max_stored_response_bytes =
            body_limit("max-stored-response-bytes", self.max_stored_response_bytes)?;
        if self.coordinator.starts_with("https://") && self.coordinator_ca.is_none() {
            return Err(invalid(
                "coordinator-ca",
                "an https:// --coordinator needs the CA that signed its certificate",
            ));
        }
        Ok(Settings {
            listen: self.listen,
            address_file: self.address_file.clone(),
            upstream: upstream(&self.upstream)?,
            coordinator: coordinator(&self.coordinator)?,
            coordinator_ca: match &self.coordinator_ca {
                Some(path) => Some(read_file("coordinator-ca", path)?),
                None => None,
            },
            namespace: namespace(&self.namespace)?,
            token: match &self.token_file {
                Some(path) => Some(read_token_file("token-file", path)?),
                None => None,
            },
            methods,
            header,
            require_key: self.require_key()?,
            max_key_length: self.max_key_length,
            identity_header,
            wait: idempotency_settings::WAIT.check_setting("wait", self.wait)?,
            lease: idempotency_settings::LEASE_TTL.check_setting("lease", self.lease)?,
            retention: idempotency_settings::KEY_RETENTION
                .check_setting("retention", self.retention)?,
            max_request_bytes,
            max_stored_response_bytes,
            upstream_timeout: UPSTREAM_TIMEOUT
                .check_setting("upstream-timeout", self.upstream_timeout)?,
            coordinator_timeout: COORDINATOR_TIMEOUT
                .check_setting("coordinator-timeout", self.coordinator_timeout)?,
            coordinator_retry: COORDINATOR_RETRY
                .check_setting("coordinator-retry", self.coordinator_retry)?,
            fail_open: self.fail_open,
            shutdown_grace: SHUTDOWN_GRACE.check_setting("shutdown-grace", self.shutdown_grace)?,
        })
    }

    fn methods(&self) -> Result<Vec<Method>, SettingError> {
        if self.methods.is_empty() || self.methods.len() > 16 {
            return Err(invalid("methods", "must list 1 to 16 methods"));
        }
        self.methods
            .iter()
            .map(|name| {
                let name = name.trim();
                let valid = !name.is_empty() && name.bytes().all(|b| b.is_ascii_uppercase());
                match valid
                    .then(|| Method::from_bytes(name.as_bytes()).ok())
                    .flatten()
                {
                    Some(method) => Ok(method),
                    None => Err(invalid(
                        "methods",
                        format!("{name:?} is not a method in capitals (e.g. POST)"),
                    )),
                }
            })
            .collect()
    }

    fn require_key(&self) -> Result<Vec<String>, SettingError> {
        if self.require_key.len() > 64 {
            return Err(invalid("require-key", "must list at most 64 path prefixes"));
        }
        self.require_key
            .iter()
            .map(|prefix| {
                let prefix = prefix.trim();
                let valid = prefix.starts_with('/')
                    && prefix.len() <= 1024
                    && prefix.bytes().all(|b| b.is_ascii_graphic() && b != b'?');
                if valid {
                    Ok(prefix.to_owned())
                } else {
                    Err(invalid(
                        "require-key",
                        format!(
                            "{prefix:?} is not a path prefix (starts with /, at most 1024 \
                             visible characters, no query)"
                        ),
                    ))
                }
            })
            .collect()
    }
}

/// A limit on the bytes of a body, the request's or the stored response's: 1 KiB to 64 MiB.
fn body_limit(flag: &'static str, bytes: usize) -> Result<usize, SettingError> {
    if (KIB..=64 * MIB).contains(&bytes) {
        Ok(bytes)
    } else {
        Err(invalid(
            flag,
            "must be between 1024 (1 KiB) and 67108864 (64 MiB)",
        ))
    }
}

fn header_name(flag: &'static str, name: &str) -> Result<HeaderName, SettingError> {
    if name.is_empty() || name.len() > 64 {
        return Err(invalid(flag, "must be a header name of 1 to 64 characters"));
    }
    HeaderName::from_bytes(name.as_bytes())
        .map_err(|_| invalid(flag, format!("{name:?} is not a valid header name")))
}

fn upstream(text: &str) -> Result<Upstream, SettingError> {
    let uri: Uri = text
        .parse()
        .map_err(|_| invalid("upstream", format!("{text:?} is not a URL")))?;
    if uri.scheme_str() != Some("http") {
        return Err(invalid(
            "upstream",
            "must be an http:// URL (TLS to the upstream is not supported; put the gateway \
             beside it)",
        ));
    }
    let Some(authority) = uri.authority().cloned() else {
        return Err(invalid("upstream", "must name a host (http://host:port)"));
    };
    if uri.query().is_some() {
        return Err(invalid("upstream", "must not have a query"));
    }
    Ok(Upstream {
        authority,
        path_prefix: uri.path().trim_end_matches('/').to_owned(),
    })
}

fn coordinator(text: &str) -> Result<String, SettingError> {
    let uri: Uri = text
        .parse()
        .map_err(|_| invalid("coordinator", format!("{text:?} is not a URL")))?;
    match (uri.scheme_str(), uri.authority()) {
        (Some("http" | "https"), Some(_)) => Ok(text.to_owned()),
        _ => Err(invalid(
            "coordinator",
            "must be http://host:port or https://host:port",
        )),
    }
}

fn namespace(text: &str) -> Result<String, SettingError> {
    let valid = (1..=64).contains(&text.len())
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b".-_:".contains(&b));
    if valid {
        Ok(text.to_owned())
    } else {
        Err(invalid(
            "namespace",
            "must be 1-64 characters of A-Z a-z 0-9 . _ - :",
        ))
    }
}

#[cfg(test)]
mod tests;
