//! How the admin CLI shows an answer: a table for people, or one JSON document for scripts
//! (`--output json`), on standard output.

use serde_json::{Value, json};

use crate::config::admin::OutputFormat;
use crate::domain::admin::instant_text;
use crate::proto::idempotency::v1 as pb;

/// A timestamp as every output writes it (`domain::admin::instant_text`: RFC 3339, `Z`, to the
/// millisecond), or nothing for none.
pub(super) fn time_text(timestamp: Option<&prost_types::Timestamp>) -> String {
    timestamp
        .and_then(|t| chrono::DateTime::from_timestamp(t.seconds, u32::try_from(t.nanos).ok()?))
        .map(instant_text)
        .unwrap_or_default()
}

pub(super) fn state_text(state: i32) -> &'static str {
    match pb::AdminKeyState::try_from(state) {
        Ok(pb::AdminKeyState::InProgress) => "in_progress",
        Ok(pb::AdminKeyState::Stuck) => "stuck",
        Ok(pb::AdminKeyState::Completed) => "completed",
        Ok(pb::AdminKeyState::Released) => "released",
        _ => "unknown",
    }
}

/// What happens to a released key next, in the words an operator needs after releasing one.
pub(super) const RELEASED_NEXT: &str = "nobody holds it now: its holder's writes are refused \
    (LEASE_LOST) and the next claim takes it over (a greater token, attempt + 1); until then \
    it is listed as released, not stuck";

pub(super) fn entry_json(entry: &pb::AdminKeyEntry) -> Value {
    json!({
        "key": entry.key,
        "state": state_text(entry.state),
        "attempt": entry.attempt,
        "lease_token": entry.lease_token,
        "attempt_id": entry.attempt_id,
        "lease_expires_at": time_text(entry.lease_expires_at.as_ref()),
        "completed_at": entry.completed_at.as_ref().map(|t| time_text(Some(t))),
        "expires_at": time_text(entry.expires_at.as_ref()),
        "retention_seconds": entry.retention.as_ref().map(|d| d.seconds),
        "fingerprint_hex": entry.fingerprint_hex,
        "response_bytes": entry.response_bytes,
        "checkpoint_bytes": entry.checkpoint_bytes,
        "claimed_at": entry.claimed_at.as_ref().map(|t| time_text(Some(t))),
        "holder": entry.holder,
        "released_by": (!entry.released_by.is_empty()).then_some(&entry.released_by),
        "released_at": entry.released_at.as_ref().map(|t| time_text(Some(t))),
    })
}

/// Rows of cells as a table with a header, columns padded to their widest cell.
pub(super) fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        padded.join("  ").trim_end().to_owned() + "\n"
    };
    let mut text = line(header.iter().map(|h| (*h).to_owned()).collect());
    for row in rows {
        text.push_str(&line(row.clone()));
    }
    text
}

pub(super) fn print_json(value: &Value) {
    println!(
        "{}",
        serde_json::to_string_pretty(value).unwrap_or_else(|_| value.to_string())
    );
}

