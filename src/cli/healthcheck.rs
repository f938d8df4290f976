//! `idempotency-coordinator healthcheck`: one `grpc.health.v1` Check of the API within a bounded
//! time, for container health checks that cannot speak gRPC; the exit status is the answer.

use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use crate::config::HealthcheckArgs;

/// Asks the service at `args.addr` for the health of the API, within `args.timeout` in all:
/// `Err` says why it is not healthy (unreachable, an error, or the status it answered).
pub async fn check(args: &HealthcheckArgs) -> Result<(), String> {
    let check = async {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", args.addr))
            .map_err(|error| error.to_string())?
            .connect()
            .await
            .map_err(|error| format!("cannot connect to {}: {error}", args.addr))?;
        let answer = HealthClient::new(channel)
            .check(HealthCheckRequest {
                service: "idempotency.v1.IdempotencyService".into(),
            })
            .await
            .map_err(|status| format!("health check failed: {}", status.code()))?;
        match answer.into_inner().status() {
            ServingStatus::Serving => Ok(()),
            other => Err(format!("status {}", other.as_str_name())),
        }
    };
    tokio::time::timeout(args.timeout, check)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {:?}", args.timeout)))
}
