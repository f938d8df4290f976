//! `idempotency-coordinator admin …`: the operator's CLI, a client of the admin API over gRPC
//! (the generated client, the flags of `config::admin`). It prints a table for people or, with
//! `--output json`, one JSON document for scripts; an erasure of a namespace shows its progress
//! on standard error. Exit status: 0 done, 1 the call failed (its status on standard error),
//! 2 bad flags.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic::{Request, Status};

use crate::config::admin::{
    AdminArgs, AdminCommand, AdminConnection, KeysCommand, OutputFormat, StateArg,
};
use crate::proto::idempotency::v1 as pb;
use crate::proto::idempotency::v1::admin_service_client::AdminServiceClient;

/// Adds the bearer token, when there is one, to every call.
#[derive(Clone)]
struct Bearer(Option<MetadataValue<Ascii>>);

impl Interceptor for Bearer {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(value) = &self.0 {
            request
                .metadata_mut()
                .insert("authorization", value.clone());
        }
        Ok(request)
    }
}

type Client = AdminServiceClient<InterceptedService<Channel, Bearer>>;

/// Why a command failed.
enum Failure {
    /// Flags that make no sense (exit 2).
    Usage(String),
    /// The call failed (exit 1).
    Call(String),
}

impl From<Status> for Failure {
    fn from(status: Status) -> Self {
        Self::Call(format!(
            "{}: {}",
            status.code().description(),
            status.message()
        ))
    }
}

pub async fn run(args: AdminArgs) -> ExitCode {
    let connection = match args.connection.settings() {
        Ok(connection) => connection,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::from(2);
        }
    };
    match execute(&connection, args.command).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Usage(problem)) => {
            eprintln!("error: {problem}");
            ExitCode::from(2)
        }
        Err(Failure::Call(problem)) => {
            eprintln!("error: {problem}");
            ExitCode::FAILURE
        }
    }
}

async fn connect(connection: &AdminConnection) -> Result<Client, Failure> {
    let mut endpoint = Endpoint::from_shared(connection.coordinator.clone())
        .map_err(|error| Failure::Usage(format!("--coordinator: {error}")))?
        .connect_timeout(Duration::from_secs(5));
    if let Some(ca) = &connection.ca {
        let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca));
        if let Some((certificate, key)) = &connection.identity {
            tls = tls.identity(Identity::from_pem(certificate, key));
        }
        endpoint = endpoint
            .tls_config(tls)
            .map_err(|error| Failure::Usage(format!("--coordinator-ca: {error}")))?;
    }
    let channel = endpoint.connect().await.map_err(|error| {
        Failure::Call(format!(
            "cannot connect to {}: {error}",
            connection.coordinator
        ))
    })?;
    let bearer = match &connection.token {
        Some(token) => Some(
            format!("Bearer {token}")
                .parse()
                .map_err(|_| Failure::Usage("--token-file: not a valid token".into()))?,
        ),
        None => None,
    };
    Ok(AdminServiceClient::with_interceptor(
        channel,
        Bearer(bearer),
    ))
}

/// `message` with the call's deadline.
fn request<T>(connection: &AdminConnection, message: T) -> Request<T> {
    let mut request = Request::new(message);
    request.set_timeout(connection.timeout);
    request
}