/// A timestamp to the second (RFC 3339, `Z`), for the narrow table, whose columns must fit.
fn second_text(timestamp: Option<&prost_types::Timestamp>) -> String {
    timestamp
        .and_then(|t| chrono::DateTime::from_timestamp(t.seconds, 0))
        .map(|at| at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
        .unwrap_or_default()
}

/// The narrow table's columns: what an operator reads first (which key, its state, who holds
/// it since when, when its lease ends or it completed), in 100 columns for keys and holders of
/// ordinary length. The rest is `--wide`'s, or `keys show`'s.
fn narrow_row(k: &pb::AdminKeyEntry) -> Vec<String> {
    let ends = if k.completed_at.is_some() {
        &k.completed_at
    } else {
        &k.lease_expires_at
    };
    vec![
        k.key.clone(),
        state_text(k.state).to_owned(),
        k.attempt.to_string(),
        k.holder.clone(),
        second_text(k.claimed_at.as_ref()),
        second_text(ends.as_ref()),
    ]
}

const NARROW: [&str; 6] = [
    "KEY",
    "STATE",
    "ATTEMPT",
    "HOLDER",
    "CLAIMED",
    "LEASE ENDS/DONE",
];

fn wide_row(k: &pb::AdminKeyEntry) -> Vec<String> {
    vec![
        k.key.clone(),
        state_text(k.state).to_owned(),
        k.attempt.to_string(),
        k.lease_token.to_string(),
        time_text(k.claimed_at.as_ref()),
        k.holder.clone(),
        time_text(k.lease_expires_at.as_ref()),
        time_text(k.completed_at.as_ref()),
        time_text(k.expires_at.as_ref()),
        k.response_bytes.to_string(),
        k.released_by.clone(),
        time_text(k.released_at.as_ref()),
    ]
}

const WIDE: [&str; 12] = [
    "KEY",
    "STATE",
    "ATTEMPT",
    "TOKEN",
    "CLAIMED",
    "HOLDER",
    "LEASE EXPIRES",
    "COMPLETED",
    "EXPIRES",
    "RESPONSE BYTES",
    "RELEASED BY",
    "RELEASED AT",
];

/// A page of keys: JSON (every field, whatever `wide`), or a table, narrow or `wide`.
pub(super) fn print_keys(output: OutputFormat, answer: &pb::ListKeysResponse, wide: bool) {
    match output {
        OutputFormat::Json => print_json(&json!({
            "keys": answer.keys.iter().map(entry_json).collect::<Vec<_>>(),
            "next_page_token": answer.next_page_token,
        })),
        OutputFormat::Table => {
            let text = if wide {
                let rows: Vec<Vec<String>> = answer.keys.iter().map(wide_row).collect();
                table(&WIDE, &rows)
            } else {
                let rows: Vec<Vec<String>> = answer.keys.iter().map(narrow_row).collect();
                table(&NARROW, &rows)
            };
            print!("{text}");
            println!("{} keys", answer.keys.len());
            if !answer.next_page_token.is_empty() {
                println!("next page: --page-token {}", answer.next_page_token);
            }
        }
    }
}

/// Bytes as text when they are UTF-8 without control characters, else hex.
pub(super) fn bytes_text(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(text) if !text.chars().any(|c| c.is_control() && c != '\n') => text.to_owned(),
        _ => format!("hex:{}", hex::encode(bytes)),
    }
}

pub(super) fn print_record(output: OutputFormat, answer: &pb::GetKeyResponse) {
    let entry = answer.key.as_ref().map(entry_json).unwrap_or(Value::Null);
    match output {
        OutputFormat::Json => {
            let mut record = entry;
            if let Value::Object(fields) = &mut record {
                fields.insert("response_hex".into(), hex::encode(&answer.response).into());
                fields.insert(
                    "checkpoint_hex".into(),
                    answer.checkpoint.as_ref().map(hex::encode).into(),
                );
            }
            print_json(&record);
        }
        OutputFormat::Table => {
            if let Value::Object(fields) = entry {
                for (name, value) in fields {
                    let text = match value {
                        Value::String(text) => text,
                        Value::Null => String::new(),
                        other => other.to_string(),
                    };
                    println!("{name:<18} {text}");
                }
            }
            if answer
                .key
                .as_ref()
                .is_some_and(|key| key.state == i32::from(pb::AdminKeyState::Released))
            {
                println!("{:<18} {RELEASED_NEXT}", "next");
            }
            println!("{:<18} {}", "response", bytes_text(&answer.response));
            if let Some(checkpoint) = &answer.checkpoint {
                println!("{:<18} {}", "checkpoint", bytes_text(checkpoint));
            }
        }
    }
}

