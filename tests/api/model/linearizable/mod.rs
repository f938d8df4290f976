//! The concurrent, time-aware model check: 8–16 callers at once over three keys and four event
//! ids, all six RPCs, short leases and retentions, pauses (by the database clock) that let them
//! run out, the reaper running every 300 ms (two rows a statement), coalescing on with batches actually formed (read
//! from `idempotency_coalesced_batch_size`); each history, recorded with every call's window
//! by the database clock, is checked for linearizability against the sequential specification
//! in `spec.rs` with stateright's `LinearizabilityTester`.
//!
//! The history is checked object by object: each key on its own and the events together
//! (linearizability is local: a history is linearizable exactly when each object's is), which
//! keeps the search small. What spans keys is checked beside it: tokens come from one
//! sequence, so no token is ever given to two keys, and a token handed out (its first answer)
//! before another claim began is below that claim's.
//!
//! Replay: a failure prints its seed; `LINEARIZABILITY_SEED=<seed>` runs the same plans again
//! (the server's answers still depend on timing). Proptest shrinks the failing plan and saves
//! it in `tests/api/model/linearizable.proptest-regressions`, which later runs try first.

mod history;
mod plan;
mod spec;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use proptest::test_runner::{
    Config, FileFailurePersistence, RngAlgorithm, TestCaseError, TestRng, TestRunner,
};
use stateright::semantics::{ConsistencyTester, LinearizabilityTester};

use crate::support::*;

use history::{Answered, Call, Event, Offset, Recorder, run_caller};
use plan::{KEYS, Pause, Plan, plan};
use spec::{EventsSpec, KeyRet, KeySpec, Timed};

/// The flags of every server in the check: the reaper in small batches, so that it interleaves
/// with the calls, and every second, slower than the pause that lets retentions run out, so that
/// the next phase meets rows that have expired but are not reaped yet (absent all the same) in
/// every configuration, one replica (one reaper) as often as two; metrics, to see the batches.
const FLAGS: &[&str] = &[
    "--metrics-listen",
    "127.0.0.1:0",
    "--reaper-interval",
    "1s",
    "--reaper-batch-size",
    "2",
];

/// Checks a recorded history; the error says which object's history is not linearizable.
fn check(events: &[Event]) -> Result<(), String> {
    let mut keys: Vec<LinearizabilityTester<usize, KeySpec>> = (0..KEYS)
        .map(|_| LinearizabilityTester::new(KeySpec::default()))
        .collect();
    let mut marks = LinearizabilityTester::new(EventsSpec::default());
    let mut open: BTreeMap<usize, Option<usize>> = BTreeMap::new();
    for event in events {
        match event {
            Event::Invoked { caller, call, lo } => match call {
                Call::Key { key, op } => {
                    let key = usize::from(*key);
                    keys[key].on_invoke(
                        *caller,
                        Timed {
                            op: op.clone(),
                            lo: *lo,
                        },
                    )?;
                    open.insert(*caller, Some(key));
                }
                Call::Events(op) => {
                    marks.on_invoke(
                        *caller,
                        Timed {
                            op: op.clone(),
                            lo: *lo,
                        },
                    )?;
                    open.insert(*caller, None);
                }
            },
            Event::Returned { caller, answer, hi } => match (open.remove(caller), answer) {
                (Some(Some(key)), Answered::Key(ret)) => {
                    keys[key].on_return(
                        *caller,
                        spec::Answer {
                            ret: Some(ret.clone()),
                            hi: *hi,
                        },
                    )?;
                }
                (Some(None), Answered::Events(ret)) => {
                    marks.on_return(
                        *caller,
                        spec::Answer {
                            ret: Some(ret.clone()),
                            hi: *hi,
                        },
                    )?;
                }
                other => {
                    return Err(format!(
                        "caller {caller}: a return without its call: {other:?}"
                    ));
                }
            },
        }
    }
    for (key, tester) in keys.iter().enumerate() {
        if !tester.is_consistent() {
            return Err(format!(
                "key-{key}'s history is not linearizable:\n{}",
                describe(
                    events,
                    |call| matches!(call, Call::Key { key: k, .. } if usize::from(*k) == key)
                )
            ));
        }
    }
    if !marks.is_consistent() {
        return Err(format!(
            "the events' history is not linearizable:\n{}",
            describe(events, |call| matches!(call, Call::Events(_)))
        ));
    }
    check_tokens(events)
}

