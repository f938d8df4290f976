//! `MovePlacement`: an operator moves a namespace to another cluster, or rolls back its
//! unfinished move (`store/clusters/moves.rs` does the work), and the audit trail records it on
//! the cluster the namespace ends on; `GetPlacement`: where a namespace stands meanwhile.

use std::time::Duration;

use super::{Actor, Admin};
use crate::domain::Scope;
use crate::domain::admin::AdminAction;
use crate::store::clusters::moves::{MoveError, MoveReport};
use crate::store::clusters::standing::PlacementView;
use crate::store::{AdminStore, AnyStore};

/// Where to: a cluster, or back where the namespace came from.
#[derive(Debug, Clone)]
pub enum MoveTarget {
    Cluster(String),
    RollBack,
}

/// Why a move was not made.
#[derive(Debug, thiserror::Error)]
pub enum PlacementError {
    /// The request names no cluster this service has (INVALID_ARGUMENT on `to`).
    #[error("{0}")]
    UnknownCluster(String),
    /// The request does not fit (FAILED_PRECONDITION), or a cluster failed (UNAVAILABLE).
    #[error(transparent)]
    Move(#[from] MoveError),
}

/// What an operator is told on a service of one database, which places nothing.
const ONE_DATABASE: &str = "this service runs on one database: a namespace moves between the \
                            clusters given with --cluster (docs/scaling.md)";

impl Admin {
    /// Where `namespace` is served, by every cluster's gate of it.
    pub async fn placement_of(&self, namespace: &Scope) -> Result<PlacementView, MoveError> {
        let AnyStore::Clusters(clusters) = &self.store else {
            return Err(MoveError::Refused(ONE_DATABASE.to_owned()));
        };
        clusters.placement_of(namespace.as_str()).await
    }

    /// Moves `namespace` (or rolls back its move) in a task of its own, which runs to its end
    /// even if the caller goes away: a move left between its steps is resumable, but one that
    /// finishes is better. Answers what it did and its audit event's id.
    pub async fn move_placement(
        &self,
        actor: &Actor,
        namespace: &Scope,
        target: MoveTarget,
    ) -> Result<(MoveReport, i64), PlacementError> {
        let AnyStore::Clusters(clusters) = &self.store else {
            return Err(MoveError::Refused(ONE_DATABASE.to_owned()).into());
        };
        let to = match &target {
            MoveTarget::Cluster(name) => Some(clusters.index_of(name).ok_or_else(|| {
                let known: Vec<&str> = clusters
                    .clusters()
                    .iter()
                    .map(|c| c.name.as_str())
                    .collect();
                PlacementError::UnknownCluster(format!(
                    "no cluster is named {name:?}; this service has {}",
                    known.join(", ")
                ))
            })?),
            MoveTarget::RollBack => None,
        };
        // Statements that began before the fence end by their own timeout at the latest.
        let drain_bound = 2 * self.operation_timeout + Duration::from_secs(1);
        let (store, scope) = (clusters.clone(), namespace.as_str().to_owned());
        let work = self.tasks.spawn(async move {
            match to {
                Some(to) => store.move_scope(&scope, to, drain_bound).await,
                None => store.roll_back_move(&scope).await,
            }
        });
        let report = work
            .await
            .map_err(|_| MoveError::Refused("the move's task ended abnormally".to_owned()))?;
        let report = match report {
            Ok(report) => report,
            Err(error) => {
                tracing::warn!(
                    actor = actor.name,
                    namespace = namespace.as_str(),
                    error = %crate::telemetry::error_chain(&error),
                    "a namespace's move stopped before its end"
                );
                return Err(error.into());
            }
        };
        let mut audit = self.audit(actor, AdminAction::MovePlacement, namespace, None);
        audit.outcome_json = Some(
            serde_json::json!({
                "from": report.from,
                "to": report.to,
                "outcome": report.outcome.name(),
                "keys_copied": report.copied[0],
                "events_copied": report.copied[1],
                "audit_events_copied": report.copied[2],
                "rows_deleted": report.deleted,
                "frozen_ms": u64::try_from(report.frozen.as_millis()).unwrap_or(u64::MAX),
            })
            .to_string(),
        );
        let audit_id = self
            .store
            .record_audit(&audit)
            .await
            .map_err(MoveError::Store)?;
        tracing::warn!(
            actor = actor.name,
            namespace = namespace.as_str(),
            from = report.from,
            to = report.to,
            outcome = report.outcome.name(),
            frozen_ms = report.frozen.as_millis(),
            audit_id,
            "an operator moved a namespace between clusters"
        );
        Ok((report, audit_id))
    }
}
