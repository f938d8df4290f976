//! A key another transaction holds (an operator's `SELECT … FOR UPDATE`, an uncommitted insert,
//! a stalled statement) delays only its own callers, proven through the RPCs against the
//! running service with its default settings (operation timeout 5 s, so a lock budget of 1 s;
//! one coalescer executor), on PostgreSQL directly and behind PgBouncer in transaction mode.
//! Every other call is answered within 100 ms of its call; the held key's callers are told
//! UNAVAILABLE / STORE_UNAVAILABLE (retryable, nothing written) at their lock budget, and are
//! answered as usual once the hold ends. See docs/reliability.md §11.

use std::time::{Duration, Instant};

use idempotency_coordinator::proto::idempotency::v1::try_start_response::Outcome;
use idempotency_testkit::load::Callers;
use tokio::task::JoinSet;
use tonic::Code;

use crate::pgbouncer::PgBouncer;
use crate::support::*;

/// What another call may wait for a held key at most (the bound): a shared statement's
/// first wait for a row lock is 20 ms, and a call that met the held key in a shared statement
/// runs once more alone.
const OTHERS_ANSWERED_WITHIN: Duration = Duration::from_millis(100);
/// The lock budget at the default operation timeout (5 s): a fifth of it.
const LOCK_BUDGET: Duration = Duration::from_secs(1);
/// The default operation timeout: every caller is answered by it.
const OPERATION_TIMEOUT: Duration = Duration::from_secs(5);

/// How the service reaches PostgreSQL.
#[derive(Clone, Copy, Debug)]
pub(super) enum Route {
    Direct,
    PgBouncer,
}

/// The two tests of `scenario`: directly against PostgreSQL, and behind PgBouncer.
macro_rules! on_both_routes {
    ($scenario:ident: $direct:ident, $behind_pgbouncer:ident) => {
        #[tokio::test]
        async fn $direct() {
            $scenario(Route::Direct).await;
        }

        #[tokio::test]
        async fn $behind_pgbouncer() {
            $scenario(Route::PgBouncer).await;
        }
    };
}

// After the macro, which they use.
mod edges;
mod others;

/// The service on `route`, with its default settings (the test harness's small pool aside);
/// behind PgBouncer, with the flags its documentation gives. Warmed up: a replica that has
/// served traffic has its pool's connections open, and a test of how long calls wait should
/// not time the opening of a connection for the first of them.
async fn service(route: Route) -> (TestApp, Option<PgBouncer>) {
    service_with(route, &[]).await
}

/// Opens the pool's connections with a few rounds of lookups.
async fn warm_up(app: &TestApp) {
    let client = app.client().await;
    for _ in 0..3 {
        let mut lookups = JoinSet::new();
        for n in 0..8 {
            let mut client = client.clone();
            lookups.spawn(async move { client.lookup(lookup(&format!("warm-{n}"))).await });
        }
        while let Some(looked) = lookups.join_next().await {
            looked
                .expect("a warm-up lookup's task")
                .expect("a warm-up lookup");
        }
    }
}

async fn started(route: Route) -> (TestApp, Option<PgBouncer>) {
    started_with(route, &[]).await
}

/// [`service`] with `flags` besides.
pub(super) async fn service_with(route: Route, flags: &[&str]) -> (TestApp, Option<PgBouncer>) {
    let (app, bouncer) = started_with(route, flags).await;
    warm_up(&app).await;
    (app, bouncer)
}

async fn started_with(route: Route, extra: &[&str]) -> (TestApp, Option<PgBouncer>) {
    match route {
        Route::Direct => (TestApp::spawn_with(Backend::Postgres, extra).await, None),
        Route::PgBouncer => {
            let bouncer = PgBouncer::start().await;
            let (app, _) = crate::pgbouncer::serve_behind(&bouncer, extra).await;
            (app, Some(bouncer))
        }
    }
}

