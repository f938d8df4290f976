//! Fencing: a claim's token is greater than every token its key had before, however long the
//! claim's statement waited or its backend was paused. The PostgreSQL cases stop the claim's
//! own backend (SIGSTOP) while it waits for another transaction's hold on the key; meanwhile
//! that key gets a newer token, which its holder Releases, and only then does the backend go
//! on. A claim that had drawn its token before the wait would insert the key again with that
//! older token; the contract wants a token above the released one.

use std::time::Duration;

use idempotency_coordinator::domain::batch::Round;
use idempotency_coordinator::domain::{LeaseTtl, TryStartCommand, TryStartOutcome};
use idempotency_coordinator::store::Store;

use crate::support::*;
use idempotency_testkit::database::signal;

/// A PostgreSQL backend stopped with SIGSTOP, continued (SIGCONT) when dropped, whatever
/// happens: a backend left stopped would keep the test's database from being dropped.
struct StoppedBackend(i32);

impl StoppedBackend {
    fn stop(pid: i32) -> Self {
        assert!(signal("STOP", pid), "SIGSTOP to backend {pid}");
        Self(pid)
    }
}

impl Drop for StoppedBackend {
    fn drop(&mut self) {
        if !signal("CONT", self.0) {
            eprintln!("could not SIGCONT backend {}", self.0);
        }
    }
}

/// How another transaction holds the key while the claim waits for it.
#[derive(Clone, Copy, Debug)]
enum Hold {
    /// It inserts the key (a claim of another replica, not yet committed): the claim's insert
    /// waits for it. Meanwhile the row gets a newer token and commits.
    UncommittedInsert,
    /// It locks the key's expired row, as the reaper does, so the claim that would reclaim the
    /// key waits; meanwhile it deletes the row and inserts a new claim of the key, with a newer
    /// token, and commits.
    ReaperOfAnExpiredRow,
}

/// How the service makes the claim.
#[derive(Clone, Copy, Debug)]
enum Path {
    /// A lone TryStart on a direct connection.
    Lone,
    /// A lone TryStart as it runs behind a pooler in transaction mode (`--pooler transaction`:
    /// each statement a transaction of its own), on PostgreSQL directly.
    Pooler,
    /// The same through a real PgBouncer in transaction mode.
    PgBouncer,
    /// A shared statement of two keys, the held one first in key order.
    Batch,
}

/// A claim as the store takes it, with `lease`.
fn command_with_lease(key: &str, lease: Duration) -> TryStartCommand {
    TryStartCommand {
        lease_ttl: LeaseTtl::parse(lease).expect("lease"),
        ..store_try_start(key, "the-paused-claim")
    }
}

fn command(key: &str) -> TryStartCommand {
    store_try_start(key, "the-paused-claim")
}

/// A claim's token and the instant its lease began (its 30 s lease before its end).
type Claimed = (i64, chrono::DateTime<chrono::Utc>);

/// The token and lease of a `started` outcome, or a panic naming what came instead.
fn started(name: &str, outcome: TryStartOutcome) -> Claimed {
    match outcome {
        TryStartOutcome::Started(started) => (
            started.lease_token.get(),
            started.lease_expires_at - chrono::Duration::seconds(30),
        ),
        other => panic!("{name}: expected started, got {other:?}"),
    }
}

