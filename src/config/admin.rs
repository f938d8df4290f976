//! `idempotency-coordinator admin …`: the operator's CLI over the admin API, its flags and
//! their checks. It talks to a running coordinator over gRPC, with the connection flags the
//! gateway takes for its coordinator (`--coordinator`, `--coordinator-ca`, a token file).

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Subcommand, ValueEnum};
use idempotency_settings::{Bounds, SettingError, parse_duration};

#[derive(Debug, Clone, Args)]
pub struct AdminArgs {
    #[command(flatten)]
    pub connection: AdminConnectionArgs,

    #[command(subcommand)]
    pub command: AdminCommand,
}

#[derive(Debug, Clone, Args)]
pub struct AdminConnectionArgs {
    /// The coordinator's gRPC endpoint: http://host:port, or https://host:port with
    /// --coordinator-ca.
    #[arg(
        long,
        env = "IDEMPOTENCY_ADMIN_COORDINATOR",
        default_value = "http://127.0.0.1:50051",
        global = true
    )]
    pub coordinator: String,

    /// The CA certificate (PEM) that signed the coordinator's TLS certificate (https:// only).
    #[arg(long, env = "IDEMPOTENCY_ADMIN_COORDINATOR_CA", global = true)]
    pub coordinator_ca: Option<PathBuf>,

    /// This operator's client certificate (PEM), for a coordinator that requires mutual TLS
    /// (`--tls-client-ca`); its subject names the operator in the audit trail when no token
    /// does. Needs --client-key and an https:// --coordinator.
    #[arg(
        long,
        env = "IDEMPOTENCY_ADMIN_CLIENT_CERT",
        global = true,
        requires = "client_key"
    )]
    pub client_cert: Option<PathBuf>,

    /// The private key (PEM) of --client-cert.
    #[arg(
        long,
        env = "IDEMPOTENCY_ADMIN_CLIENT_KEY",
        global = true,
        requires = "client_cert"
    )]
    pub client_key: Option<PathBuf>,

    /// A file holding a bearer token with an admin right (`token new --admin read|write`).
    /// Without it no token is sent: a coordinator without a tokens file answers the admin API
    /// on its loopback interface only.
    #[arg(long, env = "IDEMPOTENCY_ADMIN_TOKEN_FILE", global = true)]
    pub token_file: Option<PathBuf>,

    /// The deadline of each call (100ms-1h); an erasure's stream is not bound by it.
    #[arg(long, env = "IDEMPOTENCY_ADMIN_TIMEOUT", default_value = "30s",
          value_parser = parse_duration, global = true)]
    pub timeout: Duration,

    /// `table` for people, `json` (one JSON document) for scripts.
    #[arg(long, value_enum, default_value_t = OutputFormat::Table, global = true)]
    pub output: OutputFormat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    Table,
    Json,
}

#[derive(Debug, Clone, Subcommand)]
pub enum AdminCommand {
    /// Find, read, release and erase keys.
    #[command(subcommand)]
    Keys(KeysCommand),
    /// A namespace's counts by state, its oldest stuck key and the bytes it stores.
    Stats {
        #[arg(long)]
        namespace: String,
    },
    /// A namespace's audit trail, newest first.
    Audit {
        #[arg(long)]
        namespace: String,
        /// Events per page (1-1000).
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1000))]
        limit: u32,
        /// Start at this page (the `next page` of a previous answer).
        #[arg(long, default_value = "")]
        page_token: String,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StateArg {
    /// In progress, the lease running.
    InProgress,
    /// In progress, the lease run out: the holder most likely crashed.
    Stuck,
    Completed,
}

