//! `run_once` and friends on a healthy server: once and only once, replay, release on failure,
//! stored error results, and the typed refusals.

use std::time::Duration;

use idempotency_client::{Error, Outcome, RunError};
use serde::{Deserialize, Serialize};

use super::{PAYMENTS, PaymentError, Runs, TryStarts, app_and_clients, client_for, payments_state};
use crate::support::*;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Charge {
    id: String,
    amount: u64,
}

async fn two_concurrent_callers_run_the_work_once_and_get_the_same_result(backend: Backend) {
    let (app, client, raw) = app_and_clients(backend).await;
    let key = unique_key("charge");
    let runs = Runs::default();
    let try_starts = TryStarts::capture();
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let (finish_tx, finish_rx) = tokio::sync::oneshot::channel::<()>();
    let request = serde_json::json!({"order": "o-1", "amount": 1250});

    let first = {
        let (client, key, runs, request) =
            (client.clone(), key.clone(), runs.clone(), request.clone());
        tokio::spawn(async move {
            client
                .run_once(PAYMENTS, key)
                .request(&request)
                .run(|lease| async move {
                    runs.record();
                    started_tx.send(lease.token()).expect("the test listens");
                    finish_rx.await.expect("the test lets the work finish");
                    Ok::<_, PaymentError>(Charge {
                        id: "ch_1".into(),
                        amount: 1250,
                    })
                })
                .await
        })
    };
    started_rx.await.expect("the first caller's work started");

    // The second caller, with the same request but its own work, finds the key held.
    let second = {
        let (client, key, runs) = (client.clone(), key.clone(), runs.clone());
        tokio::spawn(async move {
            client
                .run_once(PAYMENTS, key)
                .request(&serde_json::json!({"amount": 1250, "order": "o-1"}))
                .wait(Duration::from_secs(20))
                .run(|_lease| async move {
                    runs.record();
                    Ok::<_, PaymentError>(Charge {
                        id: "ch_2".into(),
                        amount: 1250,
                    })
                })
                .await
        })
    };
    // The second caller's TryStart waits on the service for the holder.
    app.wait_for_waiters(1).await;
    assert!(matches!(
        payments_state(&raw, &key).await,
        pb_state::InProgress(_)
    ));
    finish_tx.send(()).expect("the work waits");
    let finished_at = std::time::Instant::now();

    let first = first
        .await
        .expect("task")
        .expect("the first caller succeeds");
    let second = second
        .await
        .expect("task")
        .expect("the second caller succeeds");
    // Woken by the holder's Complete, not by a poll or the end of its 20 s wait.
    assert!(
        finished_at.elapsed() < Duration::from_secs(5),
        "answered {:?} after the holder finished",
        finished_at.elapsed()
    );
    assert_eq!(
        try_starts.count(),
        2,
        "one TryStart for each caller: the second waited on the service instead of polling"
    );
    let charge = Charge {
        id: "ch_1".into(),
        amount: 1250,
    };
    assert_eq!(
        first,
        Outcome {
            value: charge.clone(),
            replayed: false
        }
    );
    assert_eq!(
        second,
        Outcome {
            value: charge,
            replayed: true
        }
    );
    assert_eq!(runs.count(), 1, "the work ran once");
}

async fn failed_work_is_released_and_the_next_call_runs_it_again(backend: Backend) {
    let (_app, client, raw) = app_and_clients(backend).await;
    let key = unique_key("charge");
    let runs = Runs::default();

    let failed = client
        .run_once(PAYMENTS, &key)
        .request(&"order-7")
        .run(|_lease| async {
            runs.record();
            Err::<Charge, _>(PaymentError::ProviderDown)
        })
        .await;
    assert!(
        matches!(failed, Err(RunError::Work(PaymentError::ProviderDown))),
        "the work's own error comes back: {failed:?}"
    );
    assert!(
        matches!(payments_state(&raw, &key).await, pb_state::Absent(_)),
        "the claim was released"
    );

    let counter = &runs;
    let retried = client
        .run_once(PAYMENTS, &key)
        .request(&"order-7")
        .run(|lease| async move {
            counter.record();
            assert_eq!(lease.attempt(), 1, "a fresh claim, not a takeover");
            Ok::<_, PaymentError>(Charge {
                id: "ch_7".into(),
                amount: 700,
            })
        })
        .await
        .expect("the retry succeeds");
    assert_eq!(retried.value.id, "ch_7");
    assert!(!retried.replayed);
    assert_eq!(runs.count(), 2, "the work ran again after the release");
}

