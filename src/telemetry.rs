//! Logging through `tracing`: text for people, JSON for collectors, level from `RUST_LOG`.
//! Logs carry namespaces, outcomes and causes, never keys' payloads, responses or fingerprints.
//!
//! Logging can never take a task down. A log line goes to stdout through [`LossyStdout`]: when
//! the sink fails (a closed pipe, a full disk), the line is dropped and counted
//! ([`dropped_log_lines`]), and nothing is reported anywhere else. tracing-subscriber's own
//! fallback (`eprintln!` of the write error) is switched off, because it panics once stderr is
//! broken too, and a panic in `tracing::info!` ends whichever task was logging: the signal
//! handler, the health monitor.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicU64, Ordering};

use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Log lines the sink refused since the process started (for a metric to come).
static DROPPED_LOG_LINES: AtomicU64 = AtomicU64::new(0);

/// How many log lines were dropped because writing them failed.
pub fn dropped_log_lines() -> u64 {
    DROPPED_LOG_LINES.load(Ordering::Relaxed)
}

/// Standard output that never fails: a line it cannot write is dropped and counted. (A sink
/// that blocks, such as a pipe nobody reads, still blocks the writer: that is back-pressure,
/// which a log collector is expected to relieve, not a failure.)
#[derive(Debug, Clone, Copy, Default)]
pub struct LossyStdout;

impl<'a> MakeWriter<'a> for LossyStdout {
    type Writer = LossyLine;

    fn make_writer(&'a self) -> Self::Writer {
        LossyLine { failed: false }
    }
}

/// One log line on its way to stdout. tracing-subscriber formats a line whole and writes it
/// with one `write_all`, so one failure is one dropped line.
#[derive(Debug)]
pub struct LossyLine {
    failed: bool,
}

impl Write for LossyLine {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if !self.failed && std::io::stdout().lock().write_all(buf).is_err() {
            self.failed = true;
            DROPPED_LOG_LINES.fetch_add(1, Ordering::Relaxed);
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if std::io::stdout().lock().flush().is_err() && !self.failed {
            self.failed = true;
            DROPPED_LOG_LINES.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }
}

/// Installs the global subscriber. `RUST_LOG` sets the level (default `info`).
pub fn init(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(LossyStdout)
        .log_internal_errors(false);
    // A second init (tests start several servers in one process) keeps the first subscriber.
    let _ = match format {
        LogFormat::Text => builder
            .with_ansi(std::io::stdout().is_terminal())
            .try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}

/// An error with its chain of causes on one line, for logs.
pub fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
