//! `idempotency-bench gateway`: the HTTP gateway's cost, measured with `wrk` (Debian's) side by
//! side with the upstream alone, in one run: the coordinator binary on a fresh PostgreSQL
//! database, a minimal upstream HTTP server in this process, and the gateway binary
//! (`idempotency-coordinator gateway`) in front of it.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, bail};
use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use idempotency_testkit::Binary;
use idempotency_testkit::database::drop_postgres_database;

#[derive(Debug, clap::Args)]
pub struct Settings {
    /// A PostgreSQL server the benchmark may create (and drop) a database on.
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432")]
    postgres_server: String,
    /// How long each measurement runs.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Concurrent connections for the throughput measurements.
    #[arg(long, default_value_t = 64)]
    callers: usize,
    /// wrk's threads for the throughput measurements.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// The coordinator's store: postgres (a fresh database on --postgres-server) or sqlite (a
    /// file in a temporary folder).
    #[arg(long, default_value = "postgres", value_parser = ["postgres", "sqlite"])]
    store: String,
}

/// One wrk run's figures.
struct Measured {
    requests_per_second: f64,
    p50_ms: f64,
    p99_ms: f64,
    /// Answers other than 2xx or 3xx.
    refused: u64,
    /// Connections that failed or requests wrk gave up on (its 2 s timeout).
    socket_errors: u64,
}

pub async fn run(settings: Settings) -> anyhow::Result<()> {
    let binary = Binary::beside_current_exe()?;
    let run = uuid::Uuid::new_v4().simple().to_string();
    let database = format!("gateway_bench_{}", &run[..12]);
    let scripts = tempfile_dir()?;
    let database_url = match settings.store.as_str() {
        "sqlite" => format!("sqlite://{}", scripts.join("bench.db").display()),
        _ => format!("{}/{database}", settings.postgres_server),
    };
    let coordinator = crate::serving(&binary, &database_url, &[]).await?;
    let upstream = start_upstream().await?;
    let gateway = binary
        .gateway(&[
            "--upstream",
            &format!("http://{upstream}"),
            "--coordinator",
            &coordinator.endpoint(),
            "--namespace",
            "bench",
        ])
        .await?;
    let fresh = scripts.join("fresh.lua");
    let replay = scripts.join("replay.lua");
    std::fs::write(&replay, replay_script(&run))?;
    let plain = scripts.join("plain.lua");
    std::fs::write(&plain, PLAIN_POST)?;

    let upstream_url = format!("http://{upstream}/orders");
    let gateway_url = format!("http://{}/orders", gateway.addr);
    let d = settings.duration;
    // Each wrk run gets keys of its own, so that no "fresh" key was used by an earlier run (or
    // is still in flight from one).
    let wrk = |url: &str, script: &std::path::Path, threads, callers, duration| {
        let (url, script) = (url.to_owned(), script.to_owned());
        let fresh = fresh.clone();
        async move {
            let nonce = uuid::Uuid::new_v4().simple().to_string();
            std::fs::write(&fresh, fresh_keys_script(&nonce))?;
            wrk(&url, &script, threads, callers, duration).await
        }
    };
    // Warm both paths (connections, the coordinator's pool, the replayed key).
    wrk(&upstream_url, &plain, 1, 1, Duration::from_secs(1)).await?;
    wrk(&gateway_url, &replay, 1, 1, Duration::from_secs(1)).await?;
    wrk(&gateway_url, &fresh, 1, 1, Duration::from_secs(1)).await?;

    println!("store: {}", settings.store);
    println!("| callers | path | requests/s | p50 ms | p99 ms | non-2xx | socket errors |");
    println!("| ---: | --- | ---: | ---: | ---: | ---: | ---: |");
    let cases: [(&str, &str, &std::path::Path); 4] = [
        ("upstream alone", upstream_url.as_str(), plain.as_path()),
        ("gateway, fresh keys", gateway_url.as_str(), fresh.as_path()),
        ("gateway, replays", gateway_url.as_str(), replay.as_path()),
        (
            "gateway, no key (passed through)",
            gateway_url.as_str(),
            plain.as_path(),
        ),
    ];
    for (threads, callers) in [(1, 1), (settings.threads, settings.callers)] {
        // Alternating: the upstream alone is measured first and again last.
        for (name, url, script) in cases.iter().chain(cases.first()) {
            let measured = wrk(url, script, threads, callers, d).await?;
            println!(
                "| {callers} | {name} | {:.0} | {:.3} | {:.3} | {} | {} |",
                measured.requests_per_second,
                measured.p50_ms,
                measured.p99_ms,
                measured.refused,
                measured.socket_errors
            );
        }
    }
    gateway.stop().await?;
    coordinator.stop().await?;
    if settings.store == "postgres" {
        drop_postgres_database(&settings.postgres_server, &database).await?;
    }
    std::fs::remove_dir_all(&scripts).ok();
    Ok(())
}