/// One sequence of tokens across keys: a token belongs to one key only, and a token whose first
/// answer came before another token's first call began was drawn before it, so it is lower.
fn check_tokens(events: &[Event]) -> Result<(), String> {
    // Per token: its key, the first invocation and the first answer that carried it.
    let mut first: BTreeMap<u64, (u8, usize, usize)> = BTreeMap::new();
    let mut invoked_at: BTreeMap<usize, (usize, u8)> = BTreeMap::new();
    for (position, event) in events.iter().enumerate() {
        match event {
            Event::Invoked {
                caller,
                call: Call::Key { key, .. },
                ..
            } => {
                invoked_at.insert(*caller, (position, *key));
            }
            Event::Returned {
                caller,
                answer: Answered::Key(KeyRet::Started { token, .. }),
                ..
            } => {
                let (invoked, key) = invoked_at[caller];
                let entry = first.entry(*token).or_insert((key, invoked, position));
                if entry.0 != key {
                    return Err(format!(
                        "token {token} was given to key-{} and key-{key}",
                        entry.0
                    ));
                }
                entry.1 = entry.1.min(invoked);
            }
            _ => {}
        }
    }
    for (x, (key_x, _, answered_x)) in &first {
        for (y, (key_y, invoked_y, _)) in &first {
            if answered_x < invoked_y && x > y {
                return Err(format!(
                    "token {y} (key-{key_y}) was drawn after token {x} (key-{key_x}) had been \
                     answered, yet it is lower"
                ));
            }
        }
    }
    Ok(())
}

fn describe(events: &[Event], wanted: impl Fn(&Call) -> bool) -> String {
    let mut callers: BTreeMap<usize, bool> = BTreeMap::new();
    let mut lines = Vec::new();
    for event in events {
        match event {
            Event::Invoked { caller, call, lo } => {
                let shown = wanted(call);
                callers.insert(*caller, shown);
                if shown {
                    lines.push(format!("  caller {caller:>2} calls   {call:?} (from {lo})"));
                }
            }
            Event::Returned { caller, answer, hi } => {
                if callers.get(caller).copied().unwrap_or(false) {
                    lines.push(format!(
                        "  caller {caller:>2} answered {answer:?} (by {hi})"
                    ));
                }
            }
        }
    }
    lines.join("\n")
}

/// What the histories of a run made happen: the check is only as good as the situations its
/// histories reach, so the run goes on (with more plans) until each has occurred.
#[derive(Debug, Default, Clone, Copy)]
struct Coverage {
    takeovers: usize,
    reentries: usize,
    /// A claim seen in progress after its lease had ended, nobody having taken it over.
    abandoned: usize,
    /// A key claimed earlier answered as absent (released, or past its retention).
    absent_again: usize,
    /// An event recorded anew after its retention.
    events_again: usize,
    /// Expired rows still in the store at the end of a pause (the most seen at once).
    expired_unreaped: i64,
    reaped: f64,
    shared_batches: f64,
    /// TryStarts answered from their key's call in the round before, without a statement.
    followers: f64,
}