async fn a_caller_that_gives_up_mid_work_releases_the_key(backend: Backend) {
    let (_app, client, raw) = app_and_clients(backend).await;
    let key = unique_key("charge");
    let (started_tx, started_rx) = tokio::sync::oneshot::channel();
    let abandoned = {
        let (client, key) = (client.clone(), key.clone());
        tokio::spawn(async move {
            client
                .run_once(PAYMENTS, key)
                .run(|_lease| async move {
                    started_tx.send(()).expect("the test listens");
                    std::future::pending::<Result<(), PaymentError>>().await
                })
                .await
        })
    };
    started_rx.await.expect("the work started");
    abandoned.abort();
    // Released in the background, long before its 30 s lease would run out.
    eventually(Duration::from_secs(10), "the claim is released", || async {
        matches!(payments_state(&raw, &key).await, pb_state::Absent(_))
    })
    .await;
    let retried = client
        .run_once(PAYMENTS, &key)
        .run(|lease| async move { Ok::<_, PaymentError>(lease.attempt()) })
        .await
        .expect("a retry starts fresh");
    assert_eq!(
        retried,
        Outcome {
            value: 1,
            replayed: false
        }
    );
}

async fn an_error_mapped_to_a_result_is_stored_and_replayed(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let client = client_for(&app).await;
    let key = unique_key("charge");
    let runs = Runs::default();
    let declined = |error: &PaymentError| match error {
        PaymentError::Declined => Some("declined".to_owned()),
        PaymentError::ProviderDown => None,
    };

    let first = client
        .run_once(PAYMENTS, &key)
        .error_result(declined)
        .run(|_lease| async {
            runs.record();
            Err::<String, _>(PaymentError::Declined)
        })
        .await
        .expect("a final error is a result");
    assert_eq!(
        first,
        Outcome {
            value: "declined".to_owned(),
            replayed: false
        }
    );

    let second = client
        .run_once(PAYMENTS, &key)
        .error_result(declined)
        .run(|_lease| async {
            runs.record();
            Ok::<_, PaymentError>("charged".to_owned())
        })
        .await
        .expect("replayed");
    assert_eq!(
        second,
        Outcome {
            value: "declined".to_owned(),
            replayed: true
        }
    );
    assert_eq!(runs.count(), 1);
}

async fn a_key_reused_for_another_request_is_a_typed_mismatch(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let client = client_for(&app).await;
    let key = unique_key("charge");
    client
        .run_once(PAYMENTS, &key)
        .request(&serde_json::json!({"amount": 100}))
        .run(|_lease| async { Ok::<_, PaymentError>(1) })
        .await
        .expect("the first request completes");

    let runs = Runs::default();
    let other = client
        .run_once(PAYMENTS, &key)
        .request(&serde_json::json!({"amount": 200}))
        .run(|_lease| async {
            runs.record();
            Ok::<_, PaymentError>(2)
        })
        .await;
    assert!(
        matches!(
            other,
            Err(RunError::Coordinator(Error::FingerprintMismatch))
        ),
        "{other:?}"
    );
    assert_eq!(runs.count(), 0);
}

/// Claims `key` in the payments namespace with the generated client, as another caller of the
/// same (fingerprint-less) request would, for 30 s; answers the claim.
async fn hold_elsewhere(
    raw: &mut crate::support::Client,
    key: &str,
) -> idempotency_coordinator::proto::idempotency::v1::ClaimStarted {
    let mut request = try_start(key).with_fingerprint(b"").with_lease(secs(30));
    request.namespace = PAYMENTS.into();
    claim(raw, request).await
}

/// Runs a work on `key` that may wait 1.5 s for the key's holder; answers how the run ended and
/// how long it took.
async fn run_waiting_for_the_holder(
    client: &idempotency_client::Client,
    key: &str,
) -> (Result<Outcome<()>, RunError<PaymentError>>, Duration) {
    let asked_at = std::time::Instant::now();
    let ended = client
        .run_once(PAYMENTS, key)
        .wait(Duration::from_millis(1500))
        .run(|_lease| async { Ok::<_, PaymentError>(()) })
        .await;
    (ended, asked_at.elapsed())
}

