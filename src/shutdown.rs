//! Signals: SIGTERM and SIGINT become the one cancellation token that drives shutdown; SIGHUP
//! reloads the tokens file. Both are installed before the service listens, and their loops run
//! as essential tasks (see `supervise`): a service that can no longer be stopped or have its
//! tokens revoked must not go on reporting SERVING.

use std::sync::Arc;
use std::time::Duration;

use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio_util::sync::CancellationToken;

use crate::auth::Authenticator;

/// How long reading the tokens file may take before a reload gives up (the tokens in force
/// stay). A regular file of the bounded size reads in far less; this is for a file system that
/// stopped answering.
pub const TOKENS_RELOAD_TIMEOUT: Duration = Duration::from_secs(5);

/// SIGTERM and SIGINT, caught from the moment they are installed.
pub struct StopSignals {
    terminate: Signal,
    interrupt: Signal,
}

pub fn on_stop_signals() -> std::io::Result<StopSignals> {
    Ok(StopSignals {
        terminate: signal(SignalKind::terminate())?,
        interrupt: signal(SignalKind::interrupt())?,
    })
}

impl StopSignals {
    /// Cancels `shutdown` on the first SIGTERM or SIGINT. A second signal during the drain
    /// exits at once (status 130), for an operator who does not want to wait out the grace
    /// period. Runs for the life of the process.
    pub async fn cancel_on_signal(self, shutdown: CancellationToken) {
        let Self {
            mut terminate,
            mut interrupt,
        } = self;
        tokio::select! {
            _ = terminate.recv() => tracing::info!("SIGTERM received; draining"),
            _ = interrupt.recv() => tracing::info!("SIGINT received; draining"),
        }
        shutdown.cancel();
        tokio::select! {
            _ = terminate.recv() => {},
            _ = interrupt.recv() => {},
        }
        tracing::warn!("second signal received; exiting without waiting for the drain");
        std::process::exit(130);
    }
}

/// SIGHUP, caught from the start so that it never ends the process (its default action), as
/// `systemctl reload` or a log rotation hook would otherwise do.
pub struct Hangups(Signal);

pub fn on_sighup() -> std::io::Result<Hangups> {
    Ok(Hangups(signal(SignalKind::hangup())?))
}

impl Hangups {
    /// On every SIGHUP, reloads the tokens file (when the service has one), off the async
    /// workers and within [`TOKENS_RELOAD_TIMEOUT`]. A file that does not load is reported and
    /// the tokens in force are kept; calls in flight are never dropped. Runs for the life of
    /// the process.
    pub async fn reload_tokens(self, authenticator: Option<Arc<Authenticator>>) {
        let Self(mut hangups) = self;
        while hangups.recv().await.is_some() {
            let Some(authenticator) = &authenticator else {
                tracing::info!("SIGHUP received; no tokens file to reload");
                continue;
            };
            match authenticator
                .reload_off_workers(TOKENS_RELOAD_TIMEOUT)
                .await
            {
                Ok(count) => tracing::info!(tokens = count, "tokens file reloaded"),
                Err(error) => tracing::error!(
                    error = %crate::telemetry::error_chain(&error),
                    "tokens file not reloaded; the tokens in force stay"
                ),
            }
        }
    }
}
