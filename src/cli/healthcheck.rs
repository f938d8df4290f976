//! `idempotency-coordinator healthcheck`: one `grpc.health.v1` Check of the API within a bounded
//! time, for container health checks that cannot speak gRPC; the exit status is the answer. It
//! reaches the coordinator as `admin` does (`transport`: the same forms, TLS, the same named
//! causes of a failure).

use std::process::ExitCode;

use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use super::transport::{self, Unreached};
use crate::config::HealthcheckArgs;

/// Why the check did not answer SERVING.
enum Unhealthy {
    /// The flags cannot make an endpoint (exit 2).
    Flags(String),
    /// Not healthy, for this reason (exit 1).
    Not(String),
}

/// Asks the coordinator for the health of the API, within `args.timeout` in all: exit 0 when
/// it answers SERVING; 1, with the reason on standard error, when it is not healthy
/// (unreachable, an error, or the status it answered); 2 when the flags are wrong.
pub async fn run(args: &HealthcheckArgs) -> ExitCode {
    let target = match args.target() {
        Ok(target) => target,
        Err(error) => {
            eprintln!("error: {error}");
            return ExitCode::from(2);
        }
    };
    let check = async {
        let channel = transport::channel(&target, args.timeout)
            .await
            .map_err(|unreached| match unreached {
                Unreached::Flags(problem) => Unhealthy::Flags(problem),
                Unreached::Transport(cause) => {
                    Unhealthy::Not(format!("cannot reach {}: {cause}", target.coordinator))
                }
            })?;
        let answer = HealthClient::new(channel)
            .check(HealthCheckRequest {
                service: "idempotency.v1.IdempotencyService".into(),
            })
            .await
            .map_err(|status| {
                // A connection is made lazily: a TLS port spoken to in plaintext may fail only
                // now, and is named as when connecting.
                Unhealthy::Not(
                    match std::error::Error::source(&status)
                        .and_then(|error| transport::transport_cause(error, target.ca.is_some()))
                    {
                        Some(cause) => format!("cannot reach {}: {cause}", target.coordinator),
                        None => format!("health check failed: {}", status.code()),
                    },
                )
            })?;
        match answer.into_inner().status() {
            ServingStatus::Serving => Ok(()),
            other => Err(Unhealthy::Not(format!("status {}", other.as_str_name()))),
        }
    };
    let outcome = tokio::time::timeout(args.timeout, check)
        .await
        .unwrap_or_else(|_| {
            Err(Unhealthy::Not(format!(
                "no answer within {:?}",
                args.timeout
            )))
        });
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(Unhealthy::Not(unhealthy)) => {
            eprintln!("unhealthy: {unhealthy}");
            ExitCode::FAILURE
        }
        Err(Unhealthy::Flags(usage)) => {
            eprintln!("error: {usage}");
            ExitCode::from(2)
        }
    }
}
