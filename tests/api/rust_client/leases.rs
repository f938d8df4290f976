//! The lease while the work runs: the heartbeat keeps a long work the only holder, and a lease
//! lost anyway cancels the work and leaves the new holder's result standing.

use std::time::Duration;

use idempotency_client::{Error, Outcome, RunError};
use idempotency_coordinator::proto::idempotency::v1::lookup_response::State;

use super::{PAYMENTS, PaymentError, Runs, app_and_clients, client_for, payments_state};
use crate::support::*;

async fn work_three_times_longer_than_its_lease_stays_the_only_holder(backend: Backend) {
    const LEASE: Duration = Duration::from_millis(600);
    let app = TestApp::spawn(backend).await;
    let client = client_for(&app).await;
    let key = unique_key("report");
    let runs = Runs::default();

    let outcome = client
        .run_once(PAYMENTS, &key)
        .lease_ttl(LEASE)
        .run(|lease| {
            let (client, key, runs) = (client.clone(), key.clone(), runs.clone());
            async move {
                runs.record();
                let started = tokio::time::Instant::now();
                let mut competitors = 0;
                // The work's own length (three leases), with a competitor trying the key once
                // every lease: each must find it held by this caller.
                while started.elapsed() < 3 * LEASE {
                    tokio::time::sleep(LEASE).await;
                    let competitor = client
                        .run_once(PAYMENTS, &key)
                        .run(|_lease| async { Ok::<_, PaymentError>(0) })
                        .await;
                    assert!(
                        matches!(
                            competitor,
                            Err(RunError::Coordinator(Error::InProgress { attempt: 1, .. }))
                        ),
                        "the key is still held after {:?}: {competitor:?}",
                        started.elapsed()
                    );
                    competitors += 1;
                }
                assert!(!lease.is_cancelled());
                Ok::<_, PaymentError>((lease.token(), competitors))
            }
        })
        .await
        .expect("the long work completes");

    let Outcome {
        value: (token, competitors),
        replayed,
    } = outcome;
    assert!(!replayed);
    assert_eq!(competitors, 3);
    assert_eq!(runs.count(), 1);
    assert_eq!(
        app.database.key_lease_token(&key).await,
        token,
        "never taken over"
    );
    let raw = app.client().await;
    let stored = stored_response(&raw, &key).await;
    assert_eq!(stored, format!("[{token},3]").into_bytes());
}

/// The response stored for `key` in the payments namespace, which must be completed.
async fn stored_response(raw: &Client, key: &str) -> Vec<u8> {
    match payments_state(raw, key).await {
        State::Completed(stored) => stored.response,
        other => panic!("expected completed, got {other:?}"),
    }
}

async fn a_lost_lease_cancels_the_work_and_the_new_holders_result_stands(backend: Backend) {
    const LEASE: Duration = Duration::from_millis(300);
    let (app, client, raw) = app_and_clients(backend).await;
    let key = unique_key("export");
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let (cancelled_tx, cancelled_rx) = tokio::sync::oneshot::channel();

    // The first holder saves a checkpoint, then stalls: its heartbeat is put off well past its
    // lease (as if the process were paused), so the key can be taken over under it.
    let first = {
        let (client, key) = (client.clone(), key.clone());
        tokio::spawn(async move {
            client
                .run_once(PAYMENTS, key)
                .lease_ttl(LEASE)
                .heartbeat_interval(Duration::from_secs(3))
                .run(|lease| async move {
                    lease
                        .save_checkpoint(b"step-1".to_vec())
                        .await
                        .expect("checkpoint");
                    started_tx.send(()).expect("the test listens");
                    tokio::select! {
                        () = lease.cancelled() => {
                            cancelled_tx.send(()).expect("the test listens");
                        }
                        () = tokio::time::sleep(Duration::from_secs(60)) => {}
                    }
                    Ok::<_, PaymentError>("first".to_owned())
                })
                .await
        })
    };
    started_rx.await.expect("the first work started");
    let expires = match payments_state(&raw, &key).await {
        State::InProgress(held) => instant(&held.lease_expires_at),
        other => panic!("expected in_progress, got {other:?}"),
    };
    wait_for_db_clock_past(&app, expires, "the first lease ran out").await;

    let second = client
        .run_once(PAYMENTS, &key)
        .lease_ttl(Duration::from_secs(30))
        .run(|lease| async move {
            assert_eq!(lease.attempt(), 2, "a takeover");
            assert_eq!(
                lease.checkpoint(),
                Some(&b"step-1"[..]),
                "the checkpoint handed over"
            );
            Ok::<_, PaymentError>("second".to_owned())
        })
        .await
        .expect("the second caller takes over and completes");
    assert_eq!(
        second,
        Outcome {
            value: "second".to_owned(),
            replayed: false
        }
    );

    cancelled_rx
        .await
        .expect("the first work's cancellation fired");
    let first = first.await.expect("task");
    assert!(
        matches!(first, Err(RunError::Coordinator(Error::LeaseLost(_)))),
        "the first caller learns it lost the key: {first:?}"
    );
    assert_eq!(stored_response(&raw, &key).await, br#""second""#);
    let replay = client
        .run_once(PAYMENTS, &key)
        .run(|_lease| async { Ok::<_, PaymentError>("third".to_owned()) })
        .await
        .expect("replayed");
    assert_eq!(
        replay,
        Outcome {
            value: "second".to_owned(),
            replayed: true
        }
    );
}

async fn a_service_unreachable_until_the_lease_runs_out_cancels_the_work(backend: Backend) {
    const LEASE: Duration = Duration::from_millis(600);
    let app = TestApp::spawn(backend).await;
    let proxy = crate::support::proxy::TcpProxy::start(app.addr).await;
    let client = idempotency_client::Client::builder(format!("http://{}", proxy.addr))
        .build()
        .await
        .expect("connect through the proxy");
    let raw = app.client().await;
    let key = unique_key("export");
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();

    let running = {
        let (client, key) = (client.clone(), key.clone());
        tokio::spawn(async move {
            client
                .run_once(PAYMENTS, key)
                .lease_ttl(LEASE)
                .run(|lease| async move {
                    started_tx.send(()).expect("the test listens");
                    tokio::select! {
                        () = lease.cancelled() => Ok::<_, PaymentError>("stopped".to_owned()),
                        () = tokio::time::sleep(Duration::from_secs(60)) => Ok("finished".to_owned()),
                    }
                })
                .await
        })
    };
    started_rx.await.expect("the work started");
    proxy.cut();

    // The heartbeat cannot reach the service; once the lease may have run out, someone else may
    // hold the key, so the work is cancelled and nothing is reported as done.
    let outcome = tokio::time::timeout(Duration::from_secs(20), running)
        .await
        .expect("the work is cancelled, not left running")
        .expect("task");
    let Err(RunError::Coordinator(Error::LeaseLost(cause))) = outcome else {
        panic!("expected LeaseLost, got {outcome:?}");
    };
    assert_eq!(cause.code, tonic::Code::Unavailable, "{cause:?}");
    let stored = payments_state(&raw, &key).await;
    assert!(
        matches!(stored, State::InProgress(_)),
        "never completed: {stored:?}"
    );
}

for_each_backend!(
    work_three_times_longer_than_its_lease_stays_the_only_holder,
    a_service_unreachable_until_the_lease_runs_out_cancels_the_work,
    a_lost_lease_cancels_the_work_and_the_new_holders_result_stands,
);