async fn execute(connection: &AdminConnection, command: AdminCommand) -> Result<(), Failure> {
    let mut client = connect(connection).await?;
    let output = connection.output;
    match command {
        AdminCommand::Keys(KeysCommand::List {
            namespace,
            state,
            prefix,
            completed_after,
            completed_before,
            claimed_after,
            claimed_before,
            limit,
            page_token,
        }) => {
            let state = match state {
                None => pb::AdminKeyState::Unspecified,
                Some(StateArg::InProgress) => pb::AdminKeyState::InProgress,
                Some(StateArg::Stuck) => pb::AdminKeyState::Stuck,
                Some(StateArg::Completed) => pb::AdminKeyState::Completed,
            };
            let answer = client
                .list_keys(request(
                    connection,
                    pb::ListKeysRequest {
                        namespace,
                        state: state.into(),
                        key_prefix: prefix,
                        completed_after: instant_flag("completed-after", completed_after)?,
                        completed_before: instant_flag("completed-before", completed_before)?,
                        claimed_after: instant_flag("claimed-after", claimed_after)?,
                        claimed_before: instant_flag("claimed-before", claimed_before)?,
                        page_size: limit,
                        page_token,
                    },
                ))
                .await?
                .into_inner();
            print_keys(output, &answer);
        }
        AdminCommand::Keys(KeysCommand::Show { namespace, key }) => {
            let answer = client
                .get_key(request(connection, pb::GetKeyRequest { namespace, key }))
                .await?
                .into_inner();
            print_record(output, &answer);
        }
        AdminCommand::Keys(KeysCommand::Release {
            namespace,
            key,
            reason,
        }) => {
            let answer = client
                .force_release(request(
                    connection,
                    pb::ForceReleaseRequest {
                        namespace,
                        key,
                        reason,
                    },
                ))
                .await?
                .into_inner();
            let before = answer.released.as_ref().map(entry_json);
            print_change(
                output,
                "released",
                answer.audit_event_id,
                before,
                answer.released.as_ref(),
            );
        }
        AdminCommand::Keys(KeysCommand::Erase {
            namespace,
            key: Some(key),
            reason,
            ..
        }) => {
            let answer = client
                .erase_key(request(
                    connection,
                    pb::EraseKeyRequest {
                        namespace,
                        key,
                        reason,
                    },
                ))
                .await?
                .into_inner();
            let before = answer.erased.as_ref().map(entry_json);
            print_change(
                output,
                "erased",
                answer.audit_event_id,
                before,
                answer.erased.as_ref(),
            );
        }
        AdminCommand::Keys(KeysCommand::Erase {
            namespace,
            key: None,
            reason,
            batch_size,
            ..
        }) => {
            // A stream that lasts as long as the erasure: no deadline on it.
            let mut stream = client
                .erase_namespace(pb::EraseNamespaceRequest {
                    namespace: namespace.clone(),
                    reason,
                    batch_size,
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
                    "the stream ended before the erasure did (audit event {}); it goes on in \
                     the coordinator: see `admin audit --namespace {namespace}`",
                    last.audit_event_id
                )));
            }
            print_erasure(output, &namespace, &last);
        }
        AdminCommand::Stats { namespace } => {
            let answer = client
                .namespace_stats(request(
                    connection,
                    pb::NamespaceStatsRequest {
                        namespace: namespace.clone(),
                    },
                ))
                .await?
                .into_inner();
            print_stats(output, &namespace, &answer);
        }
        AdminCommand::Audit {
            namespace,
            limit,
            page_token,
        } => {
            let answer = client
                .list_audit_events(request(
                    connection,
                    pb::ListAuditEventsRequest {
                        namespace,
                        page_size: limit,
                        page_token,
                    },
                ))
                .await?
                .into_inner();
            print_audit(output, &answer);
        }
    }
    Ok(())
}

fn instant_flag(
    flag: &str,
    value: Option<String>,
) -> Result<Option<prost_types::Timestamp>, Failure> {
    let Some(value) = value else {
        return Ok(None);
    };
    let parsed = chrono::DateTime::parse_from_rfc3339(&value).map_err(|error| {
        Failure::Usage(format!(
            "--{flag}: {value:?} is not an RFC 3339 instant: {error}"
        ))
    })?;
    Ok(Some(super::convert::timestamp(parsed.to_utc())))
}

fn time_text(timestamp: Option<&prost_types::Timestamp>) -> String {
    timestamp
        .and_then(|t| chrono::DateTime::from_timestamp(t.seconds, u32::try_from(t.nanos).ok()?))
        .map(|at| at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
        .unwrap_or_default()
}

fn state_text(state: i32) -> &'static str {
    match pb::AdminKeyState::try_from(state) {
        Ok(pb::AdminKeyState::InProgress) => "in_progress",
        Ok(pb::AdminKeyState::Stuck) => "stuck",
        Ok(pb::AdminKeyState::Completed) => "completed",
        _ => "unknown",
    }
}

fn entry_json(entry: &pb::AdminKeyEntry) -> Value {
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
    })
}

