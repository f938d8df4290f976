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

/// Reloads the tokens file on every SIGHUP. A file that does not parse is reported and the
/// tokens in force are kept; calls in flight are never dropped.
pub fn reload_tokens_on_sighup(
    authenticator: std::sync::Arc<crate::auth::Authenticator>,
) -> std::io::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut hangup = signal(SignalKind::hangup())?;
    tokio::spawn(async move {
        while hangup.recv().await.is_some() {
            match authenticator.reload() {
                Ok(count) => tracing::info!(tokens = count, "tokens file reloaded"),
                Err(error) => tracing::error!(
                    error = %crate::telemetry::error_chain(&error),
                    "tokens file not reloaded; the tokens in force stay"
                ),
            }
        }
    });
    Ok(())
}
