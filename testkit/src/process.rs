//! The coordinator binary as a child process, for what only a process can show (signals, exit
//! codes, memory, tools such as grpcurl talking to it) and for the bench.
//!
//! The process is started on port 0 with `--address-file`, and its port is read from that
//! file: log lines are not an interface.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::{Child, Command};

/// How long a process may take to write its address file.
const START_LIMIT: Duration = Duration::from_secs(20);

/// Where the coordinator binary is.
#[derive(Debug, Clone)]
pub struct Binary(PathBuf);

impl Binary {
    pub fn at(path: impl Into<PathBuf>) -> Self {
        Self(path.into())
    }

    /// `idempotency-coordinator` beside the running executable (the bench's case: both are
    /// built into the same target folder).
    pub fn beside_current_exe() -> anyhow::Result<Self> {
        let exe = std::env::current_exe().context("locating the running executable")?;
        Ok(Self(exe.with_file_name("idempotency-coordinator")))
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    /// A command for the binary, to add arguments to.
    pub fn command(&self) -> Command {
        Command::new(&self.0)
    }

    /// Starts `serve` on `database_url` with `flags`, logging at `info`.
    pub async fn serve(&self, database_url: &str, flags: &[&str]) -> anyhow::Result<ServerProcess> {
        self.serve_logging(database_url, flags, "info").await
    }

    /// Like [`Binary::serve`], logging at `level` (`RUST_LOG`).
    pub async fn serve_logging(
        &self,
        database_url: &str,
        flags: &[&str],
        level: &str,
    ) -> anyhow::Result<ServerProcess> {
        ServerProcess::spawn(self.serve_command(database_url, level), flags).await
    }

    /// `serve` on `database_url`, logging at `level`: the command the `serve…` starters add to.
    fn serve_command(&self, database_url: &str, level: &str) -> Command {
        let mut command = self.command();
        command
            .args(["serve", "--database-url", database_url])
            .env("RUST_LOG", level);
        command
    }

    /// Like [`Binary::serve`], with the process's wall clock skewed by `skew`, in libfaketime's
    /// offset syntax (`"-2h"`, `"+90m"`): the binary runs with libfaketime preloaded
    /// (`LD_PRELOAD`). Monotonic clocks are left alone (`FAKETIME_DONT_FAKE_MONOTONIC=1`), so
    /// that tokio's timers keep real time; only what reads the wall clock is skewed. The
    /// library is Debian's `libfaketime` (found by [`libfaketime`]).
    ///
    /// The library is preloaded into the binary itself rather than run through the `faketime`
    /// wrapper, which forks: signals and `kill_on_drop` must reach the coordinator, not a
    /// parent that would leave it running.
    pub async fn serve_with_clock_skew(
        &self,
        database_url: &str,
        flags: &[&str],
        skew: &str,
    ) -> anyhow::Result<ServerProcess> {
        let library = libfaketime()?;
        let mut command = self.serve_command(database_url, "info");
        command
            .env("LD_PRELOAD", library)
            .env("FAKETIME", skew)
            .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
            .env("FAKETIME_NO_CACHE", "1");
        ServerProcess::spawn(command, flags).await
    }

    /// Starts `gateway` with `flags` (the upstream, coordinator and namespace at least) on a
    /// free port, logging at `info`. Answers once it has written its address file.
    pub async fn gateway(&self, flags: &[&str]) -> anyhow::Result<ServerProcess> {
        let mut command = self.command();
        command.arg("gateway").env("RUST_LOG", "info");
        ServerProcess::spawn_with(command, &["--log-format", "text"], flags).await
    }

    /// Starts the binary with no store settings at all, in `directory`, as a newcomer would.
    pub async fn serve_embedded_in(
        &self,
        directory: &Path,
        flags: &[&str],
    ) -> anyhow::Result<ServerProcess> {
        let mut command = self.command();
        command
            .current_dir(directory)
            .env_remove("DATABASE_URL")
            .env_remove("IDEMPOTENCY_SQLITE_PATH")
            .env("RUST_LOG", "info");
        ServerProcess::spawn(command, flags).await
    }
}

/// Where libfaketime's preload library is: `$LIBFAKETIME` if set, else the first
/// `libfaketimeMT.so.1` (the thread-safe build: the coordinator is multi-threaded), or failing
/// that `libfaketime.so.1`, in the folders distributions install it to (Debian's multiarch
/// `/usr/lib/<triplet>/faketime/`, and the plain `lib`, `lib64` and `/usr/local` ones).
pub fn libfaketime() -> anyhow::Result<PathBuf> {
    if let Some(path) = std::env::var_os("LIBFAKETIME") {
        let path = PathBuf::from(path);
        anyhow::ensure!(
            path.is_file(),
            "LIBFAKETIME={} is not a file",
            path.display()
        );
        return Ok(path);
    }
    let mut folders: Vec<PathBuf> = ["/usr/lib", "/usr/lib64", "/usr/local/lib", "/lib"]
        .iter()
        .map(|folder| Path::new(folder).join("faketime"))
        .collect();
    if let Ok(entries) = std::fs::read_dir("/usr/lib") {
        folders.extend(entries.flatten().map(|entry| entry.path().join("faketime")));
    }
    ["libfaketimeMT.so.1", "libfaketime.so.1"]
        .iter()
        .flat_map(|name| folders.iter().map(move |folder| folder.join(name)))
        .find(|library| library.is_file())
        .context("libfaketime.so.1 not found: install Debian's libfaketime (scripts/services does), or set LIBFAKETIME")
}

/// One of the child's output streams.
type Output = std::pin::Pin<Box<dyn AsyncRead + Send>>;

pub struct ServerProcess {
    pub addr: SocketAddr,
    child: Child,
    /// Holds the address file the process writes once it listens.
    _address_dir: tempfile::TempDir,
    /// Everything the process printed, for failure messages and for tests about logs.
    output: Arc<Mutex<Vec<String>>>,
}

impl ServerProcess {
    /// Spawns `command` on a free port of the loopback (plus `flags`, which come last and so
    /// win) and answers once the process has written its address file. It may not serve yet:
    /// see [`ServerProcess::wait_until_serving`].
    pub async fn spawn(command: Command, flags: &[&str]) -> anyhow::Result<Self> {
        let defaults = ["--health-check-interval", "100ms", "--log-format", "text"];
        Self::spawn_with(command, &defaults, flags).await
    }

