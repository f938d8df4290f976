//! Complete, Release, ExtendLease and Lookup on the trait: the guarded writes and which
//! refusal wins.

use std::time::Duration;

use idempotency_coordinator::domain::{KeyState, LeaseToken, Rejection, TryStartOutcome};
use idempotency_coordinator::store::Store;
use idempotency_testkit::TestDatabase;

use super::*;

async fn token_of<S: Store>(store: &S, name: &str) -> LeaseToken {
    claimed(store, claim(name)).await.lease_token
}

async fn a_completed_key_is_replayed_and_looked_up_with_its_response<S: Store>(
    store: S,
    _: &TestDatabase,
) {
    let held = token_of(&store, "k").await;
    let completion = completed(&store, complete("k", held, b"answer")).await;
    assert_eq!(
        store.try_start(&claim("k")).await.expect("replay"),
        TryStartOutcome::Completed {
            response: b"answer".to_vec(),
            completion: completion.clone()
        }
    );
    assert_eq!(
        store.lookup(&lookup("k")).await.expect("lookup"),
        KeyState::Completed {
            response: b"answer".to_vec(),
            fingerprint: b"f1".to_vec(),
            completion: completion.clone()
        }
    );
    assert_eq!(
        complete_answer(&store, "k", held, b"answer").await,
        Ok(completion),
        "the same completion again, with the same timestamps"
    );
    assert_eq!(
        complete_answer(&store, "k", held, b"another").await,
        Err(Rejection::AlreadyCompleted)
    );
}

/// The store's answers to a Release and to an ExtendLease (by 5 s) of `name` with `token`.
async fn release_and_extend<S: Store>(
    store: &S,
    name: &str,
    token: LeaseToken,
) -> [Result<(), Rejection>; 2] {
    [
        store.release(&release(name, token)).await.expect("store"),
        store
            .extend_lease(&extend(name, token, Duration::from_secs(5)))
            .await
            .expect("store")
            .map(drop),
    ]
}

async fn refusals_come_in_the_contracts_order<S: Store>(store: S, _: &TestDatabase) {
    let held = token_of(&store, "k").await;
    let stranger = token(held.get() + 1000);
    assert_eq!(
        complete_answer(&store, "absent", held, b"x").await,
        Err(Rejection::KeyNotFound)
    );
    assert_eq!(
        release_and_extend(&store, "k", stranger).await,
        [Err(Rejection::LeaseLost), Err(Rejection::LeaseLost)]
    );
    completed(&store, complete("k", held, b"done")).await;
    assert_eq!(
        release_and_extend(&store, "k", held).await,
        [
            Err(Rejection::AlreadyCompleted),
            Err(Rejection::AlreadyCompleted)
        ]
    );
}

async fn release_makes_the_key_absent<S: Store>(store: S, _: &TestDatabase) {
    let held = token_of(&store, "k").await;
    assert!(matches!(
        store.lookup(&lookup("k")).await.expect("lookup"),
        KeyState::InProgress { attempt: 1, .. }
    ));
    released(&store, release("k", held)).await;
    assert_eq!(
        store.lookup(&lookup("k")).await.expect("lookup"),
        KeyState::Absent
    );
}

async fn extend_lease_sets_the_lease_from_now_and_may_shorten_it<S: Store>(
    store: S,
    database: &TestDatabase,
) {
    let held = token_of(&store, "k").await;
    let before = database.now().await;
    let shortened = extended(&store, extend("k", held, Duration::from_secs(1))).await;
    let after = database.now().await;
    assert!(shortened > before + chrono::Duration::milliseconds(900));
    assert!(shortened <= after + chrono::Duration::seconds(1));
    assert!(matches!(
        store.lookup(&lookup("k")).await.expect("lookup"),
        KeyState::InProgress { lease_expires_at, .. } if lease_expires_at == shortened
    ));
}

store_suite!(
    a_completed_key_is_replayed_and_looked_up_with_its_response,
    refusals_come_in_the_contracts_order,
    release_makes_the_key_absent,
    extend_lease_sets_the_lease_from_now_and_may_shorten_it,
);
