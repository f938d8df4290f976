//! `grpc.health.v1.Health` for `""` and `idempotency.v1.IdempotencyService`, reporting
//! [`HealthState`]. Once shutdown begins, open Watch streams get NOT_SERVING and are then
//! ended, so that they do not hold the drain for the whole grace period.

use std::sync::Arc;

use tokio::sync::{Semaphore, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tonic_health::pb::health_check_response::ServingStatus as ProtoStatus;
use tonic_health::pb::health_server::Health;
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

use crate::health::{HealthState, ServingStatus};

/// The service names health is reported for: the server as a whole and the API.
pub const SERVICE_NAMES: [&str; 2] = ["", "idempotency.v1.IdempotencyService"];

pub struct HealthApi {
    state: HealthState,
    /// Watch streams are open to anyone (probes carry no token), so they are counted: each
    /// holds a task and a channel for as long as its client likes.
    watchers: Arc<Semaphore>,
}

impl HealthApi {
    pub fn new(state: HealthState, max_watchers: u32) -> Self {
        Self {
            state,
            watchers: Arc::new(Semaphore::new(max_watchers as usize)),
        }
    }
}

fn response(status: ProtoStatus) -> HealthCheckResponse {
    HealthCheckResponse {
        status: status.into(),
    }
}

fn proto_status(status: ServingStatus) -> ProtoStatus {
    match status {
        ServingStatus::Serving => ProtoStatus::Serving,
        ServingStatus::NotServing | ServingStatus::ShuttingDown => ProtoStatus::NotServing,
    }
}

#[tonic::async_trait]
impl Health for HealthApi {
    async fn check(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        if !SERVICE_NAMES.contains(&request.get_ref().service.as_str()) {
            return Err(Status::not_found("unknown service"));
        }
        Ok(Response::new(response(proto_status(self.state.current()))))
    }

    type WatchStream = ReceiverStream<Result<HealthCheckResponse, Status>>;

    async fn watch(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let Ok(watcher) = self.watchers.clone().try_acquire_owned() else {
            return Err(super::status::too_many_watchers());
        };
        let known = SERVICE_NAMES.contains(&request.get_ref().service.as_str());
        let mut statuses = self.state.subscribe();
        let (sender, receiver) = mpsc::channel(4);
        tokio::spawn(async move {
            let _watcher = watcher;
            if !known {
                // The protocol's answer for a name it does not serve. The stream stays open, as
                // the protocol asks, until the client leaves or shutdown begins.
                let _ = sender.send(Ok(response(ProtoStatus::ServiceUnknown))).await;
                tokio::select! {
                    _ = sender.closed() => {}
                    _ = statuses.wait_for(|s| *s == ServingStatus::ShuttingDown) => {}
                }
                return;
            }
            loop {
                let status = *statuses.borrow_and_update();
                if sender
                    .send(Ok(response(proto_status(status))))
                    .await
                    .is_err()
                {
                    return;
                }
                if status == ServingStatus::ShuttingDown {
                    return;
                }
                tokio::select! {
                    changed = statuses.changed() => if changed.is_err() { return },
                    _ = sender.closed() => return,
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(receiver)))
    }
}