/// A call's answer and how long it took, from just before it was sent.
struct Timed<T> {
    key: String,
    took: Duration,
    answer: Result<T, tonic::Status>,
}

/// Runs `call` in a task of `calls`, timed from just before it is sent.
fn spawn_timed<T, F, Fut>(calls: &mut JoinSet<Timed<T>>, key: &str, call: F)
where
    T: Send + 'static,
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<T, tonic::Status>> + Send,
{
    let key = key.to_owned();
    calls.spawn(async move {
        let began = Instant::now();
        let answer = call().await;
        Timed {
            key,
            took: began.elapsed(),
            answer,
        }
    });
}

fn spawn_claim(calls: &mut JoinSet<Timed<Outcome>>, client: &Client, key: &str) {
    let (mut client, request) = (client.clone(), try_start(key));
    spawn_timed(calls, key, move || async move {
        client
            .try_start(request)
            .await
            .map(|response| response.into_inner().outcome.expect("an outcome"))
    });
}

/// Every call of `answers` but those of `held` succeeded within the bound.
fn assert_others_answered_in_time<T: std::fmt::Debug>(answers: &[Timed<T>], held: &[&str]) {
    for call in answers
        .iter()
        .filter(|call| !held.contains(&call.key.as_str()))
    {
        assert!(
            call.answer.is_ok(),
            "{} does not need the held key, yet: {:?}",
            call.key,
            call.answer
        );
        assert!(
            call.took < OTHERS_ANSWERED_WITHIN,
            "{} was answered after {:?}, behind the held key",
            call.key,
            call.took
        );
    }
}

/// A held key's caller: UNAVAILABLE / STORE_UNAVAILABLE, not before its lock budget (it waited
/// for the key) and by its deadline: at its lock budget, after those of the calls ahead of it in
/// the held-key lane (the key's earlier calls, whatever their kind, take their turns one at a
/// time; behind PgBouncer with 4 server connections the lane has one place).
fn assert_told_to_retry_at_lock_budget<T: std::fmt::Debug>(call: &Timed<T>) {
    match &call.answer {
        Err(status) => assert_error(status, Code::Unavailable, "STORE_UNAVAILABLE"),
        Ok(answer) => panic!("{} is held, yet answered {answer:?}", call.key),
    }
    assert!(
        call.took >= LOCK_BUDGET && call.took < OPERATION_TIMEOUT,
        "{}: told to retry after {:?}, not between its lock budget and its deadline",
        call.key,
        call.took
    );
}

async fn joined<T: 'static>(mut calls: JoinSet<Timed<T>>) -> Vec<Timed<T>> {
    let mut answers = Vec::new();
    while let Some(call) = calls.join_next().await {
        answers.push(call.expect("the call's task"));
    }
    answers
}

/// The service on `route`, and a key of its, `a-block<suffix>`, inserted as a claim by another
/// transaction (`session`'s) that has not committed. (Its fields drop in order: the other
/// transaction's session before PgBouncer, the service and its database.)
struct HeldClaim {
    session: sqlx::PgConnection,
    key: String,
    suffix: String,
    client: Client,
    _bouncer: Option<PgBouncer>,
    app: TestApp,
}

impl HeldClaim {
    async fn on(route: Route) -> Self {
        let (app, _bouncer) = service(route).await;
        let client = app.client().await;
        let suffix = unique_key("");
        let key = format!("a-block{suffix}");
        let mut session = raw::transaction(&app.database.url).await;
        raw::insert_claim(&mut session, &key, false).await;
        Self {
            session,
            key,
            suffix,
            client,
            _bouncer,
            app,
        }
    }

    /// A claim of the held key, in a task of `calls`.
    fn spawn_claim(&self, calls: &mut JoinSet<Timed<Outcome>>) {
        spawn_claim(calls, &self.client, &self.key);
    }

