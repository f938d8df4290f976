//! `/metrics` (`--metrics-listen`), by surface: what the calls count (`counts`), the coalescers'
//! queues and the reaper's lag (`queues`), the exposition itself and its flags (`exposition`);
//! and `healthcheck`, the real binary (`healthcheck`; over TLS and in `admin`'s forms,
//! `healthcheck_tls`). The helpers here scrape with a real HTTP
//! GET and read the samples.

mod counts;
mod exposition;
mod healthcheck;
mod healthcheck_tls;
mod queues;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use idempotency_coordinator::proto::idempotency::v1 as pb;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::Code;

use crate::support::process::ServerProcess;
use crate::support::*;

/// `GET /metrics` over a plain TCP connection; the status line and the body.
pub async fn http_get(address: SocketAddr, path: &str) -> (String, String) {
    let mut stream = tokio::net::TcpStream::connect(address)
        .await
        .expect("connect to the metrics port");
    let request = format!("GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n");
    stream
        .write_all(request.as_bytes())
        .await
        .expect("send the request");
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_string(&mut answer))
        .await
        .expect("the answer within 10 s")
        .expect("read the answer");
    let (head, body) = answer.split_once("\r\n\r\n").expect("a head and a body");
    let status = head.lines().next().unwrap_or_default().to_owned();
    (status, body.to_owned())
}

pub(crate) async fn scrape(app: &TestApp) -> String {
    let (status, body) = http_get(app.metrics_addr.expect("metrics on"), "/metrics").await;
    assert_eq!(status, "HTTP/1.1 200 OK");
    body
}

/// The samples of an exposition: `name{labels}` as written, to its value.
pub fn samples(exposition: &str) -> HashMap<String, f64> {
    exposition
        .lines()
        .filter(|line| !line.starts_with('#') && !line.trim().is_empty())
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            Some((series.to_owned(), value.parse().ok()?))
        })
        .collect()
}

/// How many batches `coalescer` sent to the store that weighed more than one (calls, or ids for
/// MarkProcessed): `idempotency_coalesced_batch_size`'s count less its `le="1"` bucket.
pub(crate) fn batches_of_several(samples: &HashMap<String, f64>, coalescer: &str) -> f64 {
    let series = |suffix: String| {
        samples
            .get(&format!("idempotency_coalesced_batch_size{suffix}"))
            .copied()
            .unwrap_or(0.0)
    };
    series(format!("_count{{coalescer=\"{coalescer}\"}}"))
        - series(format!("_bucket{{coalescer=\"{coalescer}\",le=\"1\"}}"))
}

fn api(method: &str) -> String {
    format!(
        "grpc_type=\"unary\",grpc_service=\"idempotency.v1.IdempotencyService\",grpc_method=\"{method}\""
    )
}

pub(crate) fn value(samples: &HashMap<String, f64>, series: &str) -> f64 {
    samples
        .get(series)
        .copied()
        .unwrap_or_else(|| panic!("no sample {series} in the exposition"))
}

async fn coordinator(args: &[&str]) -> std::process::Output {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_idempotency-coordinator"))
        .args(args)
        .env_remove("IDEMPOTENCY_METRICS_LISTEN")
        .env_remove("IDEMPOTENCY_METRICS_NAMESPACE_LABELS")
        .env_remove("IDEMPOTENCY_HEALTHCHECK_ADDR")
        .env_remove("IDEMPOTENCY_HEALTHCHECK_COORDINATOR")
        .env_remove("IDEMPOTENCY_HEALTHCHECK_COORDINATOR_CA")
        .env_remove("IDEMPOTENCY_HEALTHCHECK_TIMEOUT")
        .output()
        .await
        .expect("run the binary")
}

/// A server with `/metrics` on a free port (and `flags`), and a client of it.
pub(crate) async fn metered(backend: Backend, flags: &[&str]) -> (TestApp, Client) {
    let flags = [&["--metrics-listen", "127.0.0.1:0"], flags].concat();
    app_and_client_with(backend, &flags).await
}

/// Asserts that each series reads its wanted value in `samples`.
pub(crate) fn assert_values<S: AsRef<str>>(samples: &HashMap<String, f64>, expected: &[(S, f64)]) {
    for (series, wanted) in expected {
        let series = series.as_ref();
        assert_eq!(value(samples, series), *wanted, "{series}");
    }
}

/// Waits until `series` reads `wanted` in a scrape.
pub(crate) async fn series_reaches(app: &TestApp, series: &str, wanted: f64) {
    eventually(
        Duration::from_secs(10),
        &format!("{series} is {wanted}"),
        || async move { samples(&scrape(app).await).get(series).copied() == Some(wanted) },
    )
    .await;
}
