//! Rules of docs/contract.md that no other test pinned down: which error wins on an expired row,
//! the retention arithmetic of a claim and of a takeover, a repeated Complete changing nothing
//! in the stored row, the decoding limit following `--max-response-bytes`, an empty fingerprint
//! against a stored one, and MarkProcessed's atomicity when the store fails mid-statement.

use idempotency_coordinator::proto::idempotency::v1::{CompleteRequest, lookup_response::State};
use prost::Message;
use tonic::Code;

use crate::support::*;

/// An expired row that is still there (the reaper has not run), presented with a token that is
/// not its current one: absent wins over "not the current token", so KEY_NOT_FOUND, never
/// LEASE_LOST, for every guarded write.
async fn an_expired_unreaped_row_with_a_stale_token_is_key_not_found(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let key = unique_key("stale-expired");
    let first = claim_and_let_lapse(&app, &mut client, short_lived(&key)).await;
    let taker = claim(&mut client, short_lived(&key)).await;
    assert_eq!(taker.attempt, 2, "taken over: the first token is stale");
    let expiry = app.database.key_expires_at(&key).await;
    wait_for_db_clock_past(&app, expiry, "the key expired").await;
    assert_eq!(app.count_rows("idempotency_keys").await, 1, "not reaped");

    for token in [first.lease_token, taker.lease_token, i64::MAX as u64] {
        assert_guarded_writes_refused(&client, &key, token, Code::NotFound, "KEY_NOT_FOUND").await;
    }
}

/// A fresh claim's `expires_at` is the claim's instant plus its retention: exactly
/// `lease_expires_at − lease_ttl + retention`, since both are counted from one instant.
async fn a_fresh_claims_expiry_is_its_instant_plus_its_retention(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let key = unique_key("fresh-retention");
    let before = app.db_now().await;
    let request = try_start(&key)
        .with_retention(secs(600))
        .with_lease(secs(30));
    let started = claim(&mut client, request).await;
    let after = app.db_now().await;
    let claimed_at = instant(&started.lease_expires_at) - chrono::Duration::seconds(30);
    assert!(
        before <= claimed_at && claimed_at <= after,
        "the claim's instant {claimed_at} is by the database clock, within [{before}, {after}]"
    );
    assert_eq!(
        app.database.key_expires_at(&key).await,
        claimed_at + chrono::Duration::seconds(600)
    );
}

/// A takeover's retention is stretched to cover its own lease, like a claim's.
async fn a_takeover_stretches_retention_to_cover_its_lease(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let key = unique_key("takeover-stretch");
    claim(&mut client, short_lived(&key)).await;
    let old_expiry = app.database.key_expires_at(&key).await;
    wait_for_lease_expiry(&app, &client, &key).await;
    let long_lease = short_lived(&key).with_lease(secs(120));
    let taken = claim(&mut client, long_lease).await;
    assert_eq!(taken.attempt, 2, "a takeover");
    let expires_at = app.database.key_expires_at(&key).await;
    assert!(expires_at > old_expiry);
    assert_eq!(expires_at, instant(&taken.lease_expires_at));
}

/// A repeated Complete (current token, same response) succeeds with the same timestamps and
/// leaves the stored row exactly as it was, even when it asks for another retention.
async fn a_repeated_complete_leaves_the_stored_row_unchanged(backend: Backend) {
    let (app, mut client) = app_and_client(backend).await;
    let key = unique_key("repeat-row");
    let started = claim(&mut client, try_start(&key)).await;
    let request = complete(&key, started.lease_token, b"the response").with_retention(secs(60));
    let first = complete_response(&client, request.clone()).await;
    let stored = key_state(&client, &key).await;
    let stored_expiry = app.database.key_expires_at(&key).await;
    // A repeated Complete succeeds.
    let again = complete_response(&client, request.with_retention(secs(7200))).await;
    assert_eq!(again, first, "the same timestamps");
    assert_eq!(key_state(&client, &key).await, stored, "the row as it was");
    assert_eq!(app.database.key_expires_at(&key).await, stored_expiry);
    let State::Completed(done) = stored else {
        panic!("completed: {stored:?}");
    };
    assert_eq!(done.response, b"the response");
    assert_eq!(done.expires_at, first.expires_at);
}

