//! The scenario vectors in `clients/conformance/scenarios.json`, which every client runs: the
//! Rust client's `run_once` against a real coordinator, with `fault-proxy` between them putting
//! in the faults each scenario names (lost answers, refusals at the door, an unreachable
//! coordinator). The vectors' format is in `clients/conformance/README.md`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_client::{Error, Lease, Outcome, RetryPolicy, RunError};
use idempotency_coordinator::proto::idempotency::v1::lookup_response::State;
use idempotency_coordinator::proto::idempotency::v1::try_start_response::Outcome as TryStartOutcome;
use idempotency_testkit::FaultProxy;
use serde::Deserialize;
use serde_json::Value;
use tokio::sync::{Notify, oneshot};
use tokio::task::JoinHandle;

use crate::support::*;

/// How long any one wait of a scenario may take before the scenario fails.
const PATIENCE: Duration = Duration::from_secs(20);
const NAMESPACE: &str = "scenarios";

#[derive(Deserialize)]
struct Scenarios {
    scenarios: Vec<Scenario>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Scenario {
    name: String,
    #[allow(dead_code)] // for the reader of the vectors
    what: String,
    #[serde(default)]
    client: ClientSettings,
    steps: Vec<Step>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct ClientSettings {
    retry_budget_ms: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Step {
    run: Option<RunStep>,
    join: Option<String>,
    expect: Option<Expect>,
    await_started: Option<String>,
    open_gate: Option<String>,
    fault: Option<Value>,
    refuse: Option<bool>,
    restore: Option<bool>,
    reset: Option<bool>,
    await_calls: Option<Calls>,
    expect_calls: Option<Calls>,
    expect_key: Option<KeyState>,
    claim: Option<ClaimStep>,
    pause_ms: Option<u64>,
}

/// A holder whose process died: one bare TryStart, nothing after it.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ClaimStep {
    key: String,
    request: Value,
    lease_ttl_ms: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RunStep {
    #[serde(rename = "as")]
    name: Option<String>,
    key: String,
    request: Value,
    wait_ms: Option<u64>,
    lease_ttl_ms: Option<u64>,
    work: Work,
}

#[derive(Deserialize, Clone)]
#[serde(deny_unknown_fields)]
struct Work {
    result: Option<Value>,
    fail: Option<String>,
    #[serde(default)]
    gate: bool,
    #[serde(default)]
    until_cancelled: bool,
    duration_ms: Option<u64>,
    #[serde(default)]
    refuse_at_end: bool,
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct Expect {
    result: Option<Value>,
    error: Option<String>,
    carried_result: Option<Value>,
    work_ran: Option<bool>,
    work_cancelled: Option<bool>,
    attempt: Option<u32>,
    min_elapsed_ms: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Calls {
    method: String,
    count: usize,
    min_gap_ms: Option<f64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyState {
    key: String,
    state: String,
}

/// The work's own failure, which run_once must hand back unchanged.
#[derive(Debug, PartialEq)]
struct WorkFailed(String);

/// What one run did, as the work saw it and as run_once answered.
struct Report {
    answer: Result<Outcome<Value>, RunError<WorkFailed>>,
    ran: bool,
    cancelled: bool,
    attempt: Option<u32>,
    /// What the work failed with, when it failed.
    failure: Option<String>,
    /// How long run_once took, from just before the call to its outcome.
    elapsed: Duration,
}

/// A run in the background: its gate, the signal that its work started, and its report.
struct Running {
    started: Arc<Notify>,
    has_started: Arc<AtomicBool>,
    gate: Option<oneshot::Sender<()>>,
    report: JoinHandle<Report>,
}

struct Runner {
    raw: Client,
    proxy: Arc<FaultProxy>,
    client: idempotency_client::Client,
    keys: HashMap<String, String>,
    running: HashMap<String, Running>,
}

impl Runner {
    fn key(&mut self, name: &str) -> String {
        self.keys
            .entry(name.to_owned())
            .or_insert_with(|| unique_key(name))
            .clone()
    }

    fn start(&mut self, run: &RunStep) -> Running {
        let key = self.key(&run.key);
        let client = self.client.clone();
        let (request, wait, lease_ttl) = (run.request.clone(), run.wait_ms, run.lease_ttl_ms);
        let started = Arc::new(Notify::new());
        let has_started = Arc::new(AtomicBool::new(false));
        let (gate, gate_opened) = oneshot::channel();
        let work = run.work.clone();
        let failure = Arc::new(Mutex::new(None));
        let work_failure = failure.clone();
        let proxy = Arc::clone(&self.proxy);
        let (ran, cancelled, attempt) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicU32::new(0)),
        );
        let (work_ran, work_cancelled, work_attempt) =
            (ran.clone(), cancelled.clone(), attempt.clone());
        let (work_started, work_has_started) = (started.clone(), has_started.clone());
        let report = tokio::spawn(async move {
            let began = std::time::Instant::now();
            let mut builder = client
                .run_once::<Value, WorkFailed>(NAMESPACE, key)
                .request(&request);
            if let Some(wait) = wait {
                builder = builder.wait(Duration::from_millis(wait));
            }
            if let Some(lease_ttl) = lease_ttl {
                builder = builder.lease_ttl(Duration::from_millis(lease_ttl));
            }
            let answer = builder
                .run(move |lease: Lease| async move {
                    work_ran.store(true, Ordering::SeqCst);
                    work_attempt.store(lease.attempt(), Ordering::SeqCst);
                    work_has_started.store(true, Ordering::SeqCst);
                    work_started.notify_waiters();
                    if work.gate {
                        let _ = tokio::time::timeout(PATIENCE, gate_opened).await;
                    }
                    if work.until_cancelled
                        && tokio::time::timeout(PATIENCE, lease.cancelled())
                            .await
                            .is_ok()
                    {
                        work_cancelled.store(true, Ordering::SeqCst);
                    }
                    let fail = |message: String| {
                        *work_failure.lock().expect("lock") = Some(message.clone());
                        Err(WorkFailed(message))
                    };
                    if let Some(duration) = work.duration_ms {
                        // Working for that long, unless cancelled meanwhile.
                        if tokio::time::timeout(Duration::from_millis(duration), lease.cancelled())
                            .await
                            .is_ok()
                        {
                            work_cancelled.store(true, Ordering::SeqCst);
                            return fail(format!("cancelled within its {duration} ms"));
                        }
                    }
                    if work.refuse_at_end {
                        proxy
                            .post("/refuse", "")
                            .await
                            .expect("fault-proxy /refuse");
                    }
                    match work.fail {
                        Some(message) => fail(message),
                        None => Ok(work.result.unwrap_or(Value::Null)),
                    }
                })
                .await;
            let attempt = attempt.load(Ordering::SeqCst);
            Report {
                answer,
                ran: ran.load(Ordering::SeqCst),
                cancelled: cancelled.load(Ordering::SeqCst),
                attempt: (attempt > 0).then_some(attempt),
                failure: failure.lock().expect("lock").take(),
                elapsed: began.elapsed(),
            }
        });
        Running {
            started,
            has_started,
            gate: Some(gate),
            report,
        }
    }

    async fn step(&mut self, step: &Step) -> Result<(), String> {
        let actions = [
            step.run.is_some(),
            step.join.is_some(),
            step.await_started.is_some(),
            step.open_gate.is_some(),
            step.fault.is_some(),
            step.refuse.is_some(),
            step.restore.is_some(),
            step.reset.is_some(),
            step.await_calls.is_some(),
            step.expect_calls.is_some(),
            step.expect_key.is_some(),
            step.claim.is_some(),
            step.pause_ms.is_some(),
        ];
        if actions.iter().filter(|action| **action).count() != 1 {
            return Err("a step has exactly one action".into());
        }
        if step.expect.is_some() && step.run.is_none() && step.join.is_none() {
            return Err("only a run or a join has an expect".into());
        }
        if let Some(run) = &step.run {
            let running = self.start(run);
            match (&run.name, &step.expect) {
                (Some(name), None) => {
                    self.running.insert(name.clone(), running);
                }
                (None, Some(expect)) => check(join(running).await?, expect)?,
                _ => return Err("a run has either `as` or `expect`".into()),
            }
        } else if let Some(name) = &step.join {
            let running = self
                .running
                .remove(name)
                .ok_or(format!("no run named {name}"))?;
            let expect = step.expect.as_ref().ok_or("join without expect")?;
            check(join(running).await?, expect).map_err(|e| format!("run {name}: {e}"))?;
        } else if let Some(name) = &step.await_started {
            let running = self
                .running
                .get(name)
                .ok_or(format!("no run named {name}"))?;
            let notified = running.started.notified();
            if !running.has_started.load(Ordering::SeqCst) {
                tokio::time::timeout(PATIENCE, notified)
                    .await
                    .map_err(|_| format!("the work of {name} did not start"))?;
            }
        } else if let Some(name) = &step.open_gate {
            let gate = self
                .running
                .get_mut(name)
                .and_then(|running| running.gate.take())
                .ok_or(format!("no gate of {name} to open"))?;
            let _ = gate.send(());
        } else if let Some(fault) = &step.fault {
            self.control("/faults", &fault.to_string()).await?;
        } else if step.refuse == Some(true) {
            self.control("/refuse", "").await?;
        } else if step.restore == Some(true) {
            self.control("/restore", "").await?;
        } else if step.reset == Some(true) {
            self.control("/reset", "").await?;
        } else if let Some(calls) = &step.await_calls {
            let deadline = tokio::time::Instant::now() + PATIENCE;
            while self.calls_of(&calls.method).await?.len() < calls.count {
                if tokio::time::Instant::now() > deadline {
                    return Err(format!(
                        "{} was not called {} times",
                        calls.method, calls.count
                    ));
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        } else if let Some(calls) = &step.expect_calls {
            let seen = self.calls_of(&calls.method).await?;
            if seen.len() != calls.count {
                return Err(format!(
                    "{} called at {seen:?}, not {} times",
                    calls.method, calls.count
                ));
            }
            if let (Some(gap), [first, second, ..]) = (calls.min_gap_ms, seen.as_slice())
                && second - first < gap
            {
                return Err(format!(
                    "{} retried {} ms after, sooner than {gap} ms",
                    calls.method,
                    second - first
                ));
            }
        } else if let Some(expected) = &step.expect_key {
            let key = self
                .keys
                .get(&expected.key)
                .cloned()
                .ok_or(format!("no run used the key {}", expected.key))?;
            let mut request = lookup(&key);
            request.namespace = NAMESPACE.into();
            let state = match state(answered(self.raw.clone().lookup(request).await, "Lookup")) {
                State::Absent(_) => "absent",
                State::InProgress(_) => "in_progress",
                State::Completed(_) => "completed",
            };
            if state != expected.state {
                return Err(format!(
                    "key {} is {state}, not {}",
                    expected.key, expected.state
                ));
            }
        } else if let Some(claim) = &step.claim {
            self.claim(claim).await?;
        } else if let Some(pause) = step.pause_ms {
            // The scenario's own timing (a holder that keeps the key this long), not a wait
            // for something the runner could watch.
            tokio::time::sleep(Duration::from_millis(pause)).await;
        } else {
            return Err("a step the runner does not know".into());
        }
        Ok(())
    }

    /// One bare TryStart through the proxy, as the scenario's client sends it (the Rust client
    /// has no bare TryStart; this is the generated client on the same path): a holder that
    /// dies at once, leaving its lease to run out.
    async fn claim(&mut self, claim: &ClaimStep) -> Result<(), String> {
        let key = self.key(&claim.key);
        let fingerprint = idempotency_client::fingerprint_of(&claim.request)
            .map_err(|e| format!("the claim's request: {e}"))?;
        let mut request = try_start(&key);
        request.namespace = NAMESPACE.into();
        request.fingerprint = fingerprint;
        request.lease_ttl = millis(claim.lease_ttl_ms);
        request.attempt_id = uuid::Uuid::new_v4().simple().to_string();
        let mut through_proxy = Client::connect(self.proxy.endpoint())
            .await
            .map_err(|e| format!("connecting through the proxy: {e}"))?;
        let answer = through_proxy
            .try_start(request)
            .await
            .map_err(|status| format!("the claim's TryStart failed: {status:?}"))?;
        match answer.into_inner().outcome {
            Some(TryStartOutcome::Started(_)) => Ok(()),
            other => Err(format!("the claim was answered {other:?}, not started")),
        }
    }

    async fn control(&self, path: &str, body: &str) -> Result<(), String> {
        self.proxy
            .post(path, body)
            .await
            .map_err(|e| format!("{e:#}"))
    }

    async fn calls_of(&self, method: &str) -> Result<Vec<f64>, String> {
        let mut calls = self.proxy.calls().await.map_err(|e| format!("{e:#}"))?;
        Ok(calls.remove(method).unwrap_or_default())
    }
}

async fn join(running: Running) -> Result<Report, String> {
    tokio::time::timeout(PATIENCE * 2, running.report)
        .await
        .map_err(|_| "run_once did not end".to_owned())?
        .map_err(|e| format!("run_once panicked: {e}"))
}

/// The kind of error as the vectors name it.
fn kind(error: &RunError<WorkFailed>) -> &'static str {
    match error {
        RunError::Work(_) => "work_failed",
        RunError::Coordinator(error) => match error {
            Error::FingerprintMismatch => "mismatch",
            Error::InProgress { .. } => "in_progress",
            Error::LeaseLost(_) => "lease_lost",
            Error::ResultNotStored { .. } => "result_not_stored",
            Error::Unavailable(_) | Error::StoreUnavailable(_) => "unavailable",
            Error::Unauthenticated(_) => "unauthenticated",
            _ => "other",
        },
    }
}

fn check(report: Report, expect: &Expect) -> Result<(), String> {
    match (&report.answer, &expect.result, &expect.error) {
        (Ok(outcome), Some(result), None) if &outcome.value == result => {}
        (Err(error), None, Some(expected)) if kind(error) == expected => {
            if let RunError::Work(WorkFailed(message)) = error
                && Some(message) != report.failure.as_ref()
            {
                return Err(format!(
                    "the work failed with {:?}, not {message:?}",
                    report.failure
                ));
            }
            if let Some(carried) = &expect.carried_result {
                let response = error.coordinator().and_then(Error::unstored_response);
                let value = response.and_then(|bytes| serde_json::from_slice::<Value>(bytes).ok());
                if value.as_ref() != Some(carried) {
                    return Err(format!("carried {value:?}, not {carried}"));
                }
            }
        }
        (answer, _, _) => return Err(format!("answered {answer:?}, expected {expect:?}")),
    }
    let checks = [
        ("work_ran", expect.work_ran, report.ran),
        ("work_cancelled", expect.work_cancelled, report.cancelled),
    ];
    for (what, expected, seen) in checks {
        if expected.is_some_and(|expected| expected != seen) {
            return Err(format!("{what} was {seen}"));
        }
    }
    if expect.attempt.is_some() && expect.attempt != report.attempt {
        return Err(format!("the work saw attempt {:?}", report.attempt));
    }
    if let Some(least) = expect.min_elapsed_ms
        && report.elapsed < Duration::from_millis(least)
    {
        return Err(format!(
            "run_once took {:?}, under {least} ms",
            report.elapsed
        ));
    }
    Ok(())
}

async fn run_scenario(
    coordinator: std::net::SocketAddr,
    raw: Client,
    scenario: &Scenario,
) -> Result<(), String> {
    let proxy = FaultProxy::start(coordinator)
        .await
        .map_err(|e| format!("{e:#}"))?;
    let mut retry = RetryPolicy::default();
    if let Some(budget) = scenario.client.retry_budget_ms {
        retry.total = Duration::from_millis(budget);
    }
    let client = idempotency_client::Client::builder(proxy.endpoint())
        .retry(retry)
        .build()
        .await
        .map_err(|e| format!("connecting through the proxy: {e}"))?;
    let mut runner = Runner {
        raw,
        proxy: Arc::new(proxy),
        client,
        keys: HashMap::new(),
        running: HashMap::new(),
    };
    for (index, step) in scenario.steps.iter().enumerate() {
        runner
            .step(step)
            .await
            .map_err(|e| format!("step {}: {e}", index + 1))?;
    }
    Ok(())
}

/// Every scenario at once, each with its own proxy, client and keys, on one coordinator; the
/// failures of all of them in one message.
async fn every_scenario_holds(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    every_scenario_holds_at(app.addr).await;
}

/// [`every_scenario_holds`] on the coordinator at `coordinator`, however it was started (a
/// process serving as a restricted role, say).
pub async fn every_scenario_holds_at(coordinator: std::net::SocketAddr) {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/clients/conformance/scenarios.json"
    ))
    .expect("the scenario vectors");
    let vectors: Scenarios = serde_json::from_str(&text).expect("scenarios.json");
    assert!(!vectors.scenarios.is_empty());
    let raw = Client::connect(format!("http://{coordinator}"))
        .await
        .expect("connect to the coordinator");
    // The store's pool opened before the scenarios start all at once: a scenario whose claim
    // takes over a tenth of its lease renews it before the work (the client's rule), and a
    // cold pool's first connections (TLS, a login) must not be what decides that.
    futures::future::join_all((0..16).map(|index| {
        let mut raw = raw.clone();
        async move {
            raw.lookup(lookup(&format!("warm-up-{index}")))
                .await
                .expect("a warm-up Lookup")
        }
    }))
    .await;
    let outcomes = futures::future::join_all(vectors.scenarios.iter().map(|scenario| {
        let raw = raw.clone();
        async move {
            (
                scenario.name.as_str(),
                run_scenario(coordinator, raw, scenario).await,
            )
        }
    }))
    .await;
    let failures: Vec<String> = outcomes
        .into_iter()
        .filter_map(|(name, outcome)| outcome.err().map(|e| format!("{name}: {e}")))
        .collect();
    assert!(
        failures.is_empty(),
        "scenarios failed:\n{}",
        failures.join("\n")
    );
}

for_each_backend!(every_scenario_holds);
