//! Completes sharing one batch in the store: each answered as if it were alone.

use idempotency_coordinator::domain::batch::{Batchable, Round, rounds};
use idempotency_coordinator::domain::{
    CompleteCommand, Key, LeaseToken, Rejection, ResponseBody, Scope,
};
use idempotency_coordinator::store::Store;

use crate::support::*;

/// Completes sharing one batch, most of them refused for different reasons: each gets the
/// answer it would have got alone, and only the holder's own completion is written.
async fn a_shared_batch_of_completes_answers_each_as_if_alone(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let [open, done, other] = ["open", "done", "other"].map(unique_key);
    let open_claim = claim(&mut client, try_start(&open)).await;
    let done_claim = claim(&mut client, try_start(&done)).await;
    complete_key(&client, &done, done_claim.lease_token, b"first").await;
    let other_claim = claim(&mut client, try_start(&other)).await;

    let command = |key: &str, token: u64, response: &[u8]| CompleteCommand {
        namespace: Scope::parse(NAMESPACE.into()).expect("namespace"),
        key: Key::parse(key.into()).expect("key"),
        lease_token: LeaseToken::parse(token).expect("token"),
        response: ResponseBody::parse(response.to_vec(), 1 << 20).expect("response"),
        retention: None,
    };
    // The coalescer would run the repeated key in a second round: so does the test.
    let commands = vec![
        command(&open, open_claim.lease_token + 1000, b"not mine"),
        command(&done, done_claim.lease_token, b"first"),
        command(&done, done_claim.lease_token, b"second"),
        command("never-claimed", 1, b"none"),
        command(&other, other_claim.lease_token, b"mine"),
    ];
    let mut answers: Vec<_> = (0..commands.len()).map(|_| None).collect();
    for round in rounds(commands, Batchable::conflict_key) {
        let (positions, round): (Vec<usize>, Vec<_>) = round.into_iter().unzip();
        let round = Round::new(round).expect("a round holds each key once");
        for (position, answer) in positions
            .into_iter()
            .zip(app.store.complete_batch(&round).await)
        {
            answers[position] = Some(answer);
        }
    }
    let answers = answers.into_iter().map(|answer| answer.expect("answered"));
    let verdicts: Vec<Result<(), Rejection>> = answers
        .into_iter()
        .map(|answer| answer.expect("the store answered").map(drop))
        .collect();
    assert_eq!(
        verdicts,
        vec![
            Err(Rejection::LeaseLost),
            Ok(()),
            Err(Rejection::AlreadyCompleted),
            Err(Rejection::KeyNotFound),
            Ok(()),
        ]
    );
    assert_eq!(
        app.database.completed_keys(NAMESPACE).await,
        [done, other].into_iter().collect(),
        "the key held by another token stays open"
    );
}

for_each_backend!(a_shared_batch_of_completes_answers_each_as_if_alone,);
