//! A broken environment against the real binary: log streams that fail, and a tokens file that
//! would block whoever opens it. The service must keep serving, keep its signals working, and
//! stop cleanly.

use std::net::SocketAddr;
use std::process::Stdio;
use std::time::Duration;

use tokio::process::{Child, Command};
use tonic::Code;

use crate::support::proxy::TcpProxy;
use crate::support::security::{
    Bearer, TokensFile, assert_the_reload_took_effect, authed_client, token,
};
use crate::support::*;

/// Where the child's stdout and stderr both go.
enum LogSink {
    /// A pipe whose reading end is already closed (`serve 2>&1 | head -n 0`): every write is
    /// EPIPE.
    ClosedPipe,
    /// A device that is always full: every write is ENOSPC.
    DevFull,
}

impl LogSink {
    fn stdio(&self) -> (Stdio, Stdio) {
        match self {
            Self::ClosedPipe => {
                let (reader, writer) = std::io::pipe().expect("a pipe");
                drop(reader);
                let second = writer.try_clone().expect("a second writer");
                (Stdio::from(writer), Stdio::from(second))
            }
            Self::DevFull => {
                let open = || {
                    std::fs::OpenOptions::new()
                        .write(true)
                        .open("/dev/full")
                        .expect("/dev/full")
                };
                (Stdio::from(open()), Stdio::from(open()))
            }
        }
    }
}

/// The binary with both log streams on `sink`, logging every call (`RUST_LOG=debug`), once it
/// has written its address file.
async fn start_with_logs_on(
    database_url: &str,
    sink: &LogSink,
) -> (Child, SocketAddr, tempfile::TempDir) {
    let (stdout, stderr) = sink.stdio();
    let mut command = Command::new(env!("CARGO_BIN_EXE_idempotency-coordinator"));
    command
        .env("RUST_LOG", "debug")
        .stdout(stdout)
        .stderr(stderr);
    start(
        command,
        database_url,
        &["--shutdown-grace", "5s", "--operation-timeout", "1s"],
    )
    .await
}

