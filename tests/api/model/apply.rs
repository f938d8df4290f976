//! One operation of a sequence: the RPC sent to the server, its answer compared with the
//! reference model, and the model advanced as the contract says.

use idempotency_coordinator::proto::idempotency::v1::{
    self as pb, lookup_response::State, try_start_response::Outcome,
};
use proptest::test_runner::TestCaseError;
use tonic::Code;

use crate::support::*;

use super::ops::Op;
use super::{ATTEMPTS, FINGERPRINTS, KeyModel, Model, RESPONSES, check, compare};

pub(super) async fn apply(
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
            let request = try_start(&key_name(key))
                .with_fingerprint(FINGERPRINTS[fingerprint])
                .with_attempt(ATTEMPTS[attempt]);
            let answer = client
                .try_start(request.in_namespace(scope.into()))
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
            let request = complete(&key_name(key), token, RESPONSES[response]);
            let answer = client.complete(request.in_namespace(scope.into())).await;
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
            let request = release(&key_name(key), token);
            let answer = client.release(request.in_namespace(scope.into())).await;
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
            let request = extend(&key_name(key), token).with_checkpoint(checkpoint.as_deref());
            let answer = client
                .extend_lease(request.in_namespace(scope.into()))
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
                .lookup(lookup(&key_name(key)).in_namespace(scope.into()))
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
