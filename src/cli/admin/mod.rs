//! `idempotency-coordinator admin …`: the operator's CLI, a client of the admin API over gRPC
//! (the generated client, the flags of `config::admin`). Here the connection and each command's
//! call; `checks` the filters' checks before any call, `print` how an answer is shown (a table
//! for people or, with `--output json`, one JSON document for scripts), `erase` the guarded
//! erasures, `progress` an erasure's progress on standard error. Exit status: 0 done, 1 the
//! call failed (its status on standard error), 2 bad flags.

mod checks;
mod erase;
mod print;
mod progress;

use std::process::ExitCode;
use std::time::Duration;

use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Request, Status};

use crate::config::admin::{
    AdminArgs, AdminCommand, AdminConnection, KeysCommand, OutputFormat, PlacementCommand, StateArg,
};
use crate::proto::idempotency::v1 as pb;
use crate::proto::idempotency::v1::admin_service_client::AdminServiceClient;

use super::transport::{self, Unreached};

use self::checks::{TimeFilters, check_filters, instant_flag};
use self::erase::{Erase, erase};
use self::print::*;

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
    /// The coordinator could not be reached, for this cause (exit 1).
    Transport(String),
    /// The call answered this status (exit 1), put in words by `from_status`.
    Status(Status),
}

impl From<Status> for Failure {
    fn from(status: Status) -> Self {
        Self::Status(status)
    }
}

impl Failure {
    /// A failed call in words: a transport's failure by its cause (`over_tls` tells a closed
    /// TLS connection from a plain one), any other status as the API gave it: its code, its
    /// ErrorInfo reason (the one scripts and operators tell causes apart by, e.g.
    /// `ADMIN_WRITE_REQUIRED`) and its message.
    fn from_status(status: &Status, over_tls: bool) -> Self {
        use tonic_types::StatusExt;
        if matches!(
            status.code(),
            tonic::Code::Unavailable
                | tonic::Code::Unknown
                | tonic::Code::Cancelled
                | tonic::Code::Internal
        ) && let Some(cause) = std::error::Error::source(status)
            .and_then(|error| transport::transport_cause(error, over_tls))
        {
            return Self::Transport(cause);
        }
        let reason = status
            .get_details_error_info()
            .map(|info| format!(" [{}]", info.reason))
            .unwrap_or_default();
        Self::Call(format!(
            "{}{reason}: {}",
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
        Err(failure) => report(failure, &connection),
    }
}

/// Says why the command failed, on standard error, and gives its exit status.
fn report(failure: Failure, connection: &AdminConnection) -> ExitCode {
    match failure {
        Failure::Usage(problem) => {
            eprintln!("error: {problem}");
            ExitCode::from(2)
        }
        Failure::Call(problem) => {
            eprintln!("error: {problem}");
            ExitCode::FAILURE
        }
        Failure::Transport(cause) => {
            eprintln!(
                "error: cannot reach {}: {cause}",
                connection.target.coordinator
            );
            ExitCode::FAILURE
        }
        // `from_status` makes a `Call` or a `Transport`, never a `Status`.
        Failure::Status(status) => report(
            Failure::from_status(&status, connection.target.ca.is_some()),
            connection,
        ),
    }
}

async fn connect(connection: &AdminConnection) -> Result<Client, Failure> {
    let channel = transport::channel(&connection.target, Duration::from_secs(5))
        .await
        .map_err(|unreached| match unreached {
            Unreached::Flags(problem) => Failure::Usage(problem),
            Unreached::Transport(cause) => Failure::Transport(cause),
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
    // Flags that contradict each other are refused before any connection is made.
    if let AdminCommand::Keys(KeysCommand::List {
        state,
        completed_after,
        completed_before,
        claimed_after,
        claimed_before,
        ..
    }) = &command
    {
        check_filters(&TimeFilters {
            state: *state,
            completed_after,
            completed_before,
            claimed_after,
            claimed_before,
        })?;
    }
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
            wide,
        }) => {
            let state = match state {
                None => pb::AdminKeyState::Unspecified,
                Some(StateArg::InProgress) => pb::AdminKeyState::InProgress,
                Some(StateArg::Stuck) => pb::AdminKeyState::Stuck,
                Some(StateArg::Completed) => pb::AdminKeyState::Completed,
                Some(StateArg::Released) => pb::AdminKeyState::Released,
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
            print_keys(output, &answer, wide);
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
            print_change(
                output,
                "released",
                answer.audit_event_id,
                answer.released.as_ref(),
            );
            if output == OutputFormat::Table {
                println!("{RELEASED_NEXT}");
            }
        }
        AdminCommand::Keys(KeysCommand::Erase {
            namespace,
            key,
            all: _,
            reason,
            batch_size,
            yes,
            dry_run,
        }) => {
            let what = Erase {
                namespace,
                key,
                reason,
                batch_size,
                yes,
                dry_run,
            };
            erase(&mut client, connection, what).await?;
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
            key,
            actor,
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
                        key: key.unwrap_or_default(),
                        actor: actor.unwrap_or_default(),
                    },
                ))
                .await?
                .into_inner();
            print_audit(output, &answer);
        }
        AdminCommand::Placement(PlacementCommand::Move {
            namespace,
            to,
            rollback,
            reason,
        }) => {
            let answer = client
                .move_placement(request(
                    connection,
                    pb::MovePlacementRequest {
                        namespace: namespace.clone(),
                        to: to.unwrap_or_default(),
                        rollback,
                        reason,
                    },
                ))
                .await?
                .into_inner();
            print_move(output, &namespace, &answer);
        }
        AdminCommand::Placement(PlacementCommand::Show { namespace }) => {
            let answer = client
                .get_placement(request(
                    connection,
                    pb::GetPlacementRequest {
                        namespace: namespace.clone(),
                    },
                ))
                .await?
                .into_inner();
            print_placement(output, &namespace, &answer);
        }
    }
    Ok(())
}