    /// Claims of `count` other keys (`b-00<suffix>` on), each in a task of `calls`.
    fn spawn_other_claims(&self, calls: &mut JoinSet<Timed<Outcome>>, count: usize) {
        for other in 0..count {
            let key = format!("b-{other:02}{}", self.suffix);
            spawn_claim(calls, &self.client, &key);
        }
    }

    /// Ends the other transaction, and with it the hold.
    async fn end(&mut self) {
        raw::run(&mut self.session, "ROLLBACK").await;
    }
}

/// The scenario: forty TryStarts at once, one of them for a key another transaction
/// has inserted and not committed.
async fn forty_claims_at_once_one_key_held(route: Route) {
    let mut held = HeldClaim::on(route).await;
    let mut calls = JoinSet::new();
    held.spawn_claim(&mut calls);
    held.spawn_other_claims(&mut calls, 39);
    let answers = joined(calls).await;
    assert_others_answered_in_time(&answers, &[&held.key]);
    for call in &answers {
        if call.key != held.key {
            assert!(
                matches!(call.answer, Ok(Outcome::Started(_))),
                "{route:?}: {} is started: {:?}",
                call.key,
                call.answer
            );
        }
    }
    let held_call = answers
        .iter()
        .find(|call| call.key == held.key)
        .expect("the held key's call");
    assert_told_to_retry_at_lock_budget(held_call);

    // Once the hold ends, the key's caller is answered as usual.
    held.end().await;
    let answer = try_start_response(&held.client, try_start(&held.key)).await;
    assert!(
        matches!(answer.outcome, Some(Outcome::Started(_))),
        "{route:?}: started once the hold ends: {answer:?}"
    );
}

/// A claim already waiting for a held key (the call a single executor used to run first, and
/// every other call queued behind): the calls that come after it are not held up, and a second
/// caller of the held key, which comes with them, waits on its own too.
async fn claims_behind_a_claim_waiting_for_a_held_key(route: Route) {
    let mut held = HeldClaim::on(route).await;
    let mut first = JoinSet::new();
    held.spawn_claim(&mut first);
    held.app.wait_for_blocked(1).await;
    let mut calls = JoinSet::new();
    held.spawn_other_claims(&mut calls, 38);
    held.spawn_claim(&mut calls);
    let answers = joined(calls).await;
    assert_others_answered_in_time(&answers, &[&held.key]);
    for call in joined(first)
        .await
        .iter()
        .chain(answers.iter().filter(|call| call.key == held.key))
    {
        assert_told_to_retry_at_lock_budget(call);
    }
    held.end().await;
}

on_both_routes!(
    forty_claims_at_once_one_key_held: forty_claims_at_once_one_key_held_directly,
    forty_claims_at_once_one_key_held_behind_pgbouncer
);
on_both_routes!(
    claims_behind_a_claim_waiting_for_a_held_key:
        claims_behind_a_claim_waiting_for_a_held_key_directly,
    claims_behind_a_claim_waiting_for_a_held_key_behind_pgbouncer
);

