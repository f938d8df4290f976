//! `AdminService.MovePlacement`: decode, move (or roll back), encode; `GetPlacement`: decode,
//! read where the namespace stands, encode.

use tonic::Status;

use super::{Answer, Violations};
use crate::domain::Scope;
use crate::domain::admin::Reason;
use crate::proto::idempotency::v1 as pb;
use crate::service::admin::Admin;
use crate::service::admin::moves::{MoveTarget, PlacementError};
use crate::store::clusters::moves::MoveError;
use crate::store::clusters::placement::ClusterName;

/// What `to` and `rollback` ask for: a cluster named as `--cluster` names one, or a rollback.
fn target(to: String, rollback: bool) -> Result<MoveTarget, crate::domain::Invalid> {
    match (to.is_empty(), rollback) {
        (true, true) => Ok(MoveTarget::RollBack),
        (false, true) => Err(crate::domain::Invalid(
            "a rollback takes no target: the namespace stays where its move began".to_owned(),
        )),
        (true, false) => Err(crate::domain::Invalid(
            "required: the cluster to move to, by its name in --cluster".to_owned(),
        )),
        (false, false) => to
            .parse::<ClusterName>()
            .map(|name| MoveTarget::Cluster(name.to_string()))
            .map_err(|error| crate::domain::Invalid(error.to_string())),
    }
}

pub(super) async fn move_placement(
    admin: &Admin,
    caller: String,
    request: pb::MovePlacementRequest,
) -> Answer<pb::MovePlacementResponse> {
    let mut violations = Violations::default();
    let namespace = violations.check("namespace", Scope::parse(request.namespace));
    let target = violations.check("to", target(request.to, request.rollback));
    let reason = violations.check("reason", Reason::parse(request.reason));
    let (actor, namespace, target) = violations.into_change(caller, namespace, target, reason)?;
    let (report, audit_id) = admin
        .move_placement(&actor, &namespace, target)
        .await
        .map_err(|error| match error {
            PlacementError::UnknownCluster(why) => super::bad_field("to", why),
            PlacementError::Move(MoveError::Refused(why)) => Status::failed_precondition(why),
            PlacementError::Move(MoveError::Store(error)) => Status::unavailable(format!(
                "the move of namespace {} stopped: {}; it stands where it stopped: move again \
                 to resume it, or roll it back",
                namespace.as_str(),
                crate::telemetry::error_chain(&error)
            )),
        })?;
    Ok(pb::MovePlacementResponse {
        from: report.from,
        to: report.to,
        outcome: report.outcome.name().to_owned(),
        keys_copied: report.copied[0],
        events_copied: report.copied[1],
        audit_events_copied: report.copied[2],
        rows_deleted: report.deleted,
        frozen: prost_types::Duration::try_from(report.frozen).ok(),
        audit_event_id: audit_id.unsigned_abs(),
    })
}

pub(super) async fn get_placement(
    admin: &Admin,
    request: pb::GetPlacementRequest,
) -> Answer<pb::GetPlacementResponse> {
    let mut violations = Violations::default();
    let Some(namespace) = violations.check("namespace", Scope::parse(request.namespace)) else {
        return Err(violations.into_status());
    };
    let view = admin
        .placement_of(&namespace)
        .await
        .map_err(|error| match error {
            MoveError::Refused(why) => Status::failed_precondition(why),
            MoveError::Store(error) => Status::unavailable(format!(
                "where namespace {} stands cannot be read: {}",
                namespace.as_str(),
                crate::telemetry::error_chain(&error)
            )),
        })?;
    let (moving_from, moving_to) = view.moving.unwrap_or_default();
    Ok(pb::GetPlacementResponse {
        placed_by_rules: view.rule,
        served_by: view.served_by.unwrap_or_default(),
        moving_from,
        moving_to,
        gates: view
            .gates
            .into_iter()
            .map(|gate| match gate.gate {
                Some(row) => pb::PlacementGate {
                    cluster: gate.cluster,
                    state: row.state.as_str().to_owned(),
                    peer: row.peer,
                    since: Some(crate::grpc::convert::timestamp(row.since)),
                },
                None => pb::PlacementGate {
                    cluster: gate.cluster,
                    ..Default::default()
                },
            })
            .collect(),
    })
}