/// Rows of cells as a table with a header, columns padded to their widest cell.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
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

fn print_json(value: &Value) {
    println!(
        "{}",
        serde_json::to_string_pretty(value).unwrap_or_else(|_| value.to_string())
    );
}

fn print_keys(output: OutputFormat, answer: &pb::ListKeysResponse) {
    match output {
        OutputFormat::Json => print_json(&json!({
            "keys": answer.keys.iter().map(entry_json).collect::<Vec<_>>(),
            "next_page_token": answer.next_page_token,
        })),
        OutputFormat::Table => {
            let rows: Vec<Vec<String>> = answer
                .keys
                .iter()
                .map(|k| {
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
                    ]
                })
                .collect();
            print!(
                "{}",
                table(
                    &[
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
                    ],
                    &rows,
                )
            );
            println!("{} keys", answer.keys.len());
            if !answer.next_page_token.is_empty() {
                println!("next page: --page-token {}", answer.next_page_token);
            }
        }
    }
}

/// Bytes as text when they are UTF-8 without control characters, else hex.
fn bytes_text(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(text) if !text.chars().any(|c| c.is_control() && c != '\n') => text.to_owned(),
        _ => format!("hex:{}", hex::encode(bytes)),
    }
}

fn print_record(output: OutputFormat, answer: &pb::GetKeyResponse) {
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
            println!("{:<18} {}", "response", bytes_text(&answer.response));
            if let Some(checkpoint) = &answer.checkpoint {
                println!("{:<18} {}", "checkpoint", bytes_text(checkpoint));
            }
        }
    }
}

fn print_change(
    output: OutputFormat,
    what: &str,
    audit_id: u64,
    before: Option<Value>,
    entry: Option<&pb::AdminKeyEntry>,
) {
    match output {
        OutputFormat::Json => print_json(&json!({
            what: before.is_some(),
            "audit_event_id": audit_id,
            "before": before,
        })),
        OutputFormat::Table => match entry {
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

fn print_erasure(output: OutputFormat, namespace: &str, last: &pb::EraseNamespaceResponse) {
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

fn print_stats(output: OutputFormat, namespace: &str, stats: &pb::NamespaceStatsResponse) {
    match output {
        OutputFormat::Json => print_json(&json!({
            "namespace": namespace,
            "in_progress_keys": stats.in_progress_keys,
            "stuck_keys": stats.stuck_keys,
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

fn print_audit(output: OutputFormat, answer: &pb::ListAuditEventsResponse) {
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

/// An erasure's progress on standard error: one line rewritten in place on a terminal, else a
/// line at most every second (and the last), so that a log of it stays short.
struct Progress {
    terminal: bool,
    quiet: bool,
    last_line: Option<Instant>,
    began: Instant,
}

impl Progress {
    fn new(output: OutputFormat) -> Self {
        Self {
            terminal: std::io::stderr().is_terminal(),
            // JSON output is for scripts: progress only on a terminal.
            quiet: output == OutputFormat::Json && !std::io::stderr().is_terminal(),
            last_line: None,
            began: Instant::now(),
        }
    }

    fn show(&mut self, namespace: &str, message: &pb::EraseNamespaceResponse) {
        if self.quiet {
            return;
        }
        let now = Instant::now();
        let due = self
            .last_line
            .is_none_or(|at| now.duration_since(at) >= Duration::from_secs(1));
        if !self.terminal && !due && !message.done {
            return;
        }
        self.last_line = Some(now);
        let seconds = now.duration_since(self.began).as_secs_f64();
        let rate = if seconds > 0.0 {
            message.keys_erased as f64 / seconds
        } else {
            0.0
        };
        let line = format!(
            "erasing {namespace}: {} keys, {} events erased ({rate:.0} keys/s){}",
            message.keys_erased,
            message.events_erased,
            if message.done { ", done" } else { "" }
        );
        let mut stderr = std::io::stderr().lock();
        let _ = if self.terminal {
            write!(stderr, "\r\x1b[2K{line}")
        } else {
            writeln!(stderr, "{line}")
        };
        let _ = stderr.flush();
    }

    fn finish(&self) {
        if self.terminal && !self.quiet {
            eprintln!();
        }
    }
}
