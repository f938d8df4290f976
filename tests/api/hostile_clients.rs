//! Hostile clients against the real server: messages the protobuf decoder refuses.

use std::time::Duration;

use tonic::Code;

use crate::support::process::ServerProcess;
use crate::support::*;

/// Messages the protobuf decoder refuses are the client's fault: INVALID_ARGUMENT with
/// ErrorInfo reason INVALID_ARGUMENT, never INTERNAL (which means a bug here), and nothing is
/// written.
async fn an_undecodable_message_is_invalid_argument_not_internal(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let undecodable: [(&str, Vec<u8>); 3] = [
        // field 2 (key) = 0xFF 0xFE: not UTF-8.
        (
            "invalid UTF-8",
            vec![0x0a, 0x02, b'n', b's', 0x12, 0x02, 0xff, 0xfe],
        ),
        // field 1 announces 5 bytes and carries 1.
        ("truncated", vec![0x0a, 0x05, b'n']),
        // field 1 with wire type 7, which does not exist.
        ("wrong wire type", vec![0x0f, 0x01]),
    ];
    for (what, message) in undecodable {
        let status = raw_unary(
            app.endpoint(),
            "/idempotency.v1.IdempotencyService/TryStart",
            message,
            None,
        )
        .await
        .expect_err(what);
        assert_error(&status, Code::InvalidArgument, "INVALID_ARGUMENT");
        assert!(
            status.message().contains("could not be decoded"),
            "{what}: {status:?}"
        );
    }
    assert_eq!(app.total_rows().await, 0);
    let mut client = app.client().await;
    claim(&mut client, try_start("still-serving")).await;
}

for_each_backend!(an_undecodable_message_is_invalid_argument_not_internal);

/// A raw HTTP/2 connection to the server, driven in the background (h2 answers the server's
/// PINGs by itself, as the attacker in the review did). With `initial_window_size` 0 the
/// server may send headers but no response bytes on any stream.
async fn raw_connection(
    addr: std::net::SocketAddr,
    initial_window_size: u32,
) -> (
    h2::client::SendRequest<bytes::Bytes>,
    tokio::task::JoinHandle<Result<(), h2::Error>>,
) {
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (send_request, connection) = h2::client::Builder::new()
        .initial_window_size(initial_window_size)
        .handshake(tcp)
        .await
        .expect("HTTP/2 handshake");
    (send_request, tokio::spawn(connection))
}

