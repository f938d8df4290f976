//! The real binary as a child process, for what only a process can show: signals, exit codes,
//! and tools such as grpcurl talking to it.

use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::process::{Child, Command};

/// One of the child's output streams.
type Output = std::pin::Pin<Box<dyn AsyncRead + Send>>;

pub struct ServerProcess {
    pub addr: SocketAddr,
    child: Child,
    /// Holds the address file the process writes once it listens.
    _address_dir: tempfile::TempDir,
    /// Everything the process printed, for failure messages.
    pub output: Arc<Mutex<Vec<String>>>,
}

impl ServerProcess {
    /// Starts `idempotency-coordinator serve` on a free port and waits for its address.
    pub async fn start(database_url: &str, flags: &[&str]) -> Self {
        Self::start_with_log_level(database_url, flags, "info").await
    }

    /// Like [`Self::start`], logging at `level` (`RUST_LOG`).
    pub async fn start_with_log_level(database_url: &str, flags: &[&str], level: &str) -> Self {
        let mut command = Command::new(env!("CARGO_BIN_EXE_idempotency-coordinator"));
        command
            .args(["serve", "--database-url", database_url])
            .env("RUST_LOG", level);
        Self::spawn(command, flags).await
    }

    /// Starts the binary with no store settings at all, in `directory`, as a newcomer would.
    pub async fn start_embedded_in(directory: &std::path::Path) -> Self {
        Self::start_embedded_in_with(directory, &[]).await
    }

    /// Like [`Self::start_embedded_in`], with extra flags.
    pub async fn start_embedded_in_with(directory: &std::path::Path, flags: &[&str]) -> Self {
        let mut command = Command::new(env!("CARGO_BIN_EXE_idempotency-coordinator"));
        command
            .current_dir(directory)
            .env_remove("DATABASE_URL")
            .env_remove("IDEMPOTENCY_SQLITE_PATH")
            .env("RUST_LOG", "info");
        Self::spawn(command, flags).await
    }

    /// Spawns the process on a free port and learns the port from the address file it writes
    /// once it listens (`--address-file`), never from its log lines.
    async fn spawn(mut command: Command, flags: &[&str]) -> Self {
        let address_dir = tempfile::tempdir().expect("a folder for the address file");
        let address_file = address_dir.path().join("address");
        let mut child = command
            .args(["--listen", "127.0.0.1:0"])
            .arg("--address-file")
            .arg(&address_file)
            .args(["--health-check-interval", "100ms", "--log-format", "text"])
            .args(flags)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start the server binary");
        let output = Arc::new(Mutex::new(Vec::new()));
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
                    lines_seen.lock().expect("output").push(line);
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
            if let Ok(Some(status)) = child.try_wait() {
                panic!(
                    "the server exited ({status}) before listening: {:?}",
                    output.lock()
                );
            }
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "no address file written: {:?}",
                output.lock()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        Self {
            addr,
            child,
            _address_dir: address_dir,
            output,
        }
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Everything the process printed so far.
    pub fn output(&self) -> String {
        self.output.lock().expect("output").join("\n")
    }

    pub fn output_contains(&self, text: &str) -> bool {
        self.output().contains(text)
    }

    /// The process's peak resident memory so far (VmHWM), in KiB.
    pub fn peak_rss_kib(&self) -> u64 {
        let pid = self.child.id().expect("process still running");
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
        status
            .lines()
            .find_map(|line| line.strip_prefix("VmHWM:"))
            .and_then(|value| value.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmHWM in /proc/<pid>/status")
    }

    /// A client, once the process reports SERVING.
    pub async fn client_when_serving(&self) -> super::Client {
        let health = super::health_client(self.endpoint())
            .await
            .expect("connect");
        super::eventually(Duration::from_secs(20), "the binary serves", || {
            super::is_serving(&health)
        })
        .await;
        super::Client::connect(self.endpoint())
            .await
            .expect("connect")
    }

    pub fn signal(&self, signal: &str) {
        let pid = self.child.id().expect("process still running");
        let status = std::process::Command::new("kill")
            .args([format!("-{signal}"), pid.to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{signal} failed");
    }

    /// Waits for the process to exit and answers its exit code.
    pub async fn wait(&mut self, limit: Duration) -> Option<i32> {
        let status = tokio::time::timeout(limit, self.child.wait())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "process did not exit in {limit:?}: {:?}",
                    self.output.lock()
                )
            })
            .expect("wait for the process");
        status.code()
    }
}
