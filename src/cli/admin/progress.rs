//! An erasure's progress, shown on standard error while `keys erase --all` runs.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use crate::config::admin::OutputFormat;
use crate::proto::idempotency::v1 as pb;

/// An erasure's progress on standard error: one line rewritten in place on a terminal, else a
/// line at most every second (and the last), so that a log of it stays short.
pub(super) struct Progress {
    terminal: bool,
    quiet: bool,
    last_line: Option<Instant>,
    began: Instant,
}

impl Progress {
    pub(super) fn new(output: OutputFormat) -> Self {
        Self {
            terminal: std::io::stderr().is_terminal(),
            // JSON output is for scripts: progress only on a terminal.
            quiet: output == OutputFormat::Json && !std::io::stderr().is_terminal(),
            last_line: None,
            began: Instant::now(),
        }
    }

    pub(super) fn show(&mut self, namespace: &str, message: &pb::EraseNamespaceResponse) {
        if self.quiet {
            return;
        }
        let now = Instant::now();
        let due = self
            .last_line
            .is_none_or(|at| now.duration_since(at) >= Duration::from_secs(1));
        if !self.terminal && !due && !message.done {
            return;
        }
        self.last_line = Some(now);
        let seconds = now.duration_since(self.began).as_secs_f64();
        let rate = if seconds > 0.0 {
            message.keys_erased as f64 / seconds
        } else {
            0.0
        };
        let line = format!(
            "erasing {namespace}: {} keys, {} events erased ({rate:.0} keys/s){}",
            message.keys_erased,
            message.events_erased,
            if message.done { ", done" } else { "" }
        );
        let mut stderr = std::io::stderr().lock();
        let _ = if self.terminal {
            write!(stderr, "\r\x1b[2K{line}")
        } else {
            writeln!(stderr, "{line}")
        };
        let _ = stderr.flush();
    }

    pub(super) fn finish(&self) {
        if self.terminal && !self.quiet {
            eprintln!();
        }
    }
}