/// Sends one gRPC unary request on `connection` and answers its response head.
async fn raw_call(
    connection: &h2::client::SendRequest<bytes::Bytes>,
    addr: std::net::SocketAddr,
    path: &str,
    message: Vec<u8>,
) -> h2::client::ResponseFuture {
    let request = tonic::codegen::http::Request::builder()
        .method("POST")
        .uri(format!("http://{addr}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .expect("a request");
    let mut ready = connection.clone().ready().await.expect("a stream");
    let (response, mut stream) = ready.send_request(request, false).expect("sent");
    let mut frame = Vec::with_capacity(5 + message.len());
    frame.push(0);
    frame.extend_from_slice(&(message.len() as u32).to_be_bytes());
    frame.extend_from_slice(&message);
    stream.send_data(frame.into(), true).expect("request body");
    response
}

/// The real binary with `flags` on a fresh PostgreSQL database (which must outlive it), once it
/// serves, and a client of it.
async fn serving_binary(flags: &[&str]) -> (TestDatabase, ServerProcess, Client) {
    let database = TestDatabase::create(Backend::Postgres).await;
    let server = ServerProcess::start(&database.url, flags).await;
    let client = server.client_when_serving().await;
    (database, server, client)
}

/// Opens a health Watch of the whole server on `connection`; answers its response head.
async fn health_watch(
    connection: &h2::client::SendRequest<bytes::Bytes>,
    addr: std::net::SocketAddr,
) -> Result<tonic::codegen::http::Response<h2::RecvStream>, h2::Error> {
    let everything = tonic_health::pb::HealthCheckRequest {
        service: String::new(),
    };
    let message = prost::Message::encode_to_vec(&everything);
    raw_call(connection, addr, "/grpc.health.v1.Health/Watch", message)
        .await
        .await
}

const ATTACK_CONNECTIONS: usize = 4;
const LOOKUPS_PER_CONNECTION: usize = 32;
const RESPONSE_BYTES: usize = 1024 * 1024;

/// The review's attack, scaled down: a key completed with a 1 MiB response, and connections
/// that advertise a zero window and send Lookups of it, never taking a byte of the answers.
/// Unbounded, 4 x 32 Lookups pin 128 MiB; here the server accounts at most 8 MiB (4 MiB per
/// connection), refuses the Lookups beyond it, closes the attacking connections once the send
/// timeout (2 s) passes, and serves an honest client throughout.
#[tokio::test]
async fn a_client_that_does_not_read_its_responses_cannot_pin_server_memory() {
    use prost::Message;

    let (_database, server, mut honest) = serving_binary(&[
        "--max-pending-response-bytes",
        "8388608",
        "--max-connection-pending-response-bytes",
        "4194304",
        "--response-send-timeout",
        "2s",
    ])
    .await;
    let started = claim(&mut honest, try_start("big")).await;
    honest
        .complete(complete(
            "big",
            started.lease_token,
            &vec![b'r'; RESPONSE_BYTES],
        ))
        .await
        .expect("Complete");
    // Warm up: the big answer once, honestly, so that the baseline includes its buffers.
    assert!(matches!(
        key_state(&honest, "big").await,
        idempotency_coordinator::proto::idempotency::v1::lookup_response::State::Completed(_)
    ));
    let baseline_kib = server.peak_rss_kib();

    let path = "/idempotency.v1.IdempotencyService/Lookup";
    // Every held response's send deadline is at least 2 s after this.
    let attack_started = tokio::time::Instant::now();
    let mut attackers = Vec::new();
    let (mut held, mut refused) = (0, 0);
    for _ in 0..ATTACK_CONNECTIONS {
        let held_before = held;
        let (connection, driver) = raw_connection(server.addr, 0).await;
        let mut heads = Vec::new();
        for _ in 0..LOOKUPS_PER_CONNECTION {
            heads.push(
                raw_call(
                    &connection,
                    server.addr,
                    path,
                    lookup("big").encode_to_vec(),
                )
                .await,
            );
        }
        // The answers are kept, unread: dropping one would cancel its stream.
        let mut unread = Vec::new();
        for head in heads {
            let response = head.await.expect("a response head");
            match response
                .headers()
                .get("grpc-status")
                .map(|v| v.as_bytes().to_vec())
            {
                // Trailers-only: refused at once (8 = RESOURCE_EXHAUSTED).
                Some(code) => {
                    assert_eq!(code, b"8", "{response:?}");
                    refused += 1;
                }
                // A body is coming: the server holds this response for us.
                None => held += 1,
            }
            unread.push(response);
        }
        attackers.push((connection, driver, unread, held - held_before));
    }
    assert!(held >= 1, "some responses are held");
    assert!(
        held <= 8 + ATTACK_CONNECTIONS,
        "at most the budget's worth of 1 MiB responses is held (plus one in line per connection): {held}"
    );
    assert_eq!(held + refused, ATTACK_CONNECTIONS * LOOKUPS_PER_CONNECTION);

    // Other clients keep being served during the attack.
    for n in 0..10 {
        claim(&mut honest, try_start(&format!("during-{n}"))).await;
    }
    let grown_mib = server.peak_rss_kib().saturating_sub(baseline_kib) / 1024;

    // The send timeout gives the attackers' responses up: the connections that held any are
    // closed. (One whose calls were all refused holds nothing, and stays until it idles out.)
    for (_connection, driver, _unread, _) in attackers.into_iter().filter(|a| a.3 > 0) {
        let _ = tokio::time::timeout(Duration::from_secs(10), driver)
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "the server closed the attacking connection: {}",
                    server.output()
                )
            });
    }
    let closed_after = attack_started.elapsed();
    assert!(
        closed_after >= Duration::from_millis(1950),
        "closed after {closed_after:?}, before the 2 s send timeout"
    );

    // With the attackers gone, the big answer is served again.
    let again = honest
        .lookup(lookup("big"))
        .await
        .expect("Lookup")
        .into_inner();
    assert!(matches!(
        again.state,
        Some(idempotency_coordinator::proto::idempotency::v1::lookup_response::State::Completed(ref c)) if c.response.len() == RESPONSE_BYTES
    ));
    assert!(
        grown_mib < 48,
        "the server's peak memory grew by {grown_mib} MiB under an attack that would pin {} MiB",
        ATTACK_CONNECTIONS * LOOKUPS_PER_CONNECTION
    );
    println!(
        "slow reader: {held} responses held, {refused} refused, peak RSS +{grown_mib} MiB \
         (the Lookups asked for {} MiB), attackers closed after {closed_after:?}",
        ATTACK_CONNECTIONS * LOOKUPS_PER_CONNECTION
    );
}