async fn a_claim_paused_while_it_waits_gets_a_token_above_the_released_one(path: Path, hold: Hold) {
    // The steps take a moment each; the claim must not time out meanwhile.
    let database = TestDatabase::create(Backend::Postgres).await;
    let direct = database.url.clone();
    let mut flags = vec!["--operation-timeout", "60s"];
    let bouncer = match path {
        Path::PgBouncer => Some(crate::pgbouncer::PgBouncer::start().await),
        _ => None,
    };
    let pooled = bouncer.as_ref().map(|bouncer| bouncer.url(&direct));
    if let Path::Pooler | Path::PgBouncer = path {
        // The statements as a pooler needs them, on PostgreSQL directly (the SIGSTOP reaches
        // the backend either way); the listener's connection must be direct.
        let migrated = crate::support::process::coordinator()
            .command()
            .args(["migrate", "--database-url", &direct])
            .output()
            .await
            .expect("run migrate");
        assert!(migrated.status.success(), "migrate: {migrated:?}");
        flags.extend([
            "--pooler",
            "transaction",
            "--no-migrate",
            "--notify-database-url",
            &direct,
        ]);
    }
    let app = TestApp::start_on(database, pooled.as_deref(), &flags).await;
    app.wait_for_status(tonic_health::pb::health_check_response::ServingStatus::Serving)
        .await;
    let mut client = app.client().await;
    let suffix = unique_key("fence");
    let (key, other) = (format!("a-{suffix}"), format!("b-{suffix}"));

    let mut session = raw::session(&app.database.url).await;
    if let Hold::ReaperOfAnExpiredRow = hold {
        raw::insert_claim(&mut session, &key, true).await;
    }
    raw::run(&mut session, "BEGIN").await;
    match hold {
        Hold::UncommittedInsert => {
            raw::insert_claim(&mut session, &key, false).await;
        }
        Hold::ReaperOfAnExpiredRow => {
            raw::lock_key(&mut session, &key).await;
        }
    }

    let claim = {
        let store = app.patient_store(Duration::from_secs(50));
        let mut client = client.clone();
        let (key, other) = (key.clone(), other.clone());
        tokio::spawn(async move {
            match path {
                Path::Lone | Path::Pooler | Path::PgBouncer => {
                    let request = try_start(&key).with_attempt("the-paused-claim");
                    let answer = client.try_start(request).await.expect("TryStart");
                    let started = expect_started(answer.into_inner());
                    vec![(
                        started.lease_token as i64,
                        instant(&started.lease_expires_at) - chrono::Duration::seconds(30),
                    )]
                }
                Path::Batch => {
                    let round =
                        Round::new(vec![command(&key), command(&other)]).expect("distinct keys");
                    let mut claims = Vec::new();
                    for (name, outcome) in ["held key", "other key"]
                        .into_iter()
                        .zip(store.try_start_batch(&round).await)
                    {
                        claims.push(started(name, outcome.expect("a batched claim")));
                    }
                    claims
                }
            }
        })
    };

    // The claim's backend, waiting for the key: stopped until the key has come and gone again.
    let pid = eventually_some(
        Duration::from_secs(10),
        "the claim waits for the key",
        || app.database.waiting_service_backend(),
    )
    .await;
    let released = {
        let _stopped = StoppedBackend::stop(pid);
        if let Hold::ReaperOfAnExpiredRow = hold {
            raw::delete_key(&mut session, &key).await;
            raw::insert_claim(&mut session, &key, false).await;
        }
        let (newer,): (i64,) = sqlx::query_as(
            "UPDATE idempotency_keys SET lease_token = nextval('lease_token_seq')
             WHERE key = $1 RETURNING lease_token",
        )
        .bind(&key)
        .fetch_one(&mut session)
        .await
        .expect("a newer token");
        raw::run(&mut session, "COMMIT").await;
        client
            .release(release(&key, newer as u64))
            .await
            .expect("the holder of the newer token releases the key");
        (newer, app.db_now().await)
    };
    let (released, released_at) = released;

    let claims = tokio::time::timeout(Duration::from_secs(30), claim)
        .await
        .expect("the claim is answered once its backend goes on")
        .expect("task");
    let (token, _) = claims[0];
    assert!(
        token > released,
        "{path:?}, {hold:?}: the claim answered after the Release of token {released} carries \
         {token}"
    );
    assert_eq!(
        app.database.key_lease_token(&key).await as i64,
        token,
        "the stored token is the one answered"
    );
    // The lease counts from when the key became the claim's own, not from before its wait.
    for (token, lease_began) in claims {
        assert!(
            lease_began >= released_at,
            "{path:?}, {hold:?}: the lease of token {token} began at {lease_began}, before the \
             key was released at {released_at}"
        );
    }
}

#[tokio::test]
async fn a_lone_claim_paused_behind_an_uncommitted_insert_gets_a_newer_token() {
    a_claim_paused_while_it_waits_gets_a_token_above_the_released_one(
        Path::Lone,
        Hold::UncommittedInsert,
    )
    .await;
}

#[tokio::test]
async fn a_lone_claim_paused_behind_the_reaper_gets_a_newer_token() {
    a_claim_paused_while_it_waits_gets_a_token_above_the_released_one(
        Path::Lone,
        Hold::ReaperOfAnExpiredRow,
    )
    .await;
}

#[tokio::test]
async fn a_pooled_claim_paused_behind_an_uncommitted_insert_gets_a_newer_token() {
    a_claim_paused_while_it_waits_gets_a_token_above_the_released_one(
        Path::Pooler,
        Hold::UncommittedInsert,
    )
    .await;
}

#[tokio::test]
async fn a_pooled_claim_paused_behind_the_reaper_gets_a_newer_token() {
    a_claim_paused_while_it_waits_gets_a_token_above_the_released_one(
        Path::Pooler,
        Hold::ReaperOfAnExpiredRow,
    )
    .await;
}

#[tokio::test]
async fn a_claim_through_pgbouncer_paused_behind_an_uncommitted_insert_gets_a_newer_token() {
    a_claim_paused_while_it_waits_gets_a_token_above_the_released_one(
        Path::PgBouncer,
        Hold::UncommittedInsert,
    )
    .await;
}

#[tokio::test]
async fn a_claim_through_pgbouncer_paused_behind_the_reaper_gets_a_newer_token() {
    a_claim_paused_while_it_waits_gets_a_token_above_the_released_one(
        Path::PgBouncer,
        Hold::ReaperOfAnExpiredRow,
    )
    .await;
}

