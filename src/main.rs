//! `idempotency-coordinator [serve]`, `migrate`, `token`, `healthcheck`, `admin`, `gateway`,
//! `completions` and `man`:
//! the command line parsed, logging set up, and each command handed to its place (`serve` to
//! `startup`, the others to `cli`, `gateway` to the gateway crate).

use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use idempotency_coordinator::config::{Cli, Command, TokenCommand};
use idempotency_coordinator::{Application, cli, shutdown, telemetry};
use tokio_util::sync::CancellationToken;

/// mimalloc (Microsoft's allocator, kept by its authors; the `mimalloc` crate builds it from
/// source with the C compiler) instead of the system's: a call allocates and frees a few dozen
/// small buffers (HTTP/2 frames, headers, the request and response), and glibc's malloc and free
/// were over a tenth of a lone TryStart's instructions (BENCHMARKS.md, "Lean per call"). Built
/// without transparent huge pages (`no_thp`): with them the resident memory doubled, 14 to
/// 28 MiB idle.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> ExitCode {
    let command = Cli::parse().into_command();
    if let Command::Admin(args) = command {
        // A client: no logging, the answer on standard output, a failure on standard error.
        return cli::admin::run(*args).await;
    }
    match &command {
        Command::Completions { shell } => return cli::docs::completions(*shell),
        Command::Man { out_dir } => return cli::docs::man(out_dir.as_deref()),
        _ => {}
    }
    let log_format = match &command {
        Command::Serve(args) => args.database.log_format,
        Command::Migrate(args) => args.database.log_format,
        Command::Gateway(args) if args.log_format == "json" => telemetry::LogFormat::Json,
        Command::Token(_)
        | Command::Healthcheck(_)
        | Command::Gateway(_)
        | Command::Admin(_)
        | Command::Completions { .. }
        | Command::Man { .. } => telemetry::LogFormat::Text,
    };
    if let Command::Healthcheck(args) = &command {
        // No logging: the answer is the exit status (and one line on failure).
        return cli::healthcheck::run(args).await;
    }
    let traces = match &command {
        Command::Serve(args) => match args.traces() {
            Ok(traces) => traces,
            Err(error) => {
                // As clap reports a bad flag: before anything starts, exit status 2.
                eprintln!("error: {error}");
                return ExitCode::from(2);
            }
        },
        _ => None,
    };
    let telemetry = match telemetry::init(log_format, traces.as_ref()) {
        Ok(telemetry) => telemetry,
        Err(error) => {
            eprintln!("error: --otlp-endpoint: {}", telemetry::error_chain(&error));
            return ExitCode::from(2);
        }
    };
    if let Some(traces) = &traces {
        tracing::info!(endpoint = %traces.endpoint, "exporting traces over OTLP/gRPC");
    }
    let code = match run(command).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!(error = format!("{error:#}"), "exiting");
            ExitCode::FAILURE
        }
    };
    telemetry.shutdown().await;
    code
}

async fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Serve(args) => {
            let settings = args.settings()?;
            // Signals are handled from before the address is announced: a supervisor that
            // stops the service as soon as it listens must get a graceful stop, not a kill.
            let shutdown = CancellationToken::new();
            let stop = shutdown::on_stop_signals().context("installing signal handlers")?;
            let reload = shutdown::on_sighup().context("installing the SIGHUP handler")?;
            let app = Application::build(settings).await?;
            let supervisor = app.supervisor();
            supervisor.spawn(
                "signal handling",
                &shutdown,
                stop.cancel_on_signal(shutdown.clone()),
            );
            supervisor.spawn(
                "tokens reload",
                &shutdown,
                reload.reload_tokens(app.authenticator()),
            );
            tracing::info!(address = %app.local_addr(), store = app.store().backend(), "listening");
            if app.authenticator().is_none() {
                tracing::info!(
                    "no --tokens-file: the admin API (idempotency.v1.AdminService) answers \
                     callers on the loopback interface only"
                );
            }
            if let Some(address) = app.metrics_addr() {
                tracing::info!(%address, "serving metrics at /metrics");
            }
            if let Some(path) = &args.address_file {
                write_address_file(path, app.local_addr())
                    .with_context(|| format!("writing the address file {}", path.display()))?;
            }
            app.run_until_stopped(shutdown).await?;
        }
        Command::Migrate(args) => cli::migrate::run(&args).await?,
        // Answered before logging was set up.
        Command::Healthcheck(_)
        | Command::Admin(_)
        | Command::Completions { .. }
        | Command::Man { .. } => {}
        Command::Gateway(args) => {
            let shutdown = CancellationToken::new();
            let stop = shutdown::on_stop_signals().context("installing signal handlers")?;
            tokio::spawn(stop.cancel_on_signal(shutdown.clone()));
            idempotency_gateway::run(*args, shutdown).await?;
        }
        Command::Token(TokenCommand::New {
            name,
            scopes,
            admin,
        }) => cli::token::new(&name, &scopes, admin).map_err(anyhow::Error::msg)?,
    }
    Ok(())
}

/// Writes `address` to `path` through a file beside it and a rename, so that whoever polls the
/// file reads either nothing or the whole address.
fn write_address_file(
    path: &std::path::Path,
    address: std::net::SocketAddr,
) -> std::io::Result<()> {
    let mut aside = path.as_os_str().to_owned();
    aside.push(".tmp");
    let aside = std::path::PathBuf::from(aside);
    std::fs::write(&aside, format!("{address}\n"))?;
    std::fs::rename(&aside, path)
}