    /// Like [`ServerProcess::spawn`], with `defaults` instead of the coordinator's own (before
    /// `flags`, which win).
    pub async fn spawn_with(
        mut command: Command,
        defaults: &[&str],
        flags: &[&str],
    ) -> anyhow::Result<Self> {
        let address_dir = tempfile::tempdir().context("a folder for the address file")?;
        let address_file = address_dir.path().join("address");
        let mut child = command
            .args(["--listen", "127.0.0.1:0"])
            .arg("--address-file")
            .arg(&address_file)
            .args(defaults)
            .args(flags)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .context("starting the binary")?;
        let output = Arc::new(Mutex::new(Vec::new()));
        // Both streams are read to their end, so that the process never blocks on a full pipe.
        for stream in [
            child.stdout.take().map(|out| Box::pin(out) as Output),
            child.stderr.take().map(|err| Box::pin(err) as Output),
        ]
        .into_iter()
        .flatten()
        {
            let lines_seen = output.clone();
            tokio::spawn(async move {
                let mut lines = BufReader::new(stream).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    if let Ok(mut seen) = lines_seen.lock() {
                        seen.push(line);
                    }
                }
            });
        }
        let started = tokio::time::Instant::now();
        let addr = loop {
            if let Ok(text) = std::fs::read_to_string(&address_file)
                && let Ok(addr) = text.trim().parse::<SocketAddr>()
            {
                break addr;
            }
            if let Some(status) = child.try_wait()? {
                bail!(
                    "the process exited ({status}) before listening: {}",
                    joined(&output)
                );
            }
            if started.elapsed() > START_LIMIT {
                bail!(
                    "the process wrote no address file in {START_LIMIT:?}: {}",
                    joined(&output)
                );
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        Ok(Self {
            addr,
            child,
            _address_dir: address_dir,
            output,
        })
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Waits until the process answers SERVING on its health service.
    pub async fn wait_until_serving(&self) -> anyhow::Result<()> {
        crate::health::wait_until_serving(&self.endpoint(), START_LIMIT)
            .await
            .with_context(|| joined(&self.output))
    }

    /// Everything the process printed so far.
    pub fn output(&self) -> String {
        joined(&self.output)
    }

    pub fn output_contains(&self, text: &str) -> bool {
        self.output().contains(text)
    }

    pub fn pid(&self) -> anyhow::Result<u32> {
        self.child.id().context("the process has exited")
    }

    /// A memory figure of the process from /proc, in KiB: `VmRSS` (now) or `VmHWM` (peak).
    pub fn memory_kib(&self, field: &str) -> anyhow::Result<u64> {
        let pid = self.pid()?;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
        status
            .lines()
            .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
            .and_then(|value| value.trim().trim_end_matches("kB").trim().parse().ok())
            .with_context(|| format!("{field} in /proc/{pid}/status"))
    }

    /// Sends `signal` (a name `kill` knows: TERM, INT, HUP, KILL, STOP, CONT).
    pub fn signal(&self, signal: &str) -> anyhow::Result<()> {
        let pid = self.pid()?;
        let status = std::process::Command::new("kill")
            .args([format!("-{signal}"), pid.to_string()])
            .status()
            .context("running kill")?;
        if !status.success() {
            bail!("kill -{signal} {pid} failed");
        }
        Ok(())
    }

    /// Waits at most `limit` for the process to exit and answers its exit code (`None` when
    /// a signal ended it).
    pub async fn wait(&mut self, limit: Duration) -> anyhow::Result<Option<i32>> {
        let status = tokio::time::timeout(limit, self.child.wait())
            .await
            .with_context(|| format!("the process did not exit in {limit:?}: {}", self.output()))?
            .context("waiting for the process")?;
        Ok(status.code())
    }

    /// Stops the process with SIGTERM and waits for it to exit.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        self.signal("TERM")?;
        self.wait(Duration::from_secs(60)).await?;
        Ok(())
    }
}

fn joined(output: &Mutex<Vec<String>>) -> String {
    output
        .lock()
        .map(|lines| lines.join("\n"))
        .unwrap_or_default()
}
