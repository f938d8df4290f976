use idempotency_coordinator::proto::idempotency::v1::TryStartRequest;
use idempotency_coordinator::proto::idempotency::v1::lookup_response::State;

use crate::support::*;

async fn lookup_reports_all_three_states_without_changing_them(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let mut client = app.client().await;
    let key = unique_key("lookup");

    assert!(matches!(key_state(&client, &key).await, State::Absent(_)));
    assert_eq!(
        app.total_rows().await,
        0,
        "Lookup of an absent key creates nothing"
    );

    let started = claim(
        &mut client,
        TryStartRequest {
            lease_ttl: secs(10),
            ..try_start(&key)
        },
    )
    .await;
    for _ in 0..2 {
        match key_state(&client, &key).await {
            State::InProgress(held) => {
                assert_eq!(held.lease_expires_at, started.lease_expires_at);
                assert_eq!(held.attempt, 1);
                assert_eq!(held.fingerprint, FINGERPRINT);
            }
            other => panic!("expected in_progress, got {other:?}"),
        }
    }

    let completion = client
        .complete(complete(&key, started.lease_token, b"result"))
        .await
        .expect("Complete")
        .into_inner();
    match key_state(&client, &key).await {
        State::Completed(done) => {
            assert_eq!(done.response, b"result");
            assert_eq!(done.fingerprint, FINGERPRINT);
            assert_eq!(done.completed_at, completion.completed_at);
            assert_eq!(done.expires_at, completion.expires_at);
        }
        other => panic!("expected completed, got {other:?}"),
    }
}

for_each_backend!(lookup_reports_all_three_states_without_changing_them,);
