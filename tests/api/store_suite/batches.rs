//! The batch methods (one statement or one transaction per round), MarkProcessed, and reaping,
//! on the trait.

use idempotency_coordinator::domain::batch::Round;
use idempotency_coordinator::domain::{Rejection, TryStartOutcome};
use idempotency_coordinator::store::Store;
use idempotency_testkit::TestDatabase;

use super::*;

async fn a_round_of_claims_answers_each_and_draws_distinct_tokens<S: Store>(
    store: S,
    _: &TestDatabase,
) {
    started_alone(&store, "held").await;
    let round = Round::new(vec![
        claim("a"),
        claim("held"),
        with_fingerprint(claim("b"), b"f2"),
    ])
    .expect("distinct keys");
    let answers: Vec<TryStartOutcome> = store
        .try_start_batch(&round)
        .await
        .into_iter()
        .map(|answer| answer.expect("answered"))
        .collect();
    let (
        TryStartOutcome::Started(a),
        TryStartOutcome::InProgress { attempt: 1, .. },
        TryStartOutcome::Started(b),
    ) = (&answers[0], &answers[1], &answers[2])
    else {
        panic!("unexpected answers: {answers:?}");
    };
    assert_ne!(a.lease_token, b.lease_token);
}

async fn started_alone<S: Store>(store: &S, name: &str) {
    assert!(matches!(
        store.try_start(&claim(name)).await.expect("claim"),
        TryStartOutcome::Started(_)
    ));
}

async fn a_round_of_completes_answers_each_as_if_alone<S: Store>(store: S, _: &TestDatabase) {
    let mut tokens = Vec::new();
    for name in ["a", "b"] {
        match store.try_start(&claim(name)).await.expect("claim") {
            TryStartOutcome::Started(claim) => tokens.push(claim.lease_token),
            other => panic!("{other:?}"),
        }
    }
    let round = Round::new(vec![
        complete("a", tokens[0], b"ra"),
        complete("b", token(tokens[1].get() + 1000), b"rb"),
        complete("never", tokens[0], b"rn"),
    ])
    .expect("distinct keys");
    let verdicts: Vec<Result<(), Rejection>> = store
        .complete_batch(&round)
        .await
        .into_iter()
        .map(|answer| answer.expect("answered").map(drop))
        .collect();
    assert_eq!(
        verdicts,
        vec![
            Ok(()),
            Err(Rejection::LeaseLost),
            Err(Rejection::KeyNotFound)
        ]
    );
}

async fn marks_report_new_ids_once_in_call_order<S: Store>(store: S, _: &TestDatabase) {
    let first = store
        .mark_processed(&mark("billing", &["e1", "e2", "e1"]))
        .await
        .expect("marked");
    let seen: Vec<(&str, bool)> = first
        .iter()
        .map(|e| (e.event_id.as_str(), e.already_processed))
        .collect();
    assert_eq!(seen, vec![("e1", false), ("e2", false), ("e1", true)]);
    assert_eq!(first[2].processed_at, first[0].processed_at);

    let round = Round::new(vec![
        mark("billing", &["e2", "e3"]),
        mark("shipping", &["e2"]),
    ])
    .expect("marks never conflict");
    let answers: Vec<Vec<bool>> = store
        .mark_processed_batch(&round)
        .await
        .into_iter()
        .map(|answer| {
            answer
                .expect("marked")
                .into_iter()
                .map(|e| e.already_processed)
                .collect()
        })
        .collect();
    assert_eq!(answers, vec![vec![true, false], vec![false]]);
}

async fn reaping_deletes_expired_rows_in_bounded_batches<S: Store>(
    store: S,
    database: &TestDatabase,
) {
    database.insert_expired_keys("old", 5).await;
    database.insert_expired_events(3).await;
    started_alone(&store, "live").await;
    assert_eq!(store.reap_expired_keys(2).await.expect("reap"), 2);
    assert_eq!(store.reap_expired_keys(10).await.expect("reap"), 3);
    assert_eq!(store.reap_expired_keys(10).await.expect("reap"), 0);
    assert_eq!(store.reap_expired_events(10).await.expect("reap"), 3);
    assert_eq!(
        database.count_rows("idempotency_keys").await,
        1,
        "the live key stays"
    );
}

store_suite!(
    a_round_of_claims_answers_each_and_draws_distinct_tokens,
    a_round_of_completes_answers_each_as_if_alone,
    marks_report_new_ids_once_in_call_order,
    reaping_deletes_expired_rows_in_bounded_batches,
);
