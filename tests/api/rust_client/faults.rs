//! The faults the client absorbs: a TryStart whose answer is lost (the retry, with the same
//! `attempt_id`, gets the same claim back), and a server that is down while TryStart is tried.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use idempotency_client::Client;
use idempotency_coordinator::proto::idempotency::v1::lookup_response::State;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use super::{PAYMENTS, PaymentError, Runs, client_retrying_for, payments_state};
use crate::support::process::ServerProcess;
use crate::support::*;

/// A TCP proxy between a client and the service that can swallow everything the service sends
/// back (the request arrives and is answered; the answer never does), then drop its
/// connections, as a network that failed mid-call would.
struct AnswerEater {
    addr: SocketAddr,
    swallow: Arc<AtomicBool>,
    swallowed: Arc<AtomicUsize>,
    generation: watch::Sender<u64>,
}

impl AnswerEater {
    async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("address");
        let swallow = Arc::new(AtomicBool::new(false));
        let swallowed = Arc::new(AtomicUsize::new(0));
        let (generation, _) = watch::channel(0);
        let (s, n, g) = (swallow.clone(), swallowed.clone(), generation.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(upstream).await else {
                    continue;
                };
                tokio::spawn(forward(client, server, s.clone(), n.clone(), g.subscribe()));
            }
        });
        Self {
            addr,
            swallow,
            swallowed,
            generation,
        }
    }

    fn swallow_answers(&self) {
        self.swallow.store(true, Ordering::SeqCst);
    }

    fn swallowed(&self) -> usize {
        self.swallowed.load(Ordering::SeqCst)
    }

    /// Passes answers again, and drops every connection open now.
    fn drop_connections(&self) {
        self.swallow.store(false, Ordering::SeqCst);
        self.generation.send_modify(|generation| *generation += 1);
    }
}

async fn forward(
    client: TcpStream,
    server: TcpStream,
    swallow: Arc<AtomicBool>,
    swallowed: Arc<AtomicUsize>,
    mut dropped: watch::Receiver<u64>,
) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let requests = tokio::io::copy(&mut client_read, &mut server_write);
    let answers = async {
        let mut buffer = vec![0; 16 * 1024];
        loop {
            let read = server_read.read(&mut buffer).await?;
            if read == 0 {
                return Ok::<_, std::io::Error>(());
            }
            if swallow.load(Ordering::SeqCst) {
                swallowed.fetch_add(read, Ordering::SeqCst);
            } else {
                client_write.write_all(&buffer[..read]).await?;
            }
        }
    };
    tokio::select! {
        _ = requests => {}
        _ = answers => {}
        _ = dropped.changed() => {}
    }
}

async fn a_lost_try_start_answer_is_retried_with_the_same_attempt_and_claims_once(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    let raw = app.client().await;
    let eater = AnswerEater::start(app.addr).await;
    let client = Client::builder(format!("http://{}", eater.addr))
        .build()
        .await
        .expect("connect through the proxy");
    // One call through the proxy, so that the connection is up and idle before answers are
    // swallowed.
    client
        .mark_processed("warm-up", ["connection"])
        .send()
        .await
        .expect("a call through the proxy");
    let key = unique_key("charge");
    let runs = Runs::default();

    eater.swallow_answers();
    let running = {
        let (client, key, runs) = (client.clone(), key.clone(), runs.clone());
        tokio::spawn(async move {
            client
                .run_once(PAYMENTS, key)
                .request(&"order-1")
                .run(|lease| async move {
                    runs.record();
                    Ok::<_, PaymentError>((lease.token(), lease.attempt()))
                })
                .await
        })
    };
    // The claim is made and its answer is on the way back, and lost.
    eventually(
        Duration::from_secs(10),
        "TryStart claimed the key",
        || async { matches!(payments_state(&raw, &key).await, State::InProgress(_)) },
    )
    .await;
    eventually(
        Duration::from_secs(10),
        "the answer was swallowed",
        || async { eater.swallowed() > 0 },
    )
    .await;
    let claimed_token = app.database.key_lease_token(&key).await;
    assert_eq!(runs.count(), 0, "the client never saw its claim");
    eater.drop_connections();

    // Another attempt_id would now get `in_progress` (the lease runs 30 s) and, without a
    // wait, fail; the same one gets the claim back.
    let outcome = running
        .await
        .expect("task")
        .expect("the retried TryStart gets the claim back");
    assert!(!outcome.replayed);
    assert_eq!(
        outcome.value,
        (claimed_token, 1),
        "the same claim, not a takeover"
    );
    assert_eq!(runs.count(), 1);
    assert!(matches!(
        payments_state(&raw, &key).await,
        State::Completed(_)
    ));
    assert_eq!(
        app.count_rows("idempotency_keys").await,
        1,
        "exactly one claim"
    );
}

async fn a_server_restarted_during_try_start_is_retried_and_the_work_runs_once(backend: Backend) {
    let database = TestDatabase::create(backend).await;
    let mut first = ServerProcess::start(&database.url, &[]).await;
    first.wait_until_serving().await.expect("serving");
    let addr = first.addr;
    let client = client_retrying_for(first.endpoint(), Duration::from_secs(60)).await;
    first.signal("TERM");
    assert_eq!(
        first.wait(Duration::from_secs(30)).await,
        Some(0),
        "the server stops"
    );

    // While it is down, the port answers nothing but closed connections: a stand-in that lets
    // the test see the client try.
    let stand_in = TcpListener::bind(addr)
        .await
        .expect("the port is free again");
    let key = unique_key("charge");
    let runs = Runs::default();
    let running = {
        let (client, key, runs) = (client.clone(), key.clone(), runs.clone());
        tokio::spawn(async move {
            client
                .run_once(PAYMENTS, key)
                .run(|lease| async move {
                    runs.record();
                    Ok::<_, PaymentError>(lease.attempt())
                })
                .await
        })
    };
    let (refused, _) = stand_in
        .accept()
        .await
        .expect("the client tries to connect");
    drop(refused);
    drop(stand_in);

    let port = addr.port().to_string();
    let listen = format!("127.0.0.1:{port}");
    let mut second = ServerProcess::start(&database.url, &["--listen", &listen]).await;
    assert_eq!(second.addr, addr, "restarted on the same port");
    let outcome = running
        .await
        .expect("task")
        .expect("TryStart is retried until the server is back");
    assert!(!outcome.replayed);
    assert_eq!(outcome.value, 1, "one fresh claim");
    assert_eq!(runs.count(), 1);
    assert_eq!(
        database.count_rows("idempotency_keys").await,
        1,
        "exactly one claim"
    );
    assert_eq!(database.completed_keys(PAYMENTS).await.len(), 1);
    second.signal("TERM");
    second.wait(Duration::from_secs(30)).await;
}

for_each_backend!(
    a_lost_try_start_answer_is_retried_with_the_same_attempt_and_claims_once,
    a_server_restarted_during_try_start_is_retried_and_the_work_runs_once,
);