#[tokio::test]
async fn a_batched_claim_paused_behind_an_uncommitted_insert_gets_a_newer_token() {
    a_claim_paused_while_it_waits_gets_a_token_above_the_released_one(
        Path::Batch,
        Hold::UncommittedInsert,
    )
    .await;
}

#[tokio::test]
async fn a_batched_claim_paused_behind_the_reaper_gets_a_newer_token() {
    a_claim_paused_while_it_waits_gets_a_token_above_the_released_one(
        Path::Batch,
        Hold::ReaperOfAnExpiredRow,
    )
    .await;
}

/// SQLite has one writer: a claim takes the write lock before it reads the key or draws a
/// token. A claim that waited for another writer, which claimed the key with a newer token and
/// released it, gets a token above that one.
#[tokio::test]
async fn a_sqlite_claim_that_waited_for_the_writer_gets_a_newer_token() {
    let (app, client) = app_and_client_with(Backend::Sqlite, &["--operation-timeout", "60s"]).await;
    let key = unique_key("fence");
    let hold = app.database.hold_key(&key).await;
    let claim = {
        let mut client = client.clone();
        let key = key.clone();
        tokio::spawn(async move {
            let answer = client.try_start(try_start(&key)).await.expect("TryStart");
            expect_started(answer.into_inner()).lease_token
        })
    };
    app.wait_for_blocked(1).await;
    let meanwhile = hold.claim_released_meanwhile_and_commit(&key).await;
    let token = claim.await.expect("task") as i64;
    assert!(
        token > meanwhile,
        "the claim answered after token {meanwhile} was released carries {token}"
    );
}

/// A claim that waited for the reaper's delete of its key's expired row, a wait in which nobody
/// draws a token, counts its lease from when the key became its own: had it kept the instant it
/// began, a lease shorter than the wait would be answered as already over.
async fn a_claim_that_waited_behind_the_reapers_delete_counts_its_lease_from_then(path: Path) {
    const LEASE: Duration = Duration::from_millis(200);
    let (app, client) =
        app_and_client_with(Backend::Postgres, &["--operation-timeout", "60s"]).await;
    let key = format!("a-{}", unique_key("reaped"));
    let mut session = raw::session(&app.database.url).await;
    raw::insert_claim(&mut session, &key, true).await;
    raw::run(&mut session, "BEGIN").await;
    raw::delete_key(&mut session, &key).await;

    let claim = {
        let store = app.patient_store(Duration::from_secs(50));
        let mut client = client.clone();
        let key = key.clone();
        tokio::spawn(async move {
            match path {
                Path::Batch => {
                    let other = format!("b-{key}");
                    let round = Round::new(vec![
                        command_with_lease(&key, LEASE),
                        command_with_lease(&other, LEASE),
                    ])
                    .expect("distinct keys");
                    let mut answers = store.try_start_batch(&round).await.into_iter();
                    match answers.next().expect("an answer per call") {
                        Ok(TryStartOutcome::Started(started)) => started.lease_expires_at,
                        other => panic!("expected started, got {other:?}"),
                    }
                }
                _ => {
                    let request = try_start(&key).with_lease(Some(duration(LEASE)));
                    let answer = client.try_start(request).await.expect("TryStart");
                    instant(&expect_started(answer.into_inner()).lease_expires_at)
                }
            }
        })
    };
    eventually_some(
        Duration::from_secs(10),
        "the claim waits for the key",
        || app.database.waiting_service_backend(),
    )
    .await;
    // The wait outlasts the lease asked for.
    let waiting_since = app.db_now().await;
    eventually(
        Duration::from_secs(10),
        "the lease's length passes",
        || async { app.db_now().await > waiting_since + chrono::Duration::milliseconds(300) },
    )
    .await;
    let released_at = app.db_now().await;
    raw::run(&mut session, "COMMIT").await;

    let lease_expires_at = tokio::time::timeout(Duration::from_secs(30), claim)
        .await
        .expect("answered")
        .expect("task");
    let lease = chrono::Duration::from_std(LEASE).expect("a lease");
    assert!(
        lease_expires_at - lease >= released_at,
        "{path:?}: the lease ends at {lease_expires_at}, counted from before the key was free at \
         {released_at}"
    );
}

#[tokio::test]
async fn a_lone_claim_that_waited_behind_the_reapers_delete_counts_its_lease_from_then() {
    a_claim_that_waited_behind_the_reapers_delete_counts_its_lease_from_then(Path::Lone).await;
}

#[tokio::test]
async fn a_batched_claim_that_waited_behind_the_reapers_delete_counts_its_lease_from_then() {
    a_claim_that_waited_behind_the_reapers_delete_counts_its_lease_from_then(Path::Batch).await;
}
