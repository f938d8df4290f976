//! Command line and environment. Every setting is a flag with an environment variable; values
//! are checked here, once, so the rest of the service works with settings it can trust.
//!
//! The flags are grouped by the part of the service they set: the store (`store`), serving and
//! the service's own behaviour (`serve`), who may call (`security`), what a connection may hold
//! (`connections`) and metrics and traces (`telemetry`). What a setting is (its bounds, the
//! duration parser, the error that names the flag) is shared with the gateway through the
//! `idempotency-settings` crate.

pub mod admin;
mod clusters;
mod connections;
pub mod coordinator;
mod healthcheck;
mod security;
mod serve;
mod store;
mod telemetry;
#[cfg(test)]
mod tests;

use clap::{Parser, Subcommand};

pub use connections::{ConnectionArgs, ConnectionSettings};
pub use healthcheck::HealthcheckArgs;
pub use idempotency_settings::SettingError;
pub use security::{SecurityArgs, SecuritySettings, TlsFiles};
pub use serve::{ServeArgs, Settings};
pub use store::{DatabaseArgs, MigrateArgs};
pub use telemetry::TelemetryArgs;

#[derive(Debug, Parser)]
#[command(
    name = "idempotency-coordinator",
    version,
    about = "Claims idempotency keys, stores and replays results, and deduplicates events over gRPC.",
    args_conflicts_with_subcommands = true,
    args_override_self = true,
    subcommand_negates_reqs = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    /// `serve`'s settings, for running without a subcommand.
    #[command(flatten)]
    pub serve: ServeArgs,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the gRPC API (the default).
    #[command(
        after_help = "Example:\n  idempotency-coordinator serve --database-url \
postgres://idempotency_service@db:5432/idempotency --listen 0.0.0.0:50051"
    )]
    Serve(Box<ServeArgs>),
    /// Apply the schema migrations and exit.
    #[command(
        after_help = "Example:\n  idempotency-coordinator migrate --database-url \
postgres://idempotency_migrator@db:5432/idempotency --grant-to idempotency_service"
    )]
    Migrate(MigrateArgs),
    /// Manage callers' bearer tokens.
    #[command(subcommand)]
    Token(TokenCommand),
    /// The operator's tools over a running coordinator's admin API: find stuck keys, read a
    /// key's record, release or erase keys, namespace statistics, the audit trail.
    Admin(Box<admin::AdminArgs>),
    /// Exit 0 when the service at --coordinator (or --addr) answers SERVING to a gRPC health
    /// check of idempotency.v1.IdempotencyService, 1 otherwise (for a container HEALTHCHECK).
    #[command(after_help = "Examples:\n  idempotency-coordinator healthcheck\n  \
idempotency-coordinator healthcheck --coordinator https://coordinator:50051 \
--coordinator-ca ca.pem --timeout 2s")]
    Healthcheck(HealthcheckArgs),
    /// Print a shell completion script for this binary, made from the same flag definitions as
    /// its --help (e.g. `source <(idempotency-coordinator completions bash)`).
    #[command(after_help = "Example:\n  source <(idempotency-coordinator completions bash)")]
    Completions {
        /// The shell: bash, zsh, fish, elvish or powershell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print this binary's man page, or with --out-dir write one page for it and one for each
    /// of its commands (idempotency-coordinator-admin-keys-list.1, …), made from the same flag
    /// definitions as its --help.
    #[command(
        after_help = "Example:\n  idempotency-coordinator man --out-dir ~/.local/share/man/man1"
    )]
    Man {
        /// The folder to write every page into (made if missing), e.g. ~/.local/share/man/man1.
        #[arg(long)]
        out_dir: Option<std::path::PathBuf>,
    },
    /// Run the HTTP gateway: a reverse proxy that gives the HTTP API at --upstream
    /// Idempotency-Key semantics, deciding everything through the coordinator at
    /// --coordinator (see docs/gateway.md).
    #[command(
        args_override_self = true,
        after_help = "Example:\n  idempotency-coordinator gateway --listen 127.0.0.1:8080 \
--upstream http://127.0.0.1:3000 --coordinator http://127.0.0.1:50051 --namespace orders"
    )]
    Gateway(Box<idempotency_gateway::Args>),
}

#[derive(Debug, Subcommand)]
pub enum TokenCommand {
    /// Make a new token: prints the token (give it to the caller; it is shown only here) and
    /// the line to add to the tokens file (which holds only the token's hash).
    #[command(
        after_help = "Example:\n  idempotency-coordinator token new --name oncall \
--scopes 'payments,payments-*' --admin write"
    )]
    New {
        /// A name for the caller, shown in logs: [A-Za-z0-9._-]+.
        #[arg(long)]
        name: String,
        /// The namespaces and consumers it may use: exact names or prefixes ending in *,
        /// separated by commas (e.g. payments-*,billing), or * for all.
        #[arg(long)]
        scopes: String,
        /// Also grant the admin API within those scopes: `read` (list keys, read records,
        /// statistics, the audit trail) or `write` (read, and release or erase keys). None
        /// when absent.
        #[arg(long, value_enum)]
        admin: Option<AdminArg>,
    },
}

/// The admin right `token new --admin` grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum AdminArg {
    Read,
    Write,
}

impl Cli {
    /// The subcommand to run, `serve` when none was given.
    pub fn into_command(self) -> Command {
        self.command
            .unwrap_or_else(|| Command::Serve(Box::new(self.serve)))
    }
}
