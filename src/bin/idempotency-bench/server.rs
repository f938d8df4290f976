//! The coordinator binary as a child process of the benchmark.

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

pub struct Coordinator {
    child: Child,
    addr: SocketAddr,
}

impl Coordinator {
    /// Starts `idempotency-coordinator` (from the benchmark's own folder) on `database_url` and
    /// waits until it serves.
    pub async fn start(database_url: &str) -> anyhow::Result<Self> {
        Self::start_with(database_url, &[]).await
    }

    /// Like [`Coordinator::start`], with extra flags.
    pub async fn start_with(database_url: &str, flags: &[&str]) -> anyhow::Result<Self> {
        let binary = std::env::current_exe()?.with_file_name("idempotency-coordinator");
        let mut child = Command::new(&binary)
            .args(["serve", "--listen", "127.0.0.1:0", "--log-format", "json"])
            .args([
                "--database-url",
                database_url,
                "--health-check-interval",
                "100ms",
            ])
            .args(flags)
            .env("RUST_LOG", "warn,idempotency_coordinator=info")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let stdout = child.stdout.take().context("the coordinator's output")?;
        let mut lines = BufReader::new(stdout).lines();
        let mut addr = None;
        let mut ready = false;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while !(addr.is_some() && ready) {
            let line = tokio::time::timeout_at(deadline, lines.next_line())
                .await
                .context("the coordinator did not start in 30 s")??
                .context("the coordinator exited while starting")?;
            let event: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
            match event["message"].as_str() {
                Some("listening") => {
                    addr = event["address"].as_str().and_then(|a| a.parse().ok());
                }
                Some("store ready; serving") => ready = true,
                _ => {}
            }
        }
        // Keep reading, so that the coordinator never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        let Some(addr) = addr else {
            bail!("the coordinator did not say where it listens");
        };
        Ok(Self { child, addr })
    }

    /// A memory figure of the coordinator's process from /proc, in KiB: `VmRSS` (now) or
    /// `VmHWM` (peak).
    pub fn memory_kib(&self, field: &str) -> anyhow::Result<u64> {
        let pid = self.child.id().context("the coordinator has exited")?;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
        status
            .lines()
            .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
            .and_then(|value| value.trim().trim_end_matches("kB").trim().parse().ok())
            .with_context(|| format!("{field} in /proc/{pid}/status"))
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops the coordinator with SIGTERM and waits for it.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(pid) = self.child.id() {
            std::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status()?;
        }
        self.child.wait().await?;
        Ok(())
    }
}

/// Drops the benchmark's PostgreSQL database.
pub async fn drop_postgres_database(server: &str, database: &str) -> anyhow::Result<()> {
    use sqlx::Connection;
    let mut admin = sqlx::PgConnection::connect(&format!("{server}/postgres")).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        r#"DROP DATABASE IF EXISTS "{database}" WITH (FORCE)"#
    )))
    .execute(&mut admin)
    .await?;
    Ok(())
}