fn tempfile_dir() -> anyhow::Result<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!("gateway-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

const PLAIN_POST: &str = r#"
wrk.method = "POST"
wrk.body = '{"item":"book"}'
wrk.headers["Content-Type"] = "application/json"
"#;

/// Every request with a key never used before: `<run>-<thread>-<counter>`.
fn fresh_keys_script(run: &str) -> String {
    format!(
        r#"
local threads = 0
function setup(thread)
  threads = threads + 1
  thread:set("id", threads)
end
local counter = 0
request = function()
  counter = counter + 1
  local key = '"fresh-{run}-' .. tostring(id) .. '-' .. counter .. '"'
  return wrk.format("POST", nil, {{["Idempotency-Key"] = key, ["Content-Type"] = "application/json"}}, '{{"item":"book"}}')
end
"#
    )
}

/// Every request with one key, completed by the first.
fn replay_script(run: &str) -> String {
    format!(
        r#"
wrk.method = "POST"
wrk.body = '{{"item":"book"}}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Idempotency-Key"] = '"replay-{run}"'
"#
    )
}

async fn wrk(
    url: &str,
    script: &std::path::Path,
    threads: usize,
    callers: usize,
    duration: Duration,
) -> anyhow::Result<Measured> {
    let output = tokio::process::Command::new("wrk")
        .args([
            "--latency",
            "-t",
            &threads.to_string(),
            "-c",
            &callers.to_string(),
        ])
        .args(["-d", &format!("{}s", duration.as_secs().max(1))])
        .arg("-s")
        .arg(script)
        .arg(url)
        .output()
        .await
        .context("running wrk (apt-get install wrk)")?;
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    if !output.status.success() {
        bail!(
            "wrk failed: {text}{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    parse_wrk(&text).with_context(|| format!("reading wrk's report:\n{text}"))
}

fn parse_wrk(text: &str) -> anyhow::Result<Measured> {
    let mut measured = Measured {
        requests_per_second: 0.0,
        p50_ms: f64::NAN,
        p99_ms: f64::NAN,
        refused: 0,
        socket_errors: 0,
    };
    for line in text.lines().map(str::trim) {
        let mut words = line.split_whitespace();
        match (words.next(), words.next()) {
            (Some("50%"), Some(value)) => measured.p50_ms = millis(value)?,
            (Some("99%"), Some(value)) => measured.p99_ms = millis(value)?,
            (Some("Requests/sec:"), Some(value)) => measured.requests_per_second = value.parse()?,
            _ => {}
        }
        if let Some(count) = line.strip_prefix("Non-2xx or 3xx responses:") {
            measured.refused += count.trim().parse::<u64>()?;
        }
        if let Some(errors) = line.strip_prefix("Socket errors:") {
            for part in errors.split(',') {
                if let Some(count) = part.split_whitespace().nth(1) {
                    measured.socket_errors += count.parse::<u64>()?;
                }
            }
        }
    }
    Ok(measured)
}

/// wrk's durations: `812.00us`, `1.23ms`, `2.00s`.
fn millis(value: &str) -> anyhow::Result<f64> {
    for (unit, factor) in [("us", 0.001), ("ms", 1.0), ("s", 1000.0), ("m", 60_000.0)] {
        if let Some(number) = value.strip_suffix(unit) {
            return Ok(number.parse::<f64>()? * factor);
        }
    }
    bail!("not a duration: {value}")
}

/// The upstream: answers every request 201 with a small JSON body, as fast as it can.
async fn start_upstream() -> anyhow::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let service =
                    hyper::service::service_fn(|_request: Request<hyper::body::Incoming>| async {
                        Response::builder()
                            .status(201)
                            .header("content-type", "application/json")
                            .body(Full::new(Bytes::from_static(b"{\"order\":42}")))
                    });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok(addr)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrk_reports_are_read() {
        let report = "Running 1s test @ http://127.0.0.1:1/orders\n  Latency Distribution\n     50%  812.00us\n     75%    1.00ms\n     99%    2.50ms\n  1000 requests in 1.00s, 1.00MB read\n  Socket errors: connect 0, read 1, write 0, timeout 2\n  Non-2xx or 3xx responses: 3\nRequests/sec:   1000.50\n";
        let measured = parse_wrk(report).expect("parses");
        assert!((measured.p50_ms - 0.812).abs() < 1e-9);
        assert!((measured.p99_ms - 2.5).abs() < 1e-9);
        assert!((measured.requests_per_second - 1000.5).abs() < 1e-9);
        assert_eq!(measured.refused, 3);
        assert_eq!(measured.socket_errors, 3);
    }
}
