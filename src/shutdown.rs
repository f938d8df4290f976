//! Signals: SIGTERM and SIGINT become the one cancellation token that drives shutdown; SIGHUP
//! reloads the tokens file.

use tokio_util::sync::CancellationToken;

/// Cancels `shutdown` on the first SIGTERM or SIGINT. A second signal during the drain exits at
/// once (status 130), for an operator who does not want to wait out the grace period.
pub fn cancel_on_signal(shutdown: CancellationToken) -> std::io::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    tokio::spawn(async move {
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
    });
    Ok(())
}

/// SIGHUP, caught from the start so that it never ends the process (its default action), as
/// `systemctl reload` or a log rotation hook would otherwise do.
pub struct Hangups(tokio::signal::unix::Signal);

pub fn on_sighup() -> std::io::Result<Hangups> {
    use tokio::signal::unix::{SignalKind, signal};
    Ok(Hangups(signal(SignalKind::hangup())?))
}

impl Hangups {
    /// On every SIGHUP, reloads the tokens file (when the service has one). A file that does
    /// not load is reported and the tokens in force are kept; calls in flight are never
    /// dropped.
    pub fn reload_tokens(self, authenticator: Option<std::sync::Arc<crate::auth::Authenticator>>) {
        let Self(mut hangups) = self;
        tokio::spawn(async move {
            while hangups.recv().await.is_some() {
                let Some(authenticator) = &authenticator else {
                    tracing::info!("SIGHUP received; no tokens file to reload");
                    continue;
                };
                match authenticator.reload() {
                    Ok(count) => tracing::info!(tokens = count, "tokens file reloaded"),
                    Err(error) => tracing::error!(
                        error = %crate::telemetry::error_chain(&error),
                        "tokens file not reloaded; the tokens in force stay"
                    ),
                }
            }
        });
    }
}
