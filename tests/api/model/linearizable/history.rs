//! Runs a plan against the real server(s) and records its history: every call's invocation and
//! answer, in the order they happened, each with its window by the database clock.
//!
//! The window. The test process and the store read one clock (the same machine's; SQLite's
//! clock is the service process's, which is this one). Before a history, the offset between
//! this process's clock and the database clock is bracketed by reading the database clock
//! between two local readings: `offset ∈ [db − after, db + precision − before]`. A call's window
//! is then `[invoked + offset_lo, answered + offset_hi]` widened by [`WINDOW_SLACK`]: the
//! database clock at its linearization point lies in it, because that point lies between the
//! invocation and the answer in real time. Local readings are taken under the history's lock,
//! so the recorded order of events is their real-time order, which is what the checker uses.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::Utc;
use idempotency_coordinator::proto::idempotency::v1::{
    self as pb, lookup_response::State, try_start_response::Outcome,
};
use tonic::Code;

use crate::support::*;

use super::super::ops::TokenChoice;
use super::plan::*;
use super::spec::*;

/// Added to both ends of a window: the store's precision (SQLite reads its clock to the
/// millisecond) and the rounding of timestamps.
const WINDOW_SLACK: Micros = 2_000;

/// What a recorded event is about.
#[derive(Debug, Clone)]
pub enum Call {
    Key { key: u8, op: KeyOp },
    Events(MarkOp),
}

#[derive(Debug, Clone)]
pub enum Answered {
    Key(KeyRet),
    Events(MarkRet),
}

#[derive(Debug, Clone)]
pub enum Event {
    Invoked {
        caller: usize,
        call: Call,
        lo: Micros,
    },
    Returned {
        caller: usize,
        answer: Answered,
        hi: Micros,
    },
}

/// The offset from this process's clock to the database clock, bracketed.
#[derive(Debug, Clone, Copy)]
pub struct Offset {
    lo: Micros,
    hi: Micros,
}

fn local_now() -> Micros {
    Utc::now().timestamp_micros()
}

pub fn micros(timestamp: &Option<prost_types::Timestamp>) -> Micros {
    instant(timestamp).timestamp_micros()
}

impl Offset {
    pub async fn measure(app: &TestApp) -> Self {
        let mut offset = Offset {
            lo: Micros::MIN,
            hi: Micros::MAX,
        };
        for _ in 0..5 {
            let before = local_now();
            let db = app.db_now().await.timestamp_micros();
            let after = local_now();
            offset.lo = offset.lo.max(db - after);
            offset.hi = offset.hi.min(db + 1_000 - before);
        }
        offset
    }
}

/// Everything callers share while a history runs.
pub struct Recorder {
    pub namespace: String,
    offset: Offset,
    events: Mutex<Vec<Event>>,
    /// Every token each key answered, in the order they arrived.
    tokens: Mutex<Vec<Vec<u64>>>,
    /// Instants (database clock) at which something short-lived ends: (lease ends, retention
    /// ends), for the pauses.
    deadlines: Mutex<(Vec<Micros>, Vec<Micros>)>,
    /// Calls that failed in a way the contract never answers here (transport, UNAVAILABLE...).
    pub unexpected: Mutex<Vec<String>>,
}

impl Recorder {
    pub fn new(namespace: String, offset: Offset) -> Self {
        Self {
            namespace,
            offset,
            events: Mutex::new(Vec::new()),
            tokens: Mutex::new(vec![Vec::new(); usize::from(KEYS)]),
            deadlines: Mutex::new((Vec::new(), Vec::new())),
            unexpected: Mutex::new(Vec::new()),
        }
    }

    pub fn events(&self) -> Vec<Event> {
        self.events.lock().expect("events").clone()
    }

    fn invoked(&self, caller: usize, call: Call) {
        let mut events = self.events.lock().expect("events");
        let lo = local_now() + self.offset.lo - WINDOW_SLACK;
        events.push(Event::Invoked { caller, call, lo });
    }

    fn invoked_key(&self, caller: usize, key: u8, op: &KeyOp) {
        self.invoked(
            caller,
            Call::Key {
                key,
                op: op.clone(),
            },
        );
    }

    fn returned(&self, caller: usize, answer: Answered) {
        let mut events = self.events.lock().expect("events");
        let hi = local_now() + self.offset.hi + WINDOW_SLACK;
        events.push(Event::Returned { caller, answer, hi });
    }

    fn token(&self, key: u8, choice: TokenChoice) -> u64 {
        choice.pick(&self.tokens.lock().expect("tokens")[usize::from(key)])
    }

    fn saw_token(&self, key: u8, token: u64) {
        let mut tokens = self.tokens.lock().expect("tokens");
        let seen = &mut tokens[usize::from(key)];
        if seen.last() != Some(&token) {
            seen.push(token);
        }
    }

    fn lease_ends(&self, at: Micros) {
        self.deadlines.lock().expect("deadlines").0.push(at);
    }

    fn retention_ends(&self, at: Micros) {
        self.deadlines.lock().expect("deadlines").1.push(at);
    }

