//! Model check: random sequences of all six RPCs over a few keys and event ids, run against the
//! real server, each answer compared with a small reference model of the contract written here.
//! Leases are long, so nothing expires within a sequence; expiry and takeover have their own
//! tests with short real TTLs. Every sequence runs in a namespace (and consumer) of its own.
//!
//! Here the reference model and the runner; in `ops` the random operations, in `apply` each
//! operation run against the server and its answer compared with the model.

mod apply;
mod linearizable;
mod ops;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use proptest::test_runner::{Config, TestCaseError, TestRunner};
use tonic::Code;

use crate::support::*;

use apply::apply;
use ops::{TokenChoice, op};

const KEYS: usize = 3;
const EVENTS: usize = 4;
const FINGERPRINTS: [&[u8]; 2] = [b"fingerprint-a", b"fingerprint-b"];
const ATTEMPTS: [&str; 3] = ["", "attempt-1", "attempt-2"];
const RESPONSES: [&[u8]; 2] = [b"response-a", b"response-b"];

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
        choice.pick(&self.tokens[key])
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