/// A row lock (`SELECT … FOR UPDATE`) on an in-progress key and on a processed event: the
/// Complete, ExtendLease and MarkProcessed calls of that key and event wait on their own and
/// are told to retry at their lock budget; those of other keys and events, sent while the
/// first wait, are answered within the bound.
async fn row_locks_delay_only_their_own_writes(route: Route) {
    let (app, _bouncer) = service(route).await;
    let client = app.client().await;
    let suffix = unique_key("");
    let consumer = "consumer";
    let held_key = format!("held{suffix}");
    let held_event = format!("held-event{suffix}");
    let mut tokens = std::collections::HashMap::new();
    for key in std::iter::once(held_key.clone()).chain((0..8).map(|i| format!("k{i}{suffix}"))) {
        let started = claim(&mut client.clone(), try_start(&key)).await;
        tokens.insert(key, started.lease_token);
    }
    mark_results(&client, mark(consumer, &[&held_event])).await;

    let mut session = raw::transaction(&app.database.url).await;
    raw::lock_key(&mut session, &held_key).await;
    raw::lock_event(&mut session, consumer, &held_event).await;

    let mut held_calls = JoinSet::new();
    let token = tokens[&held_key];
    let (mut c, key) = (client.clone(), held_key.clone());
    spawn_timed(&mut held_calls, "held Complete", move || async move {
        c.complete(complete(&key, token, b"done")).await.map(drop)
    });
    let (mut c, key) = (client.clone(), held_key.clone());
    spawn_timed(&mut held_calls, "held ExtendLease", move || async move {
        c.extend_lease(extend(&key, token)).await.map(drop)
    });
    let (mut c, event) = (client.clone(), held_event.clone());
    let fresh = format!("fresh-with-held{suffix}");
    spawn_timed(&mut held_calls, "held MarkProcessed", move || async move {
        c.mark_processed(mark(consumer, &[&fresh, &event]))
            .await
            .map(drop)
    });
    app.wait_for_blocked(3).await;

    let mut calls = JoinSet::new();
    for i in 0..8 {
        let key = format!("k{i}{suffix}");
        let (mut c, token) = (client.clone(), tokens[&key]);
        if i % 2 == 0 {
            spawn_timed(&mut calls, &key.clone(), move || async move {
                c.complete(complete(&key, token, b"done")).await.map(drop)
            });
        } else {
            spawn_timed(&mut calls, &key.clone(), move || async move {
                c.extend_lease(extend(&key, token)).await.map(drop)
            });
        }
    }
    for i in 0..4 {
        let mut c = client.clone();
        let ids: Vec<String> = (0..3).map(|j| format!("e{i}-{j}{suffix}")).collect();
        spawn_timed(&mut calls, &format!("events {i}"), move || async move {
            let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
            c.mark_processed(mark(consumer, &ids)).await.map(drop)
        });
    }
    let answers = joined(calls).await;
    assert_others_answered_in_time(&answers, &[]);
    for call in joined(held_calls).await {
        assert_told_to_retry_at_lock_budget(&call);
    }

    // The held MarkProcessed wrote nothing: its fresh id is new once the hold ends.
    raw::run(&mut session, "ROLLBACK").await;
    let marked = mark_results(
        &client,
        mark(
            consumer,
            &[&format!("fresh-with-held{suffix}"), &held_event],
        ),
    )
    .await;
    assert_eq!(
        marked
            .iter()
            .map(|result| result.already_processed)
            .collect::<Vec<_>>(),
        vec![false, true],
        "{route:?}"
    );
    complete_key(&client, &held_key, token, b"done").await;
}

on_both_routes!(row_locks_delay_only_their_own_writes: row_locks_delay_only_their_own_writes_directly, row_locks_delay_only_their_own_writes_behind_pgbouncer);