/// A Complete whose encoded message is `size` bytes long (its response padded to fit).
fn complete_of_size(key: &str, token: u64, size: usize) -> CompleteRequest {
    let mut request = complete(key, token, b"");
    let mut padding = size.saturating_sub(request.encoded_len() + 4);
    loop {
        request.response = vec![b'r'; padding];
        match request.encoded_len().cmp(&size) {
            std::cmp::Ordering::Equal => return request,
            std::cmp::Ordering::Less => padding += 1,
            std::cmp::Ordering::Greater => padding -= 1,
        }
    }
}

/// The decoding limit is `--max-response-bytes` plus 64 KiB, whatever the flag says: a message
/// of exactly that size is decoded (and here refused by validation, its response being over
/// the response limit), one byte more is refused by the gRPC layer; a response at the limit is
/// stored.
async fn the_decoding_limit_follows_the_response_limit(backend: Backend) {
    const RESPONSE_LIMIT: usize = 300_000;
    const DECODING_LIMIT: usize = RESPONSE_LIMIT + 64 * 1024;
    let limit_flag = RESPONSE_LIMIT.to_string();
    let (_app, mut client) =
        app_and_client_with(backend, &["--max-response-bytes", &limit_flag]).await;
    let key = unique_key("decoding-limit");
    let started = claim(&mut client, try_start(&key)).await;

    let just_fits = complete_of_size(&key, started.lease_token, DECODING_LIMIT);
    let status = client
        .complete(just_fits)
        .await
        .expect_err("a response over its limit");
    assert_invalid(&status, &["response"]);
    let one_over = complete_of_size(&key, started.lease_token, DECODING_LIMIT + 1);
    let status = client
        .complete(one_over)
        .await
        .expect_err("over the decoding limit");
    assert_eq!(status.code(), Code::OutOfRange, "{status:?}");

    // A response at the configured limit is stored.
    complete_key(
        &client,
        &key,
        started.lease_token,
        &vec![b'r'; RESPONSE_LIMIT],
    )
    .await;
}

/// An empty fingerprint matches only an empty one: against a stored non-empty fingerprint it is
/// a mismatch, in progress or completed, and changes nothing.
async fn an_empty_fingerprint_against_a_stored_one_is_a_mismatch(backend: Backend) {
    a_fingerprint_mismatch_changes_nothing(backend, b"", "another").await;
}

/// PostgreSQL only: the statement is stopped half-way from outside, after it has inserted some
/// of its ids, by a row lock held on a later one and the statement timeout. (The embedded
/// store's single writer runs the whole batch in one transaction that another session can only
/// keep from starting, never stop half-way: its atomicity is that transaction's.)
#[tokio::test]
async fn mark_processed_writes_nothing_when_the_store_fails_mid_statement() {
    let (app, mut client) =
        app_and_client_with(Backend::Postgres, &["--operation-timeout", "500ms"]).await;
    mark_results(&client, mark("atomic", &["c-held"])).await;
    let mut holder = raw::transaction(&app.database.url).await;
    raw::run(
        &mut holder,
        "SELECT 1 FROM processed_events WHERE event_id = 'c-held' FOR UPDATE",
    )
    .await;

    // Ids are written in sorted order: a-new and b-new before c-held, d-new after it.
    let timed_out = client
        .mark_processed(mark("atomic", &["d-new", "a-new", "c-held", "b-new"]))
        .await;
    assert_refused(timed_out, Code::Unavailable, "STORE_UNAVAILABLE");
    raw::run(&mut holder, "ROLLBACK").await;

    assert_eq!(
        app.count_rows("processed_events").await,
        1,
        "none of the batch's ids was kept"
    );
    let results = mark_results(&client, mark("atomic", &["a-new", "b-new", "d-new"])).await;
    assert!(
        results.iter().all(|r| !r.already_processed),
        "every id is new: {results:?}"
    );
}

for_each_backend!(
    an_expired_unreaped_row_with_a_stale_token_is_key_not_found,
    a_fresh_claims_expiry_is_its_instant_plus_its_retention,
    a_takeover_stretches_retention_to_cover_its_lease,
    a_repeated_complete_leaves_the_stored_row_unchanged,
    the_decoding_limit_follows_the_response_limit,
    an_empty_fingerprint_against_a_stored_one_is_a_mismatch,
);