/// Reads from `socket` until the server closes it, answering how long that took.
async fn time_until_closed(mut socket: tokio::net::TcpStream, limit: Duration) -> Duration {
    use tokio::io::AsyncReadExt;
    let started = tokio::time::Instant::now();
    let mut buffer = [0u8; 1024];
    loop {
        match tokio::time::timeout_at(started + limit, socket.read(&mut buffer)).await {
            Ok(Ok(0) | Err(_)) => return started.elapsed(),
            Ok(Ok(_)) => {} // the server's SETTINGS, PINGs...
            Err(_) => panic!("the server kept the connection open for {limit:?}"),
        }
    }
}

/// A socket that never sends the HTTP/2 preface is closed after the handshake timeout; one
/// that has shaken hands but opens no call is closed after the idle timeout; one with a call
/// open (a health Watch) is not closed for idling.
#[tokio::test]
async fn silent_and_idle_connections_are_closed_busy_ones_are_not() {
    let flags = [
        "--connection-handshake-timeout",
        "1s",
        "--connection-idle-timeout",
        "3s",
    ];
    let (_database, server, _) = serving_binary(&flags).await;

    // A connection that shakes hands and keeps a Watch open.
    let (busy, busy_driver) = raw_connection(server.addr, 65_535).await;
    let watch = health_watch(&busy, server.addr)
        .await
        .expect("the Watch is answered");
    assert!(watch.headers().get("grpc-status").is_none(), "{watch:?}");

    // A silent socket.
    let silent = tokio::net::TcpStream::connect(server.addr)
        .await
        .expect("connect");
    // A socket that sends the preface and its SETTINGS, then nothing.
    let idle = tokio::net::TcpStream::connect(server.addr)
        .await
        .expect("connect");
    let (idle_requests, idle_driver) = {
        let (send, connection) = h2::client::handshake(idle).await.expect("handshake");
        (send, tokio::spawn(connection))
    };

    let silent_closed = time_until_closed(silent, Duration::from_secs(10)).await;
    assert!(
        silent_closed >= Duration::from_millis(900) && silent_closed < Duration::from_secs(3),
        "closed after {silent_closed:?}, expected the 1 s handshake timeout"
    );
    let started = tokio::time::Instant::now();
    let _ = tokio::time::timeout(Duration::from_secs(10), idle_driver)
        .await
        .expect("the idle connection was closed");
    let idle_closed = started.elapsed() + silent_closed;
    assert!(
        idle_closed >= Duration::from_millis(2800),
        "closed after {idle_closed:?}, expected the 3 s idle timeout"
    );
    drop(idle_requests);

    // The connection with a call open outlived the idle timeout.
    assert!(
        !busy_driver.is_finished(),
        "a connection with an open call was closed"
    );
    drop(watch);
    drop(busy);
}