/// Under steady load, one in-progress key's row locked for 10 s while several callers keep
/// asking for it: the callers running lifecycles on other keys keep at least 80% of their
/// throughput, with no error and their p99 within twice the unheld run's. The unheld run is
/// measured before and after the hold, so that a machine busier in one phase than the other
/// is less likely to pass for the held key's doing.
#[tokio::test]
async fn a_held_key_under_steady_load_leaves_the_other_callers_their_throughput() {
    let (app, _bouncer) = service(Route::Direct).await;
    let client = app.client().await;
    let suffix = unique_key("");
    const CALLERS: usize = 8;
    let unheld_phase = Duration::from_secs(3);

    let before = lifecycles(&client, CALLERS, &format!("before{suffix}"));
    tokio::time::sleep(unheld_phase).await;
    let before = before.finish().await.expect("the unheld run");

    let held = format!("held{suffix}");
    claim(&mut client.clone(), try_start(&held)).await;
    let hold = app.database.hold_key(&held).await;
    let askers = Callers::start(4, {
        let (client, held) = (client.clone(), held.clone());
        move |_, _| {
            let (mut client, held) = (client.clone(), held.clone());
            async move { client.try_start(try_start(&held)).await.map(drop) }
        }
    });
    let during = lifecycles(&client, CALLERS, &format!("during{suffix}"));
    tokio::time::sleep(Duration::from_secs(10)).await;
    let during = during.finish().await.expect("the held run");
    hold.release().await;
    let askers = askers.finish().await.expect("the askers");

    let after = lifecycles(&client, CALLERS, &format!("after{suffix}"));
    tokio::time::sleep(unheld_phase).await;
    let after = after.finish().await.expect("the unheld run after");

    let unheld_rate = (before.successes() + after.successes()) as f64
        / (before.elapsed + after.elapsed).as_secs_f64();
    let unheld_p99 = before.quantile_ms(0.99).max(after.quantile_ms(0.99));
    println!(
        "unheld: {unheld_rate:.0}/s p99 {unheld_p99:.1} ms; held: {:.0}/s p99 {:.1} ms, {} errors; \
         the held key's askers: {} answered, {} told to retry",
        during.per_second(),
        during.quantile_ms(0.99),
        during.failures.len(),
        askers.successes(),
        askers.failures.len(),
    );
    assert!(
        during.failures.is_empty(),
        "the other callers failed: {:?}",
        &during.failures[..during.failures.len().min(5)]
    );
    assert!(
        during.per_second() >= 0.8 * unheld_rate,
        "{:.0}/s while the key was held, against {unheld_rate:.0}/s",
        during.per_second()
    );
    assert!(
        during.quantile_ms(0.99) <= 2.0 * unheld_p99,
        "p99 {:.1} ms while the key was held, against {unheld_p99:.1} ms",
        during.quantile_ms(0.99)
    );
    assert!(
        !askers.failures.is_empty()
            && askers
                .failures
                .iter()
                .all(|status| status.code() == Code::Unavailable),
        "the held key's askers are told to retry: {:?}",
        &askers.failures[..askers.failures.len().min(5)]
    );
}

/// A statement the database stops answering (its session stopped, as a disk that hangs would
/// stall it) delays the calls queued behind it by 50 ms at most: their batch then runs beside
/// it, on another connection, while it goes on.
#[tokio::test]
async fn a_stalled_statement_does_not_hold_up_the_calls_queued_behind_it() {
    // Not warmed up: every connection open when the stall begins is stalled, and the calls
    // behind must find one that is not (a new one) to show that they do not wait.
    let (app, _bouncer) = started(Route::Direct).await;
    let client = app.client().await;
    let suffix = unique_key("");
    // One connection open, the one the next statement takes; it is stalled.
    claim(&mut client.clone(), try_start(&format!("warm{suffix}"))).await;
    let stall = app.database.stall_writes().await;
    let mut stalled = JoinSet::new();
    spawn_claim(&mut stalled, &client, &format!("stalled{suffix}"));
    app.wait_for_blocked_calls(1).await;

    let mut calls = JoinSet::new();
    for other in 0..20 {
        spawn_claim(&mut calls, &client, &format!("b-{other:02}{suffix}"));
    }
    let answers = joined(calls).await;
    for call in &answers {
        assert!(
            matches!(call.answer, Ok(Outcome::Started(_))),
            "{} is started: {:?}",
            call.key,
            call.answer
        );
        assert!(
            call.took < STALLED_AFTER + OTHERS_ANSWERED_WITHIN,
            "{} was answered after {:?}, behind the stalled statement",
            call.key,
            call.took
        );
    }
    assert!(
        !stalled.is_empty() && stalled.try_join_next().is_none(),
        "the stalled statement is still stalled"
    );
    stall.end().await;
    for call in joined(stalled).await {
        assert!(
            matches!(call.answer, Ok(Outcome::Started(_))),
            "the stalled claim is answered once its session goes on: {:?}",
            call.answer
        );
    }
}

/// How long a formed batch waits for an executor before it runs beside the stalled ones.
const STALLED_AFTER: Duration = Duration::from_millis(50);