impl Coverage {
    fn add(&mut self, events: &[Event]) {
        let mut calls: BTreeMap<usize, (Call, spec::Micros)> = BTreeMap::new();
        let mut tokens: BTreeMap<u8, u64> = BTreeMap::new();
        let mut processed = std::collections::BTreeSet::new();
        for event in events {
            match event {
                Event::Invoked { caller, call, lo } => {
                    calls.insert(*caller, (call.clone(), *lo));
                }
                Event::Returned { caller, answer, .. } => {
                    let Some((call, lo)) = calls.get(caller) else {
                        continue;
                    };
                    match (call, answer) {
                        (Call::Key { key, .. }, Answered::Key(ret)) => match ret {
                            KeyRet::Started { token, attempt, .. } => {
                                let before = tokens.insert(*key, *token);
                                self.takeovers +=
                                    usize::from(*attempt > 1 && before != Some(*token));
                                self.reentries += usize::from(before == Some(*token));
                                self.absent_again += usize::from(
                                    *attempt == 1 && before.is_some_and(|t| t != *token),
                                );
                            }
                            KeyRet::InProgress {
                                lease_expires_at, ..
                            }
                            | KeyRet::LookedUpInProgress {
                                lease_expires_at, ..
                            } => {
                                self.abandoned += usize::from(lease_expires_at < lo);
                            }
                            KeyRet::Absent | KeyRet::Refused(spec::Refusal::KeyNotFound) => {
                                self.absent_again += usize::from(tokens.contains_key(key));
                            }
                            _ => {}
                        },
                        (Call::Events(op), Answered::Events(results)) => {
                            for (event, (already, _)) in op.events.iter().zip(results) {
                                self.events_again +=
                                    usize::from(!already && processed.contains(event));
                                processed.insert(*event);
                            }
                        }
                        _ => {}
                    }
                }
            }
        }
    }

    fn complete(&self) -> bool {
        self.takeovers > 0
            && self.reentries > 0
            && self.abandoned > 0
            && self.absent_again > 0
            && self.events_again > 0
            && self.expired_unreaped > 0
            && self.reaped > 0.0
            && self.shared_batches > 0.0
            && self.followers > 0.0
    }
}

/// Rows the reaper deleted, so far.
async fn reaped(app: &TestApp) -> f64 {
    let samples = crate::metrics::samples(&crate::metrics::scrape(app).await);
    ["keys", "events"]
        .iter()
        .map(|table| {
            samples
                .get(&format!(
                    "idempotency_reaped_rows_total{{table=\"{table}\"}}"
                ))
                .copied()
                .unwrap_or(0.0)
        })
        .sum()
}

/// How many batches of TryStart or Complete carried more than one call, so far (MarkProcessed
/// weighs ids, so one call alone can weigh more than one).
async fn shared_batches(app: &TestApp) -> f64 {
    let samples = crate::metrics::samples(&crate::metrics::scrape(app).await);
    ["TryStart", "Complete"]
        .iter()
        .map(|coalescer| crate::metrics::batches_of_several(&samples, coalescer))
        .sum()
}

/// TryStarts a coalescer answered from the store's answer to their key's call in the round
/// before, so far.
async fn followers(app: &TestApp) -> f64 {
    let samples = crate::metrics::samples(&crate::metrics::scrape(app).await);
    samples
        .get("idempotency_coalesced_followers_total{coalescer=\"TryStart\"}")
        .copied()
        .unwrap_or(0.0)
}

fn seed() -> u64 {
    std::env::var("LINEARIZABILITY_SEED")
        .ok()
        .and_then(|seed| seed.parse().ok())
        .unwrap_or_else(|| {
            let random = uuid::Uuid::new_v4().as_u128();
            u64::try_from(random & u128::from(u64::MAX)).unwrap_or_default()
        })
}

/// Runs `cases` plans from `seed` against `clients`, checking each history.
fn run_plans(
    runtime: &tokio::runtime::Runtime,
    app: &TestApp,
    clients: &[Client],
    seed: u64,
    cases: u32,
    coverage: &Mutex<Coverage>,
) -> Result<(), String> {
    let mut seed_bytes = [0u8; 32];
    seed_bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let mut runner = TestRunner::new_with_rng(
        Config {
            cases,
            failure_persistence: Some(Box::new(FileFailurePersistence::Direct(
                "tests/api/model/linearizable.proptest-regressions",
            ))),
            max_shrink_iters: 24,
            ..Config::default()
        },
        TestRng::from_seed(RngAlgorithm::ChaCha, &seed_bytes),
    );
    let histories = AtomicUsize::new(0);
    let result = runner.run(&plan(), |plan: Plan| {
        let history = histories.fetch_add(1, Ordering::Relaxed);
        runtime.block_on(async {
            let recorder = Arc::new(Recorder::new(
                format!("lin-{seed}-{history}"),
                Offset::measure(app).await,
            ));
            for phase in plan.phases {
                let callers = phase
                    .callers
                    .into_iter()
                    .enumerate()
                    .map(|(caller, steps)| {
                        let client = clients[caller % clients.len()].clone();
                        tokio::spawn(run_caller(recorder.clone(), client, caller, steps))
                    });
                for caller in futures::future::join_all(callers).await {
                    caller.map_err(|e| TestCaseError::fail(format!("a caller panicked: {e}")))?;
                }
                recorder.pause(app, phase.pause).await;
                if phase.pause == Pause::Retentions {
                    let expired = app.database.count_expired_rows().await;
                    let mut coverage = coverage.lock().expect("coverage");
                    coverage.expired_unreaped = coverage.expired_unreaped.max(expired);
                }
            }
            let unexpected = recorder.unexpected.lock().expect("unexpected").clone();
            if !unexpected.is_empty() {
                return Err(TestCaseError::fail(format!(
                    "calls failed: {unexpected:#?}"
                )));
            }
            let events = recorder.events();
            coverage.lock().expect("coverage").add(&events);
            check(&events).map_err(TestCaseError::fail)
        })
    });
    result.map_err(|failure| failure.to_string())
}