async fn a_key_held_elsewhere_is_a_typed_in_progress_with_when_to_retry(backend: Backend) {
    let (_app, client, mut raw) = app_and_clients(backend).await;
    let key = unique_key("charge");
    let held = hold_elsewhere(&mut raw, &key).await;
    let try_starts = TryStarts::capture();

    let (busy, waited) = run_waiting_for_the_holder(&client, &key).await;
    let Err(RunError::Coordinator(Error::InProgress {
        attempt,
        retry_after,
        lease_expires_at,
    })) = busy
    else {
        panic!("expected InProgress, got {busy:?}");
    };
    assert_eq!(attempt, held.attempt);
    assert_eq!(
        lease_expires_at,
        std::time::SystemTime::try_from(held.lease_expires_at.expect("expiry")).expect("instant")
    );
    assert!(
        retry_after > Duration::from_secs(20) && retry_after <= Duration::from_secs(30),
        "retry after the holder's lease: {retry_after:?}"
    );
    // The service held the one TryStart for the caller's whole limit, and answered before it.
    assert!(
        waited >= Duration::from_millis(1200) && waited < Duration::from_secs(4),
        "gave up after {waited:?}"
    );
    assert_eq!(try_starts.count(), 1, "one TryStart, held by the service");
}

async fn a_service_at_its_waiter_limit_is_asked_again_after_pauses_not_hammered(backend: Backend) {
    // With no waiter slots, every TryStart is answered at once, as without `wait`.
    let app = TestApp::spawn_with(backend, &["--max-waiters", "0"]).await;
    let client = client_for(&app).await;
    let mut raw = app.client().await;
    let key = unique_key("charge");
    hold_elsewhere(&mut raw, &key).await;
    let try_starts = TryStarts::capture();

    let (busy, waited) = run_waiting_for_the_holder(&client, &key).await;
    assert!(
        matches!(busy, Err(RunError::Coordinator(Error::InProgress { .. }))),
        "{busy:?}"
    );
    assert!(
        waited >= Duration::from_millis(1400),
        "gave up after {waited:?}"
    );
    // Asked again while the limit lasted, but after pauses (50 ms growing to 1 s): a handful of
    // TryStarts, not one per round trip.
    let sent = try_starts.count();
    assert!((3..=20).contains(&sent), "{sent} TryStarts in {waited:?}");
}

async fn bad_input_is_a_typed_invalid_argument_naming_the_field(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let client = client_for(&app).await;
    let runs = Runs::default();

    let refused = client
        .run_once("pay ments", unique_key("charge"))
        .lease_ttl(Duration::from_millis(10))
        .run(|_lease| async {
            runs.record();
            Ok::<_, PaymentError>(())
        })
        .await;
    let Err(RunError::Coordinator(error @ Error::InvalidArgument(_))) = refused else {
        panic!("expected InvalidArgument, got {refused:?}");
    };
    assert_eq!(error.fields(), ["namespace", "lease_ttl"]);
    assert_eq!(runs.count(), 0);

    let empty = client
        .mark_processed("billing", Vec::<String>::new())
        .send()
        .await;
    let Err(error @ Error::InvalidArgument(_)) = empty else {
        panic!("expected InvalidArgument, got {empty:?}");
    };
    assert_eq!(error.fields(), ["event_ids"]);
    assert_eq!(app.total_rows().await, 0, "nothing was written");
}

async fn mark_processed_answers_the_new_ids_and_process_once_runs_an_event_once(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let client = client_for(&app).await;

    let new = client
        .mark_processed("billing", ["evt-1", "evt-2", "evt-1"])
        .send()
        .await
        .expect("marked");
    assert_eq!(new, ["evt-1", "evt-2"]);
    let again = client
        .mark_processed("billing", ["evt-2", "evt-3"])
        .retention(Duration::from_secs(60))
        .send()
        .await
        .expect("marked");
    assert_eq!(again, ["evt-3"]);

    let runs = Runs::default();
    for expected_replay in [false, true] {
        let counter = &runs;
        let handled = client
            .process_once("billing", "evt-9")
            .run(|lease| async move {
                counter.record();
                assert_eq!(lease.namespace(), "billing");
                Ok::<_, PaymentError>(format!("handled {}", lease.key()))
            })
            .await
            .expect("handled");
        assert_eq!(
            handled,
            Outcome {
                value: "handled evt-9".to_owned(),
                replayed: expected_replay
            }
        );
    }
    assert_eq!(runs.count(), 1);
}

use idempotency_coordinator::proto::idempotency::v1::lookup_response::State as pb_state;

for_each_backend!(
    two_concurrent_callers_run_the_work_once_and_get_the_same_result,
    failed_work_is_released_and_the_next_call_runs_it_again,
    a_caller_that_gives_up_mid_work_releases_the_key,
    an_error_mapped_to_a_result_is_stored_and_replayed,
    a_key_reused_for_another_request_is_a_typed_mismatch,
    a_key_held_elsewhere_is_a_typed_in_progress_with_when_to_retry,
    a_service_at_its_waiter_limit_is_asked_again_after_pauses_not_hammered,
    bad_input_is_a_typed_invalid_argument_naming_the_field,
    mark_processed_answers_the_new_ids_and_process_once_runs_an_event_once,
);