/// What a change to one key (ForceRelease, EraseKey) did: `what` it was, as it was before.
pub(super) fn print_change(
    output: OutputFormat,
    what: &str,
    audit_id: u64,
    before: Option<&pb::AdminKeyEntry>,
) {
    match output {
        OutputFormat::Json => print_json(&json!({
            what: before.is_some(),
            "audit_event_id": audit_id,
            "before": before.map(entry_json),
        })),
        OutputFormat::Table => match before {
            Some(entry) => println!(
                "{what} {} (was {}, attempt {}, token {}); audit event {audit_id}",
                entry.key,
                state_text(entry.state),
                entry.attempt,
                entry.lease_token
            ),
            None => println!("nothing to do: the key was absent; audit event {audit_id}"),
        },
    }
}

pub(super) fn print_erasure(
    output: OutputFormat,
    namespace: &str,
    last: &pb::EraseNamespaceResponse,
) {
    match output {
        OutputFormat::Json => print_json(&json!({
            "namespace": namespace,
            "keys_erased": last.keys_erased,
            "events_erased": last.events_erased,
            "audit_event_id": last.audit_event_id,
        })),
        OutputFormat::Table => println!(
            "erased namespace {namespace}: {} keys, {} processed events; audit event {}",
            last.keys_erased, last.events_erased, last.audit_event_id
        ),
    }
}

pub(super) fn print_move(
    output: OutputFormat,
    namespace: &str,
    answer: &pb::MovePlacementResponse,
) {
    let frozen_ms = answer
        .frozen
        .as_ref()
        .map(|d| d.seconds.saturating_mul(1000) + i64::from(d.nanos / 1_000_000))
        .unwrap_or(0);
    match output {
        OutputFormat::Json => print_json(&json!({
            "namespace": namespace,
            "from": answer.from,
            "to": answer.to,
            "outcome": answer.outcome,
            "keys_copied": answer.keys_copied,
            "events_copied": answer.events_copied,
            "audit_events_copied": answer.audit_events_copied,
            "rows_deleted": answer.rows_deleted,
            "frozen_ms": frozen_ms,
            "audit_event_id": answer.audit_event_id,
        })),
        OutputFormat::Table => match answer.outcome.as_str() {
            "moved" => println!(
                "moved namespace {namespace} from {} to {}: {} keys, {} processed events, {} \
                 audit events; served by neither for {frozen_ms} ms; audit event {}",
                answer.from,
                answer.to,
                answer.keys_copied,
                answer.events_copied,
                answer.audit_events_copied,
                answer.audit_event_id
            ),
            "rolled_back" => println!(
                "rolled back the move of namespace {namespace} to {}: it stays on {}; audit \
                 event {}",
                answer.to, answer.from, answer.audit_event_id
            ),
            _ => println!(
                "nothing to do: namespace {namespace} lives on {}; audit event {}",
                answer.to, answer.audit_event_id
            ),
        },
    }
}

pub(super) fn print_stats(
    output: OutputFormat,
    namespace: &str,
    stats: &pb::NamespaceStatsResponse,
) {
    match output {
        OutputFormat::Json => print_json(&json!({
            "namespace": namespace,
            "in_progress_keys": stats.in_progress_keys,
            "stuck_keys": stats.stuck_keys,
            "released_keys": stats.released_keys,
            "completed_keys": stats.completed_keys,
            "processed_events": stats.processed_events,
            "oldest_stuck_key": stats.oldest_stuck_key,
            "oldest_stuck_lease_expired_at":
                stats.oldest_stuck_lease_expired_at.as_ref().map(|t| time_text(Some(t))),
            "stored_bytes": stats.stored_bytes,
            "read_at": time_text(stats.read_at.as_ref()),
        })),
        OutputFormat::Table => {
            let rows = vec![
                vec!["in progress".into(), stats.in_progress_keys.to_string()],
                vec!["stuck".into(), stats.stuck_keys.to_string()],
                vec!["released".into(), stats.released_keys.to_string()],
                vec!["completed".into(), stats.completed_keys.to_string()],
                vec![
                    "processed events".into(),
                    stats.processed_events.to_string(),
                ],
                vec![
                    "oldest stuck key".into(),
                    if stats.oldest_stuck_key.is_empty() {
                        "-".into()
                    } else {
                        format!(
                            "{} (lease ran out {})",
                            stats.oldest_stuck_key,
                            time_text(stats.oldest_stuck_lease_expired_at.as_ref())
                        )
                    },
                ],
                vec!["stored bytes".into(), stats.stored_bytes.to_string()],
                vec!["read at".into(), time_text(stats.read_at.as_ref())],
            ];
            print!("{}", table(&["NAMESPACE", namespace], &rows));
        }
    }
}