#[derive(Debug, Clone, Subcommand)]
pub enum KeysCommand {
    /// List a namespace's keys, a page at a time.
    List {
        #[arg(long)]
        namespace: String,
        #[arg(long, value_enum)]
        state: Option<StateArg>,
        /// Only keys that start with this.
        #[arg(long, default_value = "")]
        prefix: String,
        /// Only keys completed at or after this instant (RFC 3339).
        #[arg(long)]
        completed_after: Option<String>,
        /// Only keys completed before this instant (RFC 3339).
        #[arg(long)]
        completed_before: Option<String>,
        /// Only keys in progress whose claim was taken at or after this instant (RFC 3339).
        #[arg(long)]
        claimed_after: Option<String>,
        /// Only keys in progress claimed before this instant (RFC 3339): held since then.
        #[arg(long)]
        claimed_before: Option<String>,
        /// Keys per page (1-1000).
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1000))]
        limit: u32,
        /// Start at this page (the `next page` of a previous answer).
        #[arg(long, default_value = "")]
        page_token: String,
    },
    /// One key's whole record, its response and checkpoint included.
    Show {
        #[arg(long)]
        namespace: String,
        #[arg(long)]
        key: String,
    },
    /// Release an in-progress (stuck) key whatever its lease token; recorded with the reason.
    Release {
        #[arg(long)]
        namespace: String,
        #[arg(long)]
        key: String,
        /// Why, for the audit trail (required).
        #[arg(long)]
        reason: String,
    },
    /// Erase one key (--key) or every key and processed event of the namespace (--all),
    /// recorded with the reason; an erasure of the namespace shows its progress.
    #[command(group = clap::ArgGroup::new("what").required(true).multiple(false))]
    Erase {
        #[arg(long)]
        namespace: String,
        /// The key to erase (or --all).
        #[arg(long, group = "what")]
        key: Option<String>,
        /// Erase the whole namespace (or --key).
        #[arg(long, group = "what")]
        all: bool,
        /// Why, for the audit trail (required, unless --dry-run).
        #[arg(long, required_unless_present = "dry_run")]
        reason: Option<String>,
        /// Rows deleted per statement of a namespace's erasure (1-10000).
        #[arg(long, default_value_t = 1000,
              value_parser = clap::value_parser!(u32).range(1..=10_000))]
        batch_size: u32,
        /// With --all: erase without asking for the namespace to be typed again (for scripts;
        /// without a terminal, --all needs it).
        #[arg(long)]
        yes: bool,
        /// Print what would be erased (the key, or the namespace's keys and processed events),
        /// and erase nothing.
        #[arg(long)]
        dry_run: bool,
    },
}

/// The connection settings, checked.
#[derive(Debug, Clone)]
pub struct AdminConnection {
    pub coordinator: String,
    pub ca: Option<Vec<u8>>,
    /// The client certificate and its key (PEM), for mutual TLS.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
    pub token: Option<String>,
    pub timeout: Duration,
    pub output: OutputFormat,
}

const TIMEOUT: Bounds = Bounds::new(Duration::from_millis(100), Duration::from_secs(3600));

impl AdminConnectionArgs {
    pub fn settings(&self) -> Result<AdminConnection, SettingError> {
        let invalid = |flag: &'static str, problem: String| SettingError::new(flag, problem);
        let https = self.coordinator.starts_with("https://");
        let authority = self
            .coordinator
            .strip_prefix("http://")
            .or_else(|| self.coordinator.strip_prefix("https://"))
            .map(|rest| rest.trim_end_matches('/'))
            .filter(|authority| {
                !authority.is_empty()
                    && !authority.contains(['/', '?', '#', ' '])
                    && authority
                        .rsplit_once(':')
                        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok())
            });
        if authority.is_none() {
            return Err(invalid(
                "coordinator",
                format!(
                    "{:?} must be http://host:port or https://host:port",
                    self.coordinator
                ),
            ));
        }
        if https && self.coordinator_ca.is_none() {
            return Err(invalid(
                "coordinator-ca",
                "an https:// --coordinator needs the CA that signed its certificate".into(),
            ));
        }
        if !https && self.client_cert.is_some() {
            return Err(invalid(
                "client-cert",
                "a client certificate is shown over TLS only: --coordinator must be https://"
                    .into(),
            ));
        }
        let read = |flag: &'static str, path: &Option<PathBuf>| match path {
            Some(path) => std::fs::read(path)
                .map(Some)
                .map_err(|error| invalid(flag, format!("cannot read {}: {error}", path.display()))),
            None => Ok(None),
        };
        let ca = read("coordinator-ca", &self.coordinator_ca)?;
        // A file that is no PEM certificate would only fail later, as "not trusted".
        if let (Some(ca), Some(path)) = (&ca, &self.coordinator_ca)
            && !String::from_utf8_lossy(ca).contains("-----BEGIN CERTIFICATE-----")
        {
            return Err(invalid(
                "coordinator-ca",
                format!("{} holds no PEM certificate", path.display()),
            ));
        }
        let identity =
            read("client-cert", &self.client_cert)?.zip(read("client-key", &self.client_key)?);
        let token = match &self.token_file {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|error| {
                    invalid(
                        "token-file",
                        format!("cannot read {}: {error}", path.display()),
                    )
                })?;
                let token = text.trim().to_owned();
                if token.is_empty() || !token.bytes().all(|b| b.is_ascii_graphic()) {
                    return Err(invalid(
                        "token-file",
                        format!("{} must hold one token of printable ASCII", path.display()),
                    ));
                }
                Some(token)
            }
            None => None,
        };
        Ok(AdminConnection {
            coordinator: self.coordinator.clone(),
            ca,
            identity,
            token,
            timeout: TIMEOUT.check_setting("timeout", self.timeout)?,
            output: self.output,
        })
    }
}
