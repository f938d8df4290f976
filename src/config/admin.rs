//! `idempotency-coordinator admin …`: the operator's CLI over the admin API, its flags and
//! their checks. It talks to a running coordinator over gRPC, with the connection flags the
//! gateway takes for its coordinator (`--coordinator`, `--coordinator-ca`, a token file).

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Subcommand, ValueEnum};
use idempotency_settings::{Bounds, SettingError, parse_duration, read_token_file};

use super::coordinator::{CoordinatorTarget, TargetFlags};

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
    #[command(after_help = "Example:\n  idempotency-coordinator admin stats --namespace payments")]
    Stats {
        /// The namespace to count.
        #[arg(long)]
        namespace: String,
    },
    /// A namespace's audit trail, newest first: who released or erased what, when, why, and
    /// the record before.
    #[command(
        after_help = "Examples:\n  idempotency-coordinator admin audit --namespace payments\n  \
idempotency-coordinator admin audit --namespace payments --key order-1042 --actor token:oncall"
    )]
    Audit {
        /// The namespace whose trail to read.
        #[arg(long)]
        namespace: String,
        /// Only the events of this key (its releases and erasure).
        #[arg(long, value_parser = clap::builder::NonEmptyStringValueParser::new())]
        key: Option<String>,
        /// Only the events of this operator, as the trail's ACTOR column names them (e.g.
        /// token:oncall).
        #[arg(long, value_parser = clap::builder::NonEmptyStringValueParser::new())]
        actor: Option<String>,
        /// Events per page (1-1000).
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1000))]
        limit: u32,
        /// Start at this page (the `next page` of a previous answer).
        #[arg(long, default_value = "")]
        page_token: String,
    },
    /// Where namespaces live when the service runs on several PostgreSQL clusters.
    #[command(subcommand)]
    Placement(PlacementCommand),
}

/// `admin placement …`.
#[derive(Debug, Clone, Subcommand)]
pub enum PlacementCommand {
    /// Moves a namespace to another cluster while it is served (or resumes its unfinished
    /// move); with --rollback, rolls back its unfinished move.
    #[command(
        after_help = "Examples:\n  idempotency-coordinator admin placement move --namespace \
payments --to b --reason \"b has room\"\n  idempotency-coordinator admin placement move \
--namespace payments --rollback --reason \"b is failing over\""
    )]
    Move {
        /// The namespace to move.
        #[arg(long)]
        namespace: String,
        /// The cluster to move it to, by its name in --cluster.
        #[arg(
            long,
            required_unless_present = "rollback",
            conflicts_with = "rollback"
        )]
        to: Option<String>,
        /// Roll back the namespace's unfinished move instead.
        #[arg(long)]
        rollback: bool,
        /// Why, for the audit trail.
        #[arg(long)]
        reason: String,
    },
    /// Shows where a namespace is served: the cluster its rules name, the one that serves it
    /// now, its unfinished move if one stands, and every cluster's gate of it.
    #[command(
        after_help = "Example:\n  idempotency-coordinator admin placement show --namespace payments"
    )]
    Show {
        /// The namespace to look up.
        #[arg(long)]
        namespace: String,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StateArg {
    /// In progress, the lease running.
    InProgress,
    /// In progress, the lease run out: the holder most likely crashed.
    Stuck,
    /// Completed: its response is replayed.
    Completed,
    /// Released by an operator (`keys release`), claimed by nobody since: the next claim
    /// takes it over.
    Released,
}

#[derive(Debug, Clone, Subcommand)]
pub enum KeysCommand {
    /// List a namespace's keys, a page at a time.
    #[command(
        after_help = "Examples:\n  idempotency-coordinator admin keys list --namespace payments \
--state stuck\n  idempotency-coordinator admin keys list --namespace payments \
--claimed-before 2026-12-04T03:00:00Z --wide"
    )]
    List {
        /// The namespace to list.
        #[arg(long)]
        namespace: String,
        /// Only keys in this state (all when absent).
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
        /// Every column in the table (token, each time to the millisecond, expiry, response
        /// bytes, who released it), not only those that fit 100 columns.
        #[arg(long)]
        wide: bool,
    },
    /// One key's whole record, its response and checkpoint included.
    #[command(
        after_help = "Example:\n  idempotency-coordinator admin keys show --namespace payments \
--key order-1042"
    )]
    Show {
        /// The key's namespace.
        #[arg(long)]
        namespace: String,
        /// The key to show.
        #[arg(long)]
        key: String,
    },
    /// Release an in-progress (stuck) key whatever its lease token; recorded with the reason.
    #[command(
        after_help = "Example:\n  idempotency-coordinator admin keys release --namespace payments \
--key order-1042 --reason \"worker pod crashed, INC-4711\""
    )]
    Release {
        /// The key's namespace.
        #[arg(long)]
        namespace: String,
        /// The key to release.
        #[arg(long)]
        key: String,
        /// Why, for the audit trail (required).
        #[arg(long)]
        reason: String,
    },
    /// Erase one key (--key) or every key and processed event of the namespace (--all),
    /// recorded with the reason; an erasure of the namespace shows its progress.
    #[command(
        group = clap::ArgGroup::new("what").required(true).multiple(false),
        after_help = "Examples:\n  idempotency-coordinator admin keys erase --namespace payments \
--key order-1042 --reason DPA-17\n  idempotency-coordinator admin keys erase \
--namespace payments-tenant-42 --all --dry-run"
    )]
    Erase {
        /// The namespace to erase from (or, with --all, to erase).
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
    pub target: CoordinatorTarget,
    pub token: Option<String>,
    pub timeout: Duration,
    pub output: OutputFormat,
}

const TIMEOUT: Bounds = Bounds::new(Duration::from_millis(100), Duration::from_secs(3600));

impl AdminConnectionArgs {
    pub fn settings(&self) -> Result<AdminConnection, SettingError> {
        let target = TargetFlags {
            coordinator: &self.coordinator,
            coordinator_ca: self.coordinator_ca.as_deref(),
            client_cert: self.client_cert.as_deref(),
            client_key: self.client_key.as_deref(),
        }
        .check()?;
        let token = match &self.token_file {
            Some(path) => Some(read_token_file("token-file", path)?),
            None => None,
        };
        Ok(AdminConnection {
            target,
            token,
            timeout: TIMEOUT.check_setting("timeout", self.timeout)?,
            output: self.output,
        })
    }
}