/// The check on one store: rounds of plans (each from its own seed, derived from the run's)
/// until every situation of [`Coverage`] has occurred, at most `ROUNDS`.
fn linearizability_check(backend: Backend, replicas: bool, extra: &[&str]) {
    // Takeovers are the rarest situation: about 3 in 4 rounds on SQLite, so 4 rounds missed
    // them all about once in 20 runs (CI saw it, seed 10247103664391342743). 10 rounds make
    // that about once in 2,000; a run that is complete sooner stops sooner.
    const ROUNDS: u64 = 10;
    let seed = seed();
    let cases: u32 = std::env::var("LINEARIZABILITY_CASES")
        .ok()
        .and_then(|cases| cases.parse().ok())
        .unwrap_or(5);
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let flags: Vec<&str> = FLAGS.iter().chain(extra).copied().collect();
    let app = runtime.block_on(TestApp::spawn_with(backend, &flags));
    let replica = replicas.then(|| runtime.block_on(app.replica(&flags[2..])));
    let mut clients = vec![runtime.block_on(app.client())];
    if let Some(replica) = &replica {
        clients.push(runtime.block_on(replica.client()));
    }
    let (batched_before, reaped_before, followed_before) = runtime.block_on(async {
        (
            shared_batches(&app).await,
            reaped(&app).await,
            followers(&app).await,
        )
    });
    let coverage = Mutex::new(Coverage::default());
    let mut rounds = 0;
    while rounds < ROUNDS && !coverage.lock().expect("coverage").complete() {
        let round_seed = seed.wrapping_add(rounds);
        if let Err(failure) = run_plans(&runtime, &app, &clients, round_seed, cases, &coverage) {
            panic!(
                "linearizability check ({backend:?}, replicas: {replicas}) failed; replay with \
                 LINEARIZABILITY_SEED={seed} (round {rounds}): {failure}"
            );
        }
        rounds += 1;
        let mut coverage = coverage.lock().expect("coverage");
        coverage.shared_batches = runtime.block_on(shared_batches(&app)) - batched_before;
        coverage.reaped = runtime.block_on(reaped(&app)) - reaped_before;
        coverage.followers = runtime.block_on(followers(&app)) - followed_before;
    }
    let coverage = *coverage.lock().expect("coverage");
    println!(
        "linearizability check ({backend:?}, replicas: {replicas}, LINEARIZABILITY_SEED={seed}): \
         {rounds} rounds of {cases} histories, all linearizable; {coverage:?}"
    );
    assert!(
        coverage.complete(),
        "after {rounds} rounds some situation never occurred: {coverage:?}"
    );
    drop(clients);
    runtime.block_on(async move {
        drop(replica);
        drop(app)
    });
}

#[test]
fn linearizable_on_postgres() {
    linearizability_check(Backend::Postgres, false, &["--coalesce-executors", "1"]);
}

#[test]
fn linearizable_on_postgres_with_two_replicas() {
    linearizability_check(Backend::Postgres, true, &[]);
}

#[test]
fn linearizable_on_sqlite() {
    linearizability_check(Backend::Sqlite, false, &[]);
}
