//! The `fault-proxy` binary (`src/bin/fault-proxy.rs`) as a child process, and its control
//! routes, for the Rust client's run of the scenario vectors. The other clients' suites start
//! the same binary from their own languages.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};

/// The proxy between a client and the coordinator; killed when dropped.
pub struct FaultProxy {
    /// Where clients connect instead of the coordinator.
    pub addr: SocketAddr,
    control: SocketAddr,
    _child: Child,
}

#[derive(Deserialize)]
struct Addresses {
    proxy: SocketAddr,
    control: SocketAddr,
}

impl FaultProxy {
    /// `FAULT_PROXY_BIN`, else `fault-proxy` in the target folder of the running test binary
    /// (`target/debug/deps/…` → `target/debug/fault-proxy`).
    pub fn binary() -> anyhow::Result<PathBuf> {
        if let Some(path) = std::env::var_os("FAULT_PROXY_BIN") {
            return Ok(PathBuf::from(path));
        }
        let exe = std::env::current_exe().context("locating the running executable")?;
        let beside = exe
            .parent()
            .and_then(|deps| deps.parent())
            .map(|profile| profile.join("fault-proxy"))
            .context("the running executable has no target folder")?;
        if !beside.exists() {
            bail!(
                "no fault-proxy at {}: build it (cargo build -p idempotency-testkit) or set FAULT_PROXY_BIN",
                beside.display()
            );
        }
        Ok(beside)
    }

    /// Starts a proxy to `upstream` and waits for the line with its addresses.
    pub async fn start(upstream: SocketAddr) -> anyhow::Result<Self> {
        let mut child = Command::new(Self::binary()?)
            .args(["--upstream", &upstream.to_string()])
            // It serves until its stdin closes: with us, at the latest.
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .context("starting fault-proxy")?;
        let stdout = child.stdout.take().context("fault-proxy's stdout")?;
        let line = tokio::time::timeout(
            Duration::from_secs(10),
            BufReader::new(stdout).lines().next_line(),
        )
        .await
        .context("fault-proxy printed no addresses in 10 s")??
        .context("fault-proxy exited before printing its addresses")?;
        let addresses: Addresses = serde_json::from_str(&line)
            .with_context(|| format!("fault-proxy's first line: {line:?}"))?;
        Ok(Self {
            addr: addresses.proxy,
            control: addresses.control,
            _child: child,
        })
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// `POST path` with `body` on the control port; an answer other than 200 is an error.
    pub async fn post(&self, path: &str, body: &str) -> anyhow::Result<()> {
        self.control_call("POST", path, body.to_owned())
            .await
            .map(drop)
    }

    /// The milliseconds since the proxy started at which each call of each method arrived.
    pub async fn calls(&self) -> anyhow::Result<HashMap<String, Vec<f64>>> {
        let body = self.control_call("GET", "/calls", String::new()).await?;
        serde_json::from_slice(&body).context("fault-proxy's /calls")
    }

    async fn control_call(&self, method: &str, path: &str, body: String) -> anyhow::Result<Bytes> {
        let stream = TcpStream::connect(self.control)
            .await
            .context("fault-proxy's control port")?;
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(connection);
        let request = Request::builder()
            .method(method)
            .uri(path)
            .header(hyper::header::HOST, self.control.to_string())
            .body(Full::new(Bytes::from(body)))?;
        let answer = sender.send_request(request).await?;
        let status = answer.status();
        let body = answer.into_body().collect().await?.to_bytes();
        if !status.is_success() {
            bail!(
                "fault-proxy {method} {path}: {status} {}",
                String::from_utf8_lossy(&body)
            );
        }
        Ok(body)
    }
}