/// With `--max-connections 2`, a third connection is not served while two are open, and is
/// served as soon as one closes.
#[tokio::test]
async fn the_connection_cap_holds_new_connections_until_one_closes() {
    let database = TestDatabase::create(Backend::Postgres).await;
    let server = ServerProcess::start(&database.url, &["--max-connections", "2"]).await;
    // The first connection: the client used to wait for SERVING, kept open.
    let serving = health_client(server.endpoint()).await.expect("connect");
    eventually(Duration::from_secs(20), "the binary serves", || {
        is_serving(&serving)
    })
    .await;
    let (second, second_driver) = raw_connection(server.addr, 65_535).await;

    let mut third = tokio::spawn({
        let endpoint = server.endpoint();
        async move {
            let health = health_client(endpoint).await.expect("connect");
            is_serving(&health).await
        }
    });
    assert!(
        tokio::time::timeout(Duration::from_secs(1), &mut third)
            .await
            .is_err(),
        "a third connection was served while two were open"
    );
    drop(second);
    second_driver.abort();
    let served = tokio::time::timeout(Duration::from_secs(10), third)
        .await
        .expect("served once a connection closed")
        .expect("the third client");
    assert!(served);
}

/// Health is open to callers without a token, so its Watch streams are bounded: beyond
/// `--max-health-watchers`, a Watch is refused RESOURCE_EXHAUSTED, and a slot frees when a
/// watcher leaves.
#[tokio::test]
async fn health_watch_streams_are_bounded() {
    let (_database, server, _) = serving_binary(&["--max-health-watchers", "3"]).await;
    let (connection, _driver) = raw_connection(server.addr, 65_535).await;
    let watch = || async {
        health_watch(&connection, server.addr)
            .await
            .expect("a response head")
    };
    let refused = |response: &tonic::codegen::http::Response<h2::RecvStream>| {
        response
            .headers()
            .get("grpc-status")
            .map(|code| code.as_bytes().to_vec())
            == Some(b"8".to_vec())
    };

    let mut watchers = Vec::new();
    for _ in 0..3 {
        let response = watch().await;
        assert!(
            response.headers().get("grpc-status").is_none(),
            "{response:?}"
        );
        watchers.push(response);
    }
    let fourth = watch().await;
    assert!(refused(&fourth), "{fourth:?}");

    // One watcher leaves (its stream is reset); its slot is given to the next.
    drop(watchers.pop());
    // Admitted Watches are kept open: dropping one would free its slot again.
    let started = tokio::time::Instant::now();
    let admitted = loop {
        let response = watch().await;
        if !refused(&response) {
            break response;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "no slot was freed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(admitted.headers().get("grpc-status").is_none());
    let full_again = watch().await;
    assert!(refused(&full_again), "{full_again:?}");
}

/// A connection that floods PINGs without opening a call is cut off at the idle timeout, even
/// though it never stops sending (h2 answers every PING and has no limit of its own).
#[tokio::test]
async fn a_ping_flood_without_calls_is_cut_off_at_the_idle_timeout() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let (_database, server, _) = serving_binary(&["--connection-idle-timeout", "2s"]).await;

    let socket = tokio::net::TcpStream::connect(server.addr)
        .await
        .expect("connect");
    let (mut reading, mut writing) = socket.into_split();
    // The server's SETTINGS and PONGs are read and thrown away, so that its writes never
    // block; reading ends when the server closes the connection.
    let drained = tokio::spawn(async move {
        let mut buffer = vec![0u8; 64 * 1024];
        while matches!(reading.read(&mut buffer).await, Ok(n) if n > 0) {}
    });
    let started = tokio::time::Instant::now();
    let mut opening = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    opening.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]); // SETTINGS, empty
    opening.extend_from_slice(&[0, 0, 0, 4, 1, 0, 0, 0, 0]); // SETTINGS ACK
    writing.write_all(&opening).await.expect("preface");
    // PING frames (length 8, type 6, stream 0), 64 at a time, until the server hangs up.
    let ping: Vec<u8> = [0, 0, 8, 6, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8].to_vec();
    let burst = ping.repeat(64);
    let mut pings = 0u64;
    let flooding = async {
        while writing.write_all(&burst).await.is_ok() {
            pings += 64;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), flooding)
        .await
        .expect("the server cut the flood off");
    let cut_after = started.elapsed();
    tokio::time::timeout(Duration::from_secs(5), drained)
        .await
        .expect("the connection is closed")
        .expect("the reader");
    assert!(
        cut_after >= Duration::from_millis(1900),
        "cut off after {cut_after:?}, before the 2 s idle timeout"
    );
    println!("PING flood: {pings} PINGs sent, cut off after {cut_after:?}");
}
