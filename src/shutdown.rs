//! Turns SIGTERM and SIGINT into the one cancellation token that drives shutdown.

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
