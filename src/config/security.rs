//! Who may call: bearer tokens, the rate limit, TLS and mutual TLS, and the rule that a
//! non-loopback listener needs one of them unless `--allow-unauthenticated` says otherwise.

use std::net::SocketAddr;

use clap::Args;
use idempotency_settings::SettingError;

#[derive(Debug, Clone, Args)]
pub struct SecurityArgs {
    /// Callers of the API must present a bearer token listed in this file (one
    /// `name sha256:<hex> scope,scope*` per line; `token new` makes one). Reloaded on SIGHUP.
    #[arg(long, env = "IDEMPOTENCY_TOKENS_FILE")]
    pub tokens_file: Option<std::path::PathBuf>,

    /// Requests per second one token may make (bursts of as many); off when absent.
    #[arg(long, env = "IDEMPOTENCY_RATE_LIMIT",
          value_parser = clap::value_parser!(u32).range(1..))]
    pub rate_limit: Option<u32>,

    /// Serve TLS with this certificate chain (PEM); needs --tls-key.
    #[arg(long, env = "IDEMPOTENCY_TLS_CERT")]
    pub tls_cert: Option<std::path::PathBuf>,

    /// The private key of --tls-cert (PEM).
    #[arg(long, env = "IDEMPOTENCY_TLS_KEY")]
    pub tls_key: Option<std::path::PathBuf>,

    /// Require client certificates signed by this CA (PEM): mutual TLS. Needs --tls-cert.
    #[arg(long, env = "IDEMPOTENCY_TLS_CLIENT_CA")]
    pub tls_client_ca: Option<std::path::PathBuf>,

    /// Serve a non-loopback address with neither tokens nor mTLS, on purpose (e.g. behind a
    /// mesh that authenticates callers). Without it such a start is refused.
    #[arg(long, env = "IDEMPOTENCY_ALLOW_UNAUTHENTICATED")]
    pub allow_unauthenticated: bool,

    /// Concurrent calls one connection may have open.
    #[arg(long, env = "IDEMPOTENCY_MAX_CONCURRENT_STREAMS", default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub max_concurrent_streams: u32,
}

/// Files for TLS, checked to come in the combinations that make sense.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub certificate: std::path::PathBuf,
    pub private_key: std::path::PathBuf,
    pub client_ca: Option<std::path::PathBuf>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecuritySettings {
    pub tokens_file: Option<std::path::PathBuf>,
    pub rate_limit: Option<u32>,
    pub tls: Option<TlsFiles>,
    pub max_concurrent_streams: u32,
}

impl SecurityArgs {
    /// The security settings of a service listening on `listen`.
    pub fn settings(&self, listen: SocketAddr) -> Result<SecuritySettings, SettingError> {
        let tls = match (&self.tls_cert, &self.tls_key) {
            (Some(certificate), Some(private_key)) => Some(TlsFiles {
                certificate: certificate.clone(),
                private_key: private_key.clone(),
                client_ca: self.tls_client_ca.clone(),
            }),
            (None, None) if self.tls_client_ca.is_some() => {
                return Err(SettingError::new(
                    "tls-client-ca",
                    "needs --tls-cert and --tls-key: client certificates are checked in a TLS \
                     handshake",
                ));
            }
            (None, None) => None,
            (Some(_), None) | (None, Some(_)) => {
                return Err(SettingError::new(
                    "tls-cert",
                    "--tls-cert and --tls-key go together",
                ));
            }
        };
        if self.rate_limit.is_some() && self.tokens_file.is_none() {
            return Err(SettingError::new(
                "rate-limit",
                "needs --tokens-file: the limit is per token",
            ));
        }
        let authenticated = self.tokens_file.is_some() || self.tls_client_ca.is_some();
        if !listen.ip().is_loopback() && !authenticated && !self.allow_unauthenticated {
            return Err(SettingError::new(
                "allow-unauthenticated",
                format!(
                    "listening on {listen} (not loopback) with neither --tokens-file nor \
                     --tls-client-ca would let anyone who can connect read and release other \
                     services' keys; configure one, or pass --allow-unauthenticated if something \
                     in front (a mesh) authenticates callers"
                ),
            ));
        }
        Ok(SecuritySettings {
            tokens_file: self.tokens_file.clone(),
            rate_limit: self.rate_limit,
            tls,
            max_concurrent_streams: self.max_concurrent_streams,
        })
    }
}