pub(super) fn print_audit(output: OutputFormat, answer: &pb::ListAuditEventsResponse) {
    match output {
        OutputFormat::Json => {
            let events: Vec<Value> = answer
                .events
                .iter()
                .map(|e| {
                    json!({
                        "id": e.id,
                        "at": time_text(e.at.as_ref()),
                        "actor": e.actor,
                        "action": e.action,
                        "namespace": e.namespace,
                        "key": e.key,
                        "reason": e.reason,
                        "record_before": serde_json::from_str::<Value>(&e.record_before_json).ok(),
                        "outcome": serde_json::from_str::<Value>(&e.outcome_json).ok(),
                    })
                })
                .collect();
            print_json(&json!({
                "events": events,
                "next_page_token": answer.next_page_token,
            }));
        }
        OutputFormat::Table => {
            let rows: Vec<Vec<String>> = answer
                .events
                .iter()
                .map(|e| {
                    vec![
                        e.id.to_string(),
                        time_text(e.at.as_ref()),
                        e.actor.clone(),
                        e.action.clone(),
                        e.key.clone(),
                        e.reason.clone(),
                    ]
                })
                .collect();
            print!(
                "{}",
                table(&["ID", "AT", "ACTOR", "ACTION", "KEY", "REASON"], &rows)
            );
            if !answer.next_page_token.is_empty() {
                println!("next page: --page-token {}", answer.next_page_token);
            }
        }
    }
}

pub(super) fn print_placement(
    output: OutputFormat,
    namespace: &str,
    answer: &pb::GetPlacementResponse,
) {
    // None without a gate (or without a time that reads as one).
    let since = |gate: &pb::PlacementGate| {
        Some(time_text(gate.since.as_ref())).filter(|text| !text.is_empty())
    };
    match output {
        OutputFormat::Json => print_json(&json!({
            "namespace": namespace,
            "placed_by_rules": answer.placed_by_rules,
            "served_by": answer.served_by,
            "moving_from": answer.moving_from,
            "moving_to": answer.moving_to,
            "gates": answer.gates.iter().map(|gate| json!({
                "cluster": gate.cluster,
                "state": gate.state,
                "peer": gate.peer,
                "since": since(gate),
            })).collect::<Vec<_>>(),
        })),
        OutputFormat::Table => {
            let served = if answer.served_by.is_empty() {
                "served by neither cluster: a move is between its fence and its switch".to_owned()
            } else {
                format!("served by {}", answer.served_by)
            };
            println!(
                "namespace {namespace}: {served} (its rules place it on {})",
                answer.placed_by_rules
            );
            if !answer.moving_to.is_empty() {
                println!(
                    "unfinished move from {} to {}: running now, or interrupted (move again to \
                     resume it, or --rollback)",
                    answer.moving_from, answer.moving_to
                );
            }
            println!("{:<32} {:<9} {:<32} SINCE", "CLUSTER", "GATE", "PEER");
            let or_dash = |text: &str| if text.is_empty() { "-" } else { text }.to_owned();
            for gate in &answer.gates {
                println!(
                    "{:<32} {:<9} {:<32} {}",
                    gate.cluster,
                    or_dash(&gate.state),
                    or_dash(&gate.peer),
                    since(gate).unwrap_or_else(|| "-".to_owned())
                );
            }
        }
    }
}