/// Starts `command` (the binary, or a wrapper that runs it) as `serve` on a free port with
/// `flags`, and waits for its address file.
async fn start(
    mut command: Command,
    database_url: &str,
    flags: &[&str],
) -> (Child, SocketAddr, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("a folder");
    let address_file = dir.path().join("address");
    let mut child = command
        .args(["serve", "--database-url", database_url])
        .args([
            "--listen",
            "127.0.0.1:0",
            "--health-check-interval",
            "100ms",
        ])
        .arg("--address-file")
        .arg(&address_file)
        .args(flags)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start the binary");
    let started = tokio::time::Instant::now();
    let addr = loop {
        if let Ok(text) = std::fs::read_to_string(&address_file)
            && let Ok(addr) = text.trim().parse()
        {
            break addr;
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!("the binary exited ({status}) before listening");
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "no address file written"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    (child, addr, dir)
}

fn send_signal(child: &Child, signal: &str) {
    let pid = child.id().expect("still running");
    let status = std::process::Command::new("kill")
        .args([format!("-{signal}"), pid.to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{signal}");
}

async fn with_both_log_streams_failing_the_service_serves_and_stops_on_sigterm(sink: LogSink) {
    let database = TestDatabase::create(Backend::Postgres).await;
    // The database is reached through a proxy, to take it away later.
    let proxy = TcpProxy::start("127.0.0.1:5432".parse().expect("address")).await;
    let url = proxy.database_url(database.postgres_name());
    let (mut child, addr, _dir) = start_with_logs_on(&url, &sink).await;
    let endpoint = format!("http://{addr}");
    let health = health_client(endpoint.clone()).await.expect("connect");
    eventually(Duration::from_secs(20), "the binary serves", || {
        is_serving(&health)
    })
    .await;

    // Every call logs (at debug) into the broken sink; none may take anything down.
    let mut client = Client::connect(endpoint).await.expect("connect");
    for n in 0..20 {
        claim(&mut client, try_start(&format!("k{n}"))).await;
    }
    assert!(is_serving(&health).await, "still SERVING, truthfully");

    // The health monitor logs the outage into the broken sink, and must still report it; calls
    // fail as the contract says, not CANCELLED by a task that died.
    proxy.cut();
    eventually(
        Duration::from_secs(10),
        "health reports the outage",
        || async { !is_serving(&health).await },
    )
    .await;
    let status = client
        .try_start(try_start("during-the-outage"))
        .await
        .expect_err("the store is down");
    assert_error(&status, Code::Unavailable, "STORE_UNAVAILABLE");

    // The signal handler logs "SIGTERM received" into the broken sink, then must still stop
    // the service: exit 0 within the grace period (5 s) and its second of margin.
    send_signal(&child, "TERM");
    let status = tokio::time::timeout(Duration::from_secs(7), child.wait())
        .await
        .expect("the process stopped within the grace period")
        .expect("wait");
    assert_eq!(status.code(), Some(0), "{status:?}");
}

#[tokio::test]
async fn with_logs_on_a_closed_pipe_sigterm_still_stops_the_service() {
    with_both_log_streams_failing_the_service_serves_and_stops_on_sigterm(LogSink::ClosedPipe)
        .await;
}

#[tokio::test]
async fn with_logs_on_a_full_device_the_service_starts_serves_and_stops() {
    with_both_log_streams_failing_the_service_serves_and_stops_on_sigterm(LogSink::DevFull).await;
}

/// A FIFO renamed over the tokens file, then SIGHUP: opening it would block until some writer
/// came. The reload refuses it without blocking anything, the tokens in force stay, later
/// SIGHUPs still reload, and SIGTERM still stops the service.
#[tokio::test]
async fn a_fifo_over_the_tokens_file_is_refused_and_later_reloads_still_work() {
    let (first, first_line) = token("first", "*");
    let (later, later_line) = token("later", "*");
    let tokens = TokensFile::new(&[&first_line]);
    let database = TestDatabase::create(Backend::Postgres).await;
    let mut server = tokens.serve_binary(&database).await;
    let mut first_client = authed_client(server.endpoint(), Bearer::token(&first)).await;
    first_client
        .lookup(lookup("k"))
        .await
        .expect("first is known");

    let fifo = tokens.path.with_extension("fifo");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .expect("run mkfifo");
    assert!(made.success());
    std::fs::rename(&fifo, &tokens.path).expect("rename the FIFO over the tokens file");
    server.signal("HUP");
    eventually(Duration::from_secs(5), "the FIFO was refused", || async {
        server.output_contains("is not a regular file (it is a FIFO)")
    })
    .await;

    // The tokens in force stay, and the service answers at once: nothing is wedged.
    for _ in 0..20 {
        tokio::time::timeout(Duration::from_secs(2), first_client.lookup(lookup("k")))
            .await
            .expect("answered without delay")
            .expect("first is still in force");
    }
    let health = health_client(server.endpoint()).await.expect("connect");
    assert!(is_serving(&health).await);

    // A later SIGHUP with a regular file reloads: revocation still works.
    tokens.write(&[&later_line]);
    server.signal("HUP");
    let later_client = authed_client(server.endpoint(), Bearer::token(&later)).await;
    assert_the_reload_took_effect(&later_client, &first_client).await;

    server.signal("TERM");
    assert_eq!(server.wait(Duration::from_secs(15)).await, Some(0));
}

/// CPU time (user and system) the process has used so far.
fn cpu_time(child: &Child) -> Duration {
    let pid = child.id().expect("still running");
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("/proc/<pid>/stat");
    // The fields after the command name (which is in parentheses and may hold spaces):
    // state is the first, utime the 12th and stime the 13th.
    let after_name = &stat[stat.rfind(')').expect("a command name") + 2..];
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    let ticks: u64 =
        fields[11].parse::<u64>().expect("utime") + fields[12].parse::<u64>().expect("stime");
    let per_second: u64 = String::from_utf8(
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .expect("getconf")
            .stdout,
    )
    .expect("ASCII")
    .trim()
    .parse()
    .expect("a number");
    Duration::from_millis(ticks * 1000 / per_second)
}

const DESCRIPTOR_LIMIT: &str = "--nofile=64:64";
const IDLE_SOCKETS: usize = 150;

/// The review's repro, scaled down: the server under a limit of 64 descriptors, and 150 idle
/// sockets that never send the HTTP/2 preface. At the limit, accepting fails with EMFILE; the
/// server must back off (not spin a core), log it at a bounded rate, close the silent sockets
/// after the handshake timeout, and so serve a new client once descriptors free up.
#[tokio::test]
async fn at_the_descriptor_limit_silent_sockets_are_closed_and_new_clients_served() {
    use tokio::io::AsyncBufReadExt;

    let database = TestDatabase::create(Backend::Postgres).await;
    let mut command = Command::new("prlimit");
    command
        .args([DESCRIPTOR_LIMIT, "--"])
        .arg(env!("CARGO_BIN_EXE_idempotency-coordinator"))
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let (mut child, addr, _dir) = start(
        command,
        &database.url,
        &["--pool-size", "4", "--connection-handshake-timeout", "2s"],
    )
    .await;
    let mut log = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    let accept_failures = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    tokio::spawn({
        let accept_failures = accept_failures.clone();
        async move {
            while let Ok(Some(line)) = log.next_line().await {
                if line.contains("accepting a connection failed") {
                    accept_failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
        }
    });
    let endpoint = format!("http://{addr}");
    {
        let health = health_client(endpoint.clone()).await.expect("connect");
        eventually(Duration::from_secs(20), "the binary serves", || {
            is_serving(&health)
        })
        .await;
    }

    let attack_started = tokio::time::Instant::now();
    let mut silent = Vec::new();
    for _ in 0..IDLE_SOCKETS {
        silent.push(tokio::net::TcpStream::connect(addr).await.expect("connect"));
    }
    // The server is at its descriptor limit now, with more connections waiting in its backlog.
    eventually(Duration::from_secs(5), "accepting failed", || async {
        accept_failures.load(std::sync::atomic::Ordering::Relaxed) > 0
    })
    .await;
    let before = cpu_time(&child);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let spent = cpu_time(&child) - before;
    assert!(
        spent < Duration::from_millis(300),
        "the server used {spent:?} of CPU in one second at the descriptor limit"
    );

    // A new client is served: the silent sockets are closed after the handshake timeout,
    // which frees descriptors, and accepting resumes.
    let served = tokio::time::timeout(Duration::from_secs(20), async {
        let health = health_client(endpoint.clone()).await.expect("connect");
        is_serving(&health).await
    })
    .await
    .expect("a new client was served");
    assert!(served);
    let elapsed = attack_started.elapsed();
    for socket in silent {
        let mut socket = socket;
        let mut byte = [0u8; 1];
        let closed = tokio::time::timeout(Duration::from_secs(10), async {
            use tokio::io::AsyncReadExt;
            loop {
                match socket.read(&mut byte).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await;
        assert!(closed.is_ok(), "a silent socket was kept open");
    }
    let logged = accept_failures.load(std::sync::atomic::Ordering::Relaxed);
    assert!(
        logged as u64 <= elapsed.as_secs() + 2,
        "{logged} log lines about failing accepts in {elapsed:?}"
    );
    println!(
        "descriptor limit: {spent:?} CPU in 1 s at EMFILE, new client served after {elapsed:?}, \
         {logged} accept-failure log lines"
    );

    send_signal(&child, "TERM");
    let status = tokio::time::timeout(Duration::from_secs(15), child.wait())
        .await
        .expect("stopped")
        .expect("wait");
    assert_eq!(status.code(), Some(0));
}

/// An essential task that ends while the service runs: the service turns NOT_SERVING (its
/// Watch streams are told), drains, and `run_until_stopped` answers the failure, which the
/// binary turns into exit status 1 for a restart.
#[tokio::test]
async fn an_essential_task_that_ends_stops_the_service_with_an_error() {
    use idempotency_coordinator::config::{Cli, Command as CliCommand};
    use idempotency_coordinator::startup::StartupError;
    use tokio_stream::StreamExt;
    use tonic_health::pb::health_check_response::ServingStatus as Status;

    let database = TestDatabase::create(Backend::Postgres).await;
    let cli = <Cli as clap::Parser>::try_parse_from([
        "idempotency-coordinator",
        "--listen",
        "127.0.0.1:0",
        "--database-url",
        &database.url,
        "--health-check-interval",
        "100ms",
        "--shutdown-grace",
        "2s",
    ])
    .expect("valid flags");
    let CliCommand::Serve(serve) = cli.into_command() else {
        panic!("serve");
    };
    let app = idempotency_coordinator::Application::build(serve.settings().expect("settings"))
        .await
        .expect("builds");
    let endpoint = format!("http://{}", app.local_addr());
    let shutdown = tokio_util::sync::CancellationToken::new();
    let (end_it, ended) = tokio::sync::oneshot::channel::<()>();
    app.supervisor().spawn("doomed", &shutdown, async move {
        let _ = ended.await;
    });
    let server = tokio::spawn(app.run_until_stopped(shutdown.clone()));

    let mut health = health_client(endpoint).await.expect("connect");
    let mut statuses = health
        .watch(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .expect("Watch")
        .into_inner();
    let mut next_status = async || {
        let message = tokio::time::timeout(Duration::from_secs(20), statuses.next())
            .await
            .expect("a status in time")
            .expect("the stream goes on")
            .expect("a status");
        message.status()
    };
    while next_status().await != Status::Serving {}

    end_it.send(()).expect("the task is waiting");
    assert_eq!(next_status().await, Status::NotServing);
    let stopped = tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .expect("the service stopped")
        .expect("the server task");
    match stopped {
        Err(StartupError::TaskFailed(failure)) => {
            assert_eq!(failure.task, "doomed");
            assert_eq!(failure.how, "ended unexpectedly");
        }
        other => panic!("expected the task's failure, got {other:?}"),
    }
}
