//! Model check: random sequences of all six RPCs over a few keys and event ids, run against the
//! real server, each answer compared with a small reference model of the contract written here.
//! Leases are long, so nothing expires within a sequence; expiry and takeover have their own
//! tests with short real TTLs. Every sequence runs in a namespace (and consumer) of its own.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use idempotency_coordinator::proto::idempotency::v1::{
    self as pb, lookup_response::State, try_start_response::Outcome,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use tonic::Code;

use crate::support::*;

const KEYS: usize = 3;
const EVENTS: usize = 4;
const FINGERPRINTS: [&[u8]; 2] = [b"fingerprint-a", b"fingerprint-b"];
const ATTEMPTS: [&str; 3] = ["", "attempt-1", "attempt-2"];
const RESPONSES: [&[u8]; 2] = [b"response-a", b"response-b"];

/// Which token a call presents.
#[derive(Debug, Clone, Copy)]
enum TokenChoice {
    /// The key's current token (or its last one, if it has none now).
    Current,
    /// A token the key had before its current one (or a stranger's, if none).
    Previous,
    /// A token that was never issued.
    Bogus,
}

#[derive(Debug, Clone)]
enum Op {
    TryStart {
        key: usize,
        fingerprint: usize,
        attempt: usize,
    },
    Complete {
        key: usize,
        token: TokenChoice,
        response: usize,
    },
    Release {
        key: usize,
        token: TokenChoice,
    },
    ExtendLease {
        key: usize,
        token: TokenChoice,
        checkpoint: Option<Vec<u8>>,
    },
    Lookup {
        key: usize,
    },
    MarkProcessed {
        events: Vec<usize>,
    },
}

