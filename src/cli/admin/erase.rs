//! `admin keys erase`: one key (`--key`) or a whole namespace (`--all`), guarded. An erasure
//! cannot be undone, so `--all` asks for the namespace to be typed again on a terminal and
//! needs `--yes` without one; `--dry-run` says what would go and erases nothing; a namespace
//! that holds nothing is said to, and not erased (a mistyped name is then seen, and leaves no
//! audit event behind).

use std::io::{BufRead, IsTerminal, Write};

use serde_json::json;

use super::print::{entry_json, print_change, print_erasure, print_json, state_text};
use super::progress::Progress;
use super::{Client, Failure, request};
use crate::config::admin::{AdminConnection, OutputFormat};
use crate::proto::idempotency::v1 as pb;

/// What `keys erase` was asked.
pub(super) struct Erase {
    pub namespace: String,
    pub key: Option<String>,
    pub reason: Option<String>,
    pub batch_size: u32,
    pub yes: bool,
    pub dry_run: bool,
}

pub(super) async fn erase(
    client: &mut Client,
    connection: &AdminConnection,
    erase: Erase,
) -> Result<(), Failure> {
    let output = connection.output;
    match erase.key.clone() {
        Some(key) => erase_key(client, connection, erase, key).await,
        None => {
            let stats = client
                .namespace_stats(request(
                    connection,
                    pb::NamespaceStatsRequest {
                        namespace: erase.namespace.clone(),
                    },
                ))
                .await?
                .into_inner();
            let keys = stats.in_progress_keys + stats.stuck_keys + stats.completed_keys;
            let events = stats.processed_events;
            if erase.dry_run || keys + events == 0 {
                print_namespace_preview(output, &erase.namespace, keys, events, erase.dry_run);
                return Ok(());
            }
            if !erase.yes {
                confirm(&erase.namespace, keys, events)?;
            }
            erase_namespace(client, output, erase).await
        }
    }
}

async fn erase_key(
    client: &mut Client,
    connection: &AdminConnection,
    erase: Erase,
    key: String,
) -> Result<(), Failure> {
    let output = connection.output;
    if erase.dry_run {
        let found = client
            .get_key(request(
                connection,
                pb::GetKeyRequest {
                    namespace: erase.namespace.clone(),
                    key: key.clone(),
                },
            ))
            .await;
        let entry = match found {
            Ok(answer) => answer.into_inner().key,
            Err(status) if status.code() == tonic::Code::NotFound => None,
            Err(status) => return Err(status.into()),
        };
        match output {
            OutputFormat::Json => print_json(&json!({
                "dry_run": true,
                "namespace": erase.namespace,
                "key": key,
                "would_erase": entry.as_ref().map(entry_json),
            })),
            OutputFormat::Table => match &entry {
                Some(entry) => println!(
                    "would erase {key} of {} ({}, attempt {}, token {}); nothing erased",
                    erase.namespace,
                    state_text(entry.state),
                    entry.attempt,
                    entry.lease_token
                ),
                None => println!(
                    "{key} is absent from {}: nothing to erase; nothing erased",
                    erase.namespace
                ),
            },
        }
        return Ok(());
    }
    let answer = client
        .erase_key(request(
            connection,
            pb::EraseKeyRequest {
                namespace: erase.namespace,
                key,
                reason: erase.reason.unwrap_or_default(),
            },
        ))
        .await?
        .into_inner();
    print_change(
        output,
        "erased",
        answer.audit_event_id,
        answer.erased.as_ref(),
    );
    Ok(())
}

fn print_namespace_preview(
    output: OutputFormat,
    namespace: &str,
    keys: u64,
    events: u64,
    dry_run: bool,
) {
    match output {
        OutputFormat::Json => print_json(&json!({
            "namespace": namespace,
            "dry_run": dry_run,
            "empty": keys + events == 0,
            "keys": keys,
            "processed_events": events,
            "erased": false,
        })),
        OutputFormat::Table if keys + events == 0 => println!(
            "namespace {namespace} holds no keys and no processed events: nothing erased (is \
             the name right?)"
        ),
        OutputFormat::Table => println!(
            "would erase namespace {namespace}: {keys} keys, {events} processed events; \
             nothing erased"
        ),
    }
}

/// On a terminal, the namespace typed again; without one, a refusal that names `--yes`.
fn confirm(namespace: &str, keys: u64, events: u64) -> Result<(), Failure> {
    let stdin = std::io::stdin();
    if !stdin.is_terminal() {
        return Err(Failure::Usage(format!(
            "--all erases namespace {namespace} ({keys} keys, {events} processed events) for \
             good: on a terminal it asks for the namespace to be typed again; without one, add \
             --yes"
        )));
    }
    eprint!(
        "This erases namespace {namespace} for good: {keys} keys, {events} processed events.\n\
         Type the namespace to erase it: "
    );
    let _ = std::io::stderr().flush();
    let mut typed = String::new();
    stdin
        .lock()
        .read_line(&mut typed)
        .map_err(|error| Failure::Call(format!("reading the confirmation: {error}")))?;
    let typed = typed.trim_end_matches(['\n', '\r']);
    if typed != namespace {
        return Err(Failure::Call(format!(
            "{typed:?} is not {namespace:?}: nothing erased"
        )));
    }
    Ok(())
}

async fn erase_namespace(
    client: &mut Client,
    output: OutputFormat,
    erase: Erase,
) -> Result<(), Failure> {
    let namespace = erase.namespace;
    // A stream that lasts as long as the erasure: no deadline on it.
    let mut stream = client
        .erase_namespace(pb::EraseNamespaceRequest {
            namespace: namespace.clone(),
            reason: erase.reason.unwrap_or_default(),
            batch_size: erase.batch_size,
        })
        .await?
        .into_inner();
    let mut progress = Progress::new(output);
    let mut last = None;
    while let Some(message) = stream.message().await? {
        progress.show(&namespace, &message);
        let done = message.done;
        last = Some(message);
        if done {
            break;
        }
    }
    progress.finish();
    let last = last.ok_or_else(|| Failure::Call("the erasure reported nothing".into()))?;
    if !last.done {
        return Err(Failure::Call(format!(
            "the stream ended before the erasure did (audit event {}); it goes on in the \
             coordinator: see `admin audit --namespace {namespace}`",
            last.audit_event_id
        )));
    }
    print_erasure(output, &namespace, &last);
    Ok(())
}