    /// Waits, by the database clock, until every short lease or retention noted so far is over.
    pub async fn pause(&self, app: &TestApp, pause: Pause) {
        let horizon = app.db_now().await.timestamp_micros() + 5_000_000;
        let target = {
            let deadlines = self.deadlines.lock().expect("deadlines");
            let chosen = match pause {
                Pause::None => return,
                Pause::Leases => &deadlines.0,
                Pause::Retentions => &deadlines.1,
            };
            chosen.iter().copied().filter(|at| *at < horizon).max()
        };
        let Some(target) = target else { return };
        eventually(
            Duration::from_secs(10),
            "the database clock passes",
            || async { app.db_now().await.timestamp_micros() > target },
        )
        .await;
    }
}

fn ms(choice: Option<u64>) -> Option<prost_types::Duration> {
    choice.map(|ms| duration(Duration::from_millis(ms)))
}

fn us(choice: Option<u64>, default: Micros) -> Micros {
    choice.map_or(default, |ms| {
        Micros::try_from(ms * 1_000).unwrap_or(Micros::MAX)
    })
}

fn refusal(status: &tonic::Status) -> Option<KeyRet> {
    let reason = tonic_types::StatusExt::get_error_details(status)
        .error_info()
        .map(|info| info.reason.clone())
        .unwrap_or_default();
    let refusal = match (status.code(), reason.as_str()) {
        (Code::NotFound, "KEY_NOT_FOUND") => Refusal::KeyNotFound,
        (Code::Aborted, "LEASE_LOST") => Refusal::LeaseLost,
        (Code::FailedPrecondition, "ALREADY_COMPLETED") => Refusal::AlreadyCompleted,
        _ => return None,
    };
    Some(KeyRet::Refused(refusal))
}

/// Runs one caller's steps, recording each call.
pub async fn run_caller(
    recorder: Arc<Recorder>,
    mut client: Client,
    caller: usize,
    steps: Vec<Step>,
) {
    for step in steps {
        let answer = run_step(&recorder, &mut client, caller, step).await;
        if let Err(failure) = answer {
            recorder
                .unexpected
                .lock()
                .expect("unexpected")
                .push(failure);
            return;
        }
    }
}