fn token_choice() -> impl Strategy<Value = TokenChoice> {
    prop_oneof![
        3 => Just(TokenChoice::Current),
        1 => Just(TokenChoice::Previous),
        1 => Just(TokenChoice::Bogus),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let key = 0..KEYS;
    prop_oneof![
        4 => (key.clone(), 0..FINGERPRINTS.len(), 0..ATTEMPTS.len())
            .prop_map(|(key, fingerprint, attempt)| Op::TryStart { key, fingerprint, attempt }),
        3 => (key.clone(), token_choice(), 0..RESPONSES.len())
            .prop_map(|(key, token, response)| Op::Complete { key, token, response }),
        2 => (key.clone(), token_choice()).prop_map(|(key, token)| Op::Release { key, token }),
        2 => (
            key.clone(),
            token_choice(),
            proptest::option::of(proptest::collection::vec(any::<u8>(), 0..4)),
        )
            .prop_map(|(key, token, checkpoint)| Op::ExtendLease { key, token, checkpoint }),
        2 => key.prop_map(|key| Op::Lookup { key }),
        2 => proptest::collection::vec(0..EVENTS, 1..6)
            .prop_map(|events| Op::MarkProcessed { events }),
    ]
}

#[derive(Debug, Clone)]
enum KeyModel {
    Absent,
    InProgress {
        token: u64,
        attempt_id: &'static str,
        fingerprint: usize,
        checkpoint: Option<Vec<u8>>,
        lease_expires_at: Option<prost_types::Timestamp>,
    },
    Completed {
        fingerprint: usize,
        response: usize,
        completed_at: Option<prost_types::Timestamp>,
        expires_at: Option<prost_types::Timestamp>,
    },
}

/// The reference model: what the contract says each key and event is.
struct Model {
    keys: Vec<KeyModel>,
    /// Every token each key ever had, oldest first.
    tokens: Vec<Vec<u64>>,
    /// The highest token seen anywhere: tokens come from one sequence.
    highest_token: u64,
    /// First processing of each event.
    processed: BTreeMap<usize, prost_types::Timestamp>,
}

fn check(condition: bool, message: impl FnOnce() -> String) -> Result<(), TestCaseError> {
    if condition {
        Ok(())
    } else {
        Err(TestCaseError::fail(message()))
    }
}

fn reason(status: &tonic::Status) -> (Code, String) {
    let reason = tonic_types::StatusExt::get_error_details(status)
        .error_info()
        .map(|info| info.reason.clone())
        .unwrap_or_default();
    (status.code(), reason)
}

/// Compares a guarded write's answer with the model's expectation: the expected refusal (code
/// and reason), or success, whose message is handed back.
fn compare<T: std::fmt::Debug>(
    rpc: &str,
    expected: Option<(Code, &'static str)>,
    answer: Result<tonic::Response<T>, tonic::Status>,
) -> Result<Option<T>, TestCaseError> {
    match (expected, answer) {
        (Some(refusal), Err(status)) => {
            check(reason(&status) == (refusal.0, refusal.1.into()), || {
                format!("{rpc} refused with {status:?}, expected {refusal:?}")
            })?;
            Ok(None)
        }
        (None, Ok(response)) => Ok(Some(response.into_inner())),
        (expected, got) => Err(TestCaseError::fail(format!(
            "{rpc} expected {expected:?}, got {got:?}"
        ))),
    }
}

impl Model {
    fn new() -> Self {
        Self {
            keys: vec![KeyModel::Absent; KEYS],
            tokens: vec![Vec::new(); KEYS],
            highest_token: 0,
            processed: BTreeMap::new(),
        }
    }

    fn token(&self, key: usize, choice: TokenChoice) -> u64 {
        let history = &self.tokens[key];
        match choice {
            TokenChoice::Current => history.last().copied().unwrap_or(1),
            TokenChoice::Previous => history
                .len()
                .checked_sub(2)
                .map(|i| history[i])
                .unwrap_or(i64::MAX as u64 - 1),
            TokenChoice::Bogus => i64::MAX as u64,
        }
    }

    /// The refusal a guarded write on `key` with `token` must meet, if any (the contract's
    /// order: absent, then not the current token, then completed).
    fn refusal(&self, key: usize, token: u64) -> Option<(Code, &'static str)> {
        match &self.keys[key] {
            KeyModel::Absent => Some((Code::NotFound, "KEY_NOT_FOUND")),
            KeyModel::InProgress { token: current, .. } if *current != token => {
                Some((Code::Aborted, "LEASE_LOST"))
            }
            KeyModel::Completed { .. } if self.tokens[key].last() != Some(&token) => {
                Some((Code::Aborted, "LEASE_LOST"))
            }
            _ => None,
        }
    }

    fn issued(&mut self, key: usize, token: u64) -> Result<(), TestCaseError> {
        check(token > self.highest_token, || {
            format!(
                "token {token} is not above every earlier one ({})",
                self.highest_token
            )
        })?;
        self.highest_token = token;
        self.tokens[key].push(token);
        Ok(())
    }
}

async fn apply(
    client: &mut Client,
    scope: &str,
    model: &mut Model,
    op: &Op,
) -> Result<(), TestCaseError> {
    let key_name = |key: usize| format!("key-{key}");
    match op.clone() {
        Op::TryStart {
            key,
            fingerprint,
            attempt,
        } => {
            let answer = client
                .try_start(pb::TryStartRequest {
                    namespace: scope.into(),
                    key: key_name(key),
                    fingerprint: FINGERPRINTS[fingerprint].to_vec(),
                    lease_ttl: None,
                    retention: None,
                    attempt_id: ATTEMPTS[attempt].into(),
                    wait: None,
                })
                .await
                .map_err(|s| TestCaseError::fail(format!("TryStart failed: {s:?}")))?;
            let got = outcome(answer.into_inner());
            match (&mut model.keys[key], got) {
                (KeyModel::Absent, Outcome::Started(started)) => {
                    check(started.attempt == 1 && started.checkpoint.is_none(), || {
                        format!("a fresh claim: {started:?}")
                    })?;
                    model.issued(key, started.lease_token)?;
                    model.keys[key] = KeyModel::InProgress {
                        token: started.lease_token,
                        attempt_id: ATTEMPTS[attempt],
                        fingerprint,
                        checkpoint: None,
                        lease_expires_at: started.lease_expires_at,
                    };
                }
                (
                    KeyModel::InProgress {
                        fingerprint: held, ..
                    }
                    | KeyModel::Completed {
                        fingerprint: held, ..
                    },
                    Outcome::FingerprintMismatch(_),
                ) if *held != fingerprint => {}
                (
                    KeyModel::InProgress {
                        token,
                        attempt_id,
                        fingerprint: held,
                        checkpoint,
                        lease_expires_at,
                    },
                    got,
                ) if *held == fingerprint => {
                    if !attempt_id.is_empty() && *attempt_id == ATTEMPTS[attempt] {
                        let Outcome::Started(again) = got else {
                            return Err(TestCaseError::fail(format!("re-entry answered {got:?}")));
                        };
                        check(
                            again.lease_token == *token
                                && again.attempt == 1
                                && again.checkpoint == *checkpoint,
                            || format!("re-entry answered {again:?}"),
                        )?;
                        *lease_expires_at = again.lease_expires_at;
                    } else {
                        let Outcome::InProgress(busy) = got else {
                            return Err(TestCaseError::fail(format!(
                                "expected in_progress: {got:?}"
                            )));
                        };
                        check(
                            busy.attempt == 1 && busy.lease_expires_at == *lease_expires_at,
                            || format!("in_progress answered {busy:?}"),
                        )?;
                    }
                }
                (
                    KeyModel::Completed {
                        fingerprint: held,
                        response,
                        completed_at,
                        expires_at,
                    },
                    Outcome::Completed(done),
                ) if *held == fingerprint => {
                    check(
                        done.response == RESPONSES[*response]
                            && done.completed_at == *completed_at
                            && done.expires_at == *expires_at,
                        || format!("replay answered {done:?}"),
                    )?;
                }
                (state, got) => {
                    return Err(TestCaseError::fail(format!(
                        "TryStart({fingerprint}, {:?}) on {state:?} answered {got:?}",
                        ATTEMPTS[attempt]
                    )));
                }
            }
        }
        Op::Complete {
            key,
            token,
            response,
        } => {
            let token = model.token(key, token);
            let answer = client
                .complete(pb::CompleteRequest {
                    namespace: scope.into(),
                    key: key_name(key),
                    lease_token: token,
                    response: RESPONSES[response].to_vec(),
                    retention: None,
                })
                .await;
            let expected = model.refusal(key, token).or(match &model.keys[key] {
                KeyModel::Completed { response: held, .. } if *held != response => {
                    Some((Code::FailedPrecondition, "ALREADY_COMPLETED"))
                }
                _ => None,
            });
            if let Some(done) = compare("Complete", expected, answer)? {
                match &model.keys[key] {
                    KeyModel::Completed {
                        completed_at,
                        expires_at,
                        ..
                    } => check(
                        done.completed_at == *completed_at && done.expires_at == *expires_at,
                        || format!("a repeated Complete answered {done:?}"),
                    )?,
                    KeyModel::InProgress { fingerprint, .. } => {
                        model.keys[key] = KeyModel::Completed {
                            fingerprint: *fingerprint,
                            response,
                            completed_at: done.completed_at,
                            expires_at: done.expires_at,
                        };
                    }
                    KeyModel::Absent => unreachable!("absent keys are refused"),
                }
            }
        }
        Op::Release { key, token } => {
            let token = model.token(key, token);
            let answer = client
                .release(pb::ReleaseRequest {
                    namespace: scope.into(),
                    key: key_name(key),
                    lease_token: token,
                })
                .await;
            let expected = model.refusal(key, token).or(match &model.keys[key] {
                KeyModel::Completed { .. } => Some((Code::FailedPrecondition, "ALREADY_COMPLETED")),
                _ => None,
            });
            if compare("Release", expected, answer)?.is_some() {
                model.keys[key] = KeyModel::Absent;
            }
        }
        Op::ExtendLease {
            key,
            token,
            checkpoint,
        } => {
            let token = model.token(key, token);
            let answer = client
                .extend_lease(pb::ExtendLeaseRequest {
                    namespace: scope.into(),
                    key: key_name(key),
                    lease_token: token,
                    lease_ttl: None,
                    checkpoint: checkpoint.clone(),
                })
                .await;
            let expected = model.refusal(key, token).or(match &model.keys[key] {
                KeyModel::Completed { .. } => Some((Code::FailedPrecondition, "ALREADY_COMPLETED")),
                _ => None,
            });
            if let Some(extended) = compare("ExtendLease", expected, answer)?
                && let KeyModel::InProgress {
                    checkpoint: held,
                    lease_expires_at,
                    ..
                } = &mut model.keys[key]
            {
                if checkpoint.is_some() {
                    *held = checkpoint;
                }
                *lease_expires_at = extended.lease_expires_at;
            }
        }
        Op::Lookup { key } => {
            let answer = client
                .lookup(pb::LookupRequest {
                    namespace: scope.into(),
                    key: key_name(key),
                })
                .await
                .map_err(|s| TestCaseError::fail(format!("Lookup failed: {s:?}")))?;
            let got = state(answer.into_inner());
            let matches = match (&model.keys[key], &got) {
                (KeyModel::Absent, State::Absent(_)) => true,
                (
                    KeyModel::InProgress {
                        fingerprint,
                        lease_expires_at,
                        ..
                    },
                    State::InProgress(held),
                ) => {
                    held.fingerprint == FINGERPRINTS[*fingerprint]
                        && held.attempt == 1
                        && held.lease_expires_at == *lease_expires_at
                }
                (
                    KeyModel::Completed {
                        fingerprint,
                        response,
                        completed_at,
                        expires_at,
                    },
                    State::Completed(done),
                ) => {
                    done.fingerprint == FINGERPRINTS[*fingerprint]
                        && done.response == RESPONSES[*response]
                        && done.completed_at == *completed_at
                        && done.expires_at == *expires_at
                }
                _ => false,
            };
            check(matches, || {
                format!("Lookup answered {got:?} for {:?}", model.keys[key])
            })?;
        }
        Op::MarkProcessed { events } => {
            let answer = client
                .mark_processed(pb::MarkProcessedRequest {
                    consumer: scope.into(),
                    event_ids: events.iter().map(|e| format!("event-{e}")).collect(),
                    retention: None,
                })
                .await
                .map_err(|s| TestCaseError::fail(format!("MarkProcessed failed: {s:?}")))?;
            let results = answer.into_inner().results;
            check(results.len() == events.len(), || {
                format!("{} results for {} ids", results.len(), events.len())
            })?;
            for (event, result) in events.iter().zip(&results) {
                check(result.event_id == format!("event-{event}"), || {
                    format!("results out of request order: {results:?}")
                })?;
                let processed_at = result.processed_at.unwrap_or_default();
                match model.processed.get(event) {
                    Some(first) => {
                        check(result.already_processed && processed_at == *first, || {
                            format!("event-{event} seen before, answered {result:?}")
                        })?
                    }
                    None => {
                        check(!result.already_processed, || {
                            format!("event-{event} is new, answered {result:?}")
                        })?;
                        model.processed.insert(*event, processed_at);
                    }
                }
            }
        }
    }
    Ok(())
}

fn model_check(backend: Backend) {
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let app = runtime.block_on(TestApp::spawn(backend));
    let client = runtime.block_on(app.client());
    let cases = AtomicUsize::new(0);
    let operations = AtomicUsize::new(0);
    let mut runner = TestRunner::new(Config {
        cases: 128,
        failure_persistence: None,
        ..Config::default()
    });
    let sequences = proptest::collection::vec(op(), 1..40);
    let result = runner.run(&sequences, |ops| {
        let case = cases.fetch_add(1, Ordering::Relaxed);
        operations.fetch_add(ops.len(), Ordering::Relaxed);
        let scope = format!("model-{case}");
        let mut client = client.clone();
        runtime.block_on(async {
            let mut model = Model::new();
            for op in &ops {
                apply(&mut client, &scope, &mut model, op).await?;
            }
            Ok(())
        })
    });
    if let Err(failure) = result {
        panic!("the server disagreed with the model: {failure}");
    }
    println!(
        "model check ({backend:?}): {} sequences, {} RPCs compared with the model, 0 disagreements",
        cases.load(Ordering::Relaxed),
        operations.load(Ordering::Relaxed)
    );
    drop(client);
    runtime.block_on(async move { drop(app) });
}

#[test]
fn the_postgres_store_agrees_with_the_model() {
    model_check(Backend::Postgres);
}

#[test]
fn the_sqlite_store_agrees_with_the_model() {
    model_check(Backend::Sqlite);
}