async fn run_step(
    recorder: &Recorder,
    client: &mut Client,
    caller: usize,
    step: Step,
) -> Result<(), String> {
    let namespace = recorder.namespace.clone();
    let key_name = |key: u8| format!("key-{key}");
    let (key, op, answer): (u8, KeyOp, Result<KeyRet, tonic::Status>) = match step {
        Step::MarkProcessed { events, retention } => {
            let retention_ms = EVENT_RETENTIONS_MS[usize::from(retention)];
            let op = MarkOp {
                events: events.clone(),
                retention_us: us(retention_ms, DEFAULT_EVENT_RETENTION_US),
            };
            recorder.invoked(caller, Call::Events(op.clone()));
            let answer = client
                .mark_processed(pb::MarkProcessedRequest {
                    consumer: namespace,
                    event_ids: events.iter().map(|e| format!("event-{e}")).collect(),
                    retention: ms(retention_ms),
                })
                .await
                .map_err(|s| format!("MarkProcessed {events:?}: {s:?}"))?
                .into_inner();
            let results: MarkRet = answer
                .results
                .iter()
                .map(|r| (r.already_processed, micros(&r.processed_at)))
                .collect();
            if retention_ms.is_some() {
                for (_, at) in results.iter().filter(|(already, _)| !already) {
                    recorder.retention_ends(at + op.retention_us);
                }
            }
            recorder.returned(caller, Answered::Events(results));
            return Ok(());
        }
        Step::TryStart {
            key,
            fingerprint,
            attempt,
            lease,
            retention,
        } => {
            let (lease_ms, retention_ms) = (
                LEASES_MS[usize::from(lease)],
                KEY_RETENTIONS_MS[usize::from(retention)],
            );
            let op = KeyOp::TryStart {
                fingerprint,
                attempt_id: ATTEMPTS[usize::from(attempt)],
                lease_us: us(lease_ms, DEFAULT_LEASE_US),
                retention_us: us(retention_ms, DEFAULT_KEY_RETENTION_US),
            };
            recorder.invoked_key(caller, key, &op);
            let answer = client
                .try_start(pb::TryStartRequest {
                    namespace,
                    key: key_name(key),
                    fingerprint: FINGERPRINTS[usize::from(fingerprint)].to_vec(),
                    lease_ttl: ms(lease_ms),
                    retention: ms(retention_ms),
                    attempt_id: ATTEMPTS[usize::from(attempt)].into(),
                    wait: None,
                })
                .await
                .map(|answer| match answer.into_inner().outcome {
                    Some(Outcome::Started(s)) => {
                        let lease_expires_at = micros(&s.lease_expires_at);
                        recorder.saw_token(key, s.lease_token);
                        if lease_ms.is_some() {
                            recorder.lease_ends(lease_expires_at);
                        }
                        if let (Some(lease), Some(kept)) = (lease_ms, retention_ms) {
                            let at = lease_expires_at - us(Some(lease), 0);
                            recorder.retention_ends(at + us(Some(lease.max(kept)), 0));
                        }
                        KeyRet::Started {
                            token: s.lease_token,
                            lease_expires_at,
                            attempt: s.attempt,
                            checkpoint: s.checkpoint,
                        }
                    }
                    Some(Outcome::InProgress(p)) => KeyRet::InProgress {
                        lease_expires_at: micros(&p.lease_expires_at),
                        attempt: p.attempt,
                    },
                    Some(Outcome::Completed(c)) => KeyRet::Replayed {
                        response: response_index(&c.response),
                        completed_at: micros(&c.completed_at),
                        expires_at: micros(&c.expires_at),
                    },
                    Some(Outcome::FingerprintMismatch(_)) | None => KeyRet::Mismatch,
                });
            (key, op, answer)
        }
        Step::Complete {
            key,
            token,
            response,
            retention,
        } => {
            let token = recorder.token(key, token);
            let retention_ms = retention.and_then(|r| KEY_RETENTIONS_MS[usize::from(r)]);
            let op = KeyOp::Complete {
                token,
                response,
                retention_us: retention_ms.map(|ms| us(Some(ms), 0)),
            };
            recorder.invoked_key(caller, key, &op);
            let request = complete(&key_name(key), token, RESPONSES[usize::from(response)])
                .with_retention(ms(retention_ms))
                .in_namespace(namespace);
            let answer = client.complete(request).await.map(|answer| {
                let done = answer.into_inner();
                let expires_at = micros(&done.expires_at);
                recorder.retention_ends(expires_at);
                KeyRet::Completed {
                    completed_at: micros(&done.completed_at),
                    expires_at,
                }
            });
            (key, op, answer)
        }
        Step::Release { key, token } => {
            let token = recorder.token(key, token);
            let op = KeyOp::Release { token };
            recorder.invoked_key(caller, key, &op);
            let answer = client
                .release(release(&key_name(key), token).in_namespace(namespace))
                .await
                .map(|_| KeyRet::Released);
            (key, op, answer)
        }
        Step::ExtendLease {
            key,
            token,
            lease,
            checkpoint,
        } => {
            let token = recorder.token(key, token);
            let lease_ms = LEASES_MS[usize::from(lease)];
            let checkpoint = checkpoint.map(|c| vec![c; usize::from(c)]);
            let op = KeyOp::ExtendLease {
                token,
                lease_us: us(lease_ms, DEFAULT_LEASE_US),
                checkpoint: checkpoint.clone(),
            };
            recorder.invoked_key(caller, key, &op);
            let request = extend(&key_name(key), token)
                .with_lease(ms(lease_ms))
                .with_checkpoint(checkpoint.as_deref())
                .in_namespace(namespace);
            let answer = client.extend_lease(request).await.map(|answer| {
                let lease_expires_at = micros(&answer.into_inner().lease_expires_at);
                if lease_ms.is_some() {
                    recorder.lease_ends(lease_expires_at);
                }
                KeyRet::Extended { lease_expires_at }
            });
            (key, op, answer)
        }
        Step::Lookup { key } => {
            let op = KeyOp::Lookup;
            recorder.invoked_key(caller, key, &op);
            let answer = client
                .lookup(pb::LookupRequest {
                    namespace,
                    key: key_name(key),
                })
                .await
                .map(|answer| match answer.into_inner().state {
                    Some(State::InProgress(p)) => KeyRet::LookedUpInProgress {
                        lease_expires_at: micros(&p.lease_expires_at),
                        attempt: p.attempt,
                        fingerprint: fingerprint_index(&p.fingerprint),
                    },
                    Some(State::Completed(c)) => KeyRet::LookedUpCompleted {
                        response: response_index(&c.response),
                        fingerprint: fingerprint_index(&c.fingerprint),
                        completed_at: micros(&c.completed_at),
                        expires_at: micros(&c.expires_at),
                    },
                    Some(State::Absent(_)) | None => KeyRet::Absent,
                });
            (key, op, answer)
        }
    };
    let ret = match answer {
        Ok(ret) => ret,
        Err(status) => {
            refusal(&status).ok_or_else(|| format!("key-{key} {op:?}: unexpected {status:?}"))?
        }
    };
    recorder.returned(caller, Answered::Key(ret));
    Ok(())
}

/// An unknown response or fingerprint maps past the known ones, so it never matches.
fn response_index(response: &[u8]) -> u8 {
    index_of(&RESPONSES, response)
}

fn fingerprint_index(fingerprint: &[u8]) -> u8 {
    index_of(&FINGERPRINTS, fingerprint)
}

fn index_of(known: &[&[u8]], value: &[u8]) -> u8 {
    let position = known
        .iter()
        .position(|k| *k == value)
        .unwrap_or(known.len());
    u8::try_from(position).unwrap_or(u8::MAX)
}
