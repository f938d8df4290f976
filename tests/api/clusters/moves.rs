//! Moving a namespace between clusters while it is served (`AdminService.MovePlacement`,
//! docs/scaling.md, "Moving a namespace"): under load on two replicas, with a holder whose lease
//! spans the move, a waiter, replays, processed events and callers racing for the same keys,
//! nothing acknowledged is lost, no work runs twice, tokens keep increasing and every waiter is
//! answered (`under_load`); a move interrupted by the service killed after its fence is
//! resumed, or rolled back, and the namespace is served from exactly one cluster throughout
//! (`interrupted`), and `GetPlacement` says where it stands at each step; a request that does
//! not fit is refused, naming why (`refused`).

mod cut_over;
mod interrupted;
mod refused;
mod under_load;

use std::time::Duration;

use idempotency_coordinator::proto::idempotency::v1::admin_service_client::AdminServiceClient;
use tonic::transport::Channel;

use super::*;

/// The tests' operation timeout: a call during a cut-over waits half of it at most, and a
/// move's drain twice it and a second.
const FLAGS: &[&str] = &["--operation-timeout", "2s"];

type Admin = AdminServiceClient<Channel>;

async fn admin_of(endpoint: String) -> Admin {
    AdminServiceClient::connect(endpoint)
        .await
        .expect("the admin API")
}

fn move_request(namespace: &str, to: &str) -> pb::MovePlacementRequest {
    pb::MovePlacementRequest {
        namespace: namespace.into(),
        to: to.into(),
        rollback: false,
        reason: "rebalancing".into(),
    }
}

fn rollback_request(namespace: &str) -> pb::MovePlacementRequest {
    pb::MovePlacementRequest {
        namespace: namespace.into(),
        to: String::new(),
        rollback: true,
        reason: "the target is failing over".into(),
    }
}

/// What a move (or rollback) that must succeed did.
async fn moved(admin: &Admin, request: pb::MovePlacementRequest) -> pb::MovePlacementResponse {
    answered(admin.clone().move_placement(request).await, "MovePlacement")
}

/// Where the admin API says `namespace` stands (`GetPlacement`).
async fn placement(admin: &Admin, namespace: &str) -> pb::GetPlacementResponse {
    answered(
        admin
            .clone()
            .get_placement(pb::GetPlacementRequest {
                namespace: namespace.into(),
            })
            .await,
        "GetPlacement",
    )
}

/// What `GetPlacement` says of `namespace`, in one line: `rules R, served by S, moving F>T,
/// gates C:STATE:PEER …` (`-` for no server, no move); a gate has its time, and no gate has
/// none.
async fn standing(admin: &Admin, namespace: &str) -> String {
    let view = placement(admin, namespace).await;
    let gates: Vec<String> = view
        .gates
        .iter()
        .map(|gate| {
            assert_eq!(gate.since.is_some(), !gate.state.is_empty(), "{gate:?}");
            format!("{}:{}:{}", gate.cluster, gate.state, gate.peer)
        })
        .collect();
    let served_by = if view.served_by.is_empty() {
        "-"
    } else {
        &view.served_by
    };
    let moving = if view.moving_to.is_empty() {
        "-".to_owned()
    } else {
        format!("{}>{}", view.moving_from, view.moving_to)
    };
    format!(
        "rules {}, served by {served_by}, moving {moving}, gates {}",
        view.placed_by_rules,
        gates.join(" ")
    )
}

/// `namespace`'s gate on `node`: its state and the cluster it names.
async fn gate_on(node: &Node, namespace: &str) -> Option<(String, String)> {
    let mut connection = node.connect(DATABASE).await;
    sqlx::query_as("SELECT state, peer FROM idempotency_placement_gates WHERE scope = $1")
        .bind(namespace)
        .fetch_optional(&mut connection)
        .await
        .unwrap_or_else(|error| panic!("the gates of {}: {error}", node.name))
}

/// The last token `node`'s sequence handed out.
async fn last_token_on(node: &Node) -> i64 {
    let mut connection = node.connect(DATABASE).await;
    let (last,): (Option<i64>,) =
        sqlx::query_as("SELECT pg_sequence_last_value('lease_token_seq')")
            .fetch_one(&mut connection)
            .await
            .expect("the token sequence");
    last.unwrap_or(0)
}

/// The audit trail's actions for `namespace`, newest first.
async fn audit_actions(admin: &Admin, namespace: &str) -> Vec<String> {
    answered(
        admin
            .clone()
            .list_audit_events(pb::ListAuditEventsRequest {
                namespace: namespace.into(),
                ..Default::default()
            })
            .await,
        "ListAuditEvents",
    )
    .events
    .into_iter()
    .map(|event| event.action)
    .collect()
}

/// A session on `node` in a transaction begun now and left open: a move's drain waits for it.
pub(super) async fn old_transaction(node: &Node) -> sqlx::PgConnection {
    let mut connection = node.connect(DATABASE).await;
    sqlx::raw_sql("BEGIN; SELECT txid_current()")
        .execute(&mut connection)
        .await
        .expect("an open transaction");
    connection
}

/// Starts a move of `namespace` to `to` and waits until `from` is fenced ("leaving"): the move
/// then waits for `old` to end.
pub(super) async fn fenced_move(
    admin: &Admin,
    from: &Node,
    namespace: &str,
    to: &str,
) -> tokio::task::JoinHandle<Result<tonic::Response<pb::MovePlacementResponse>, tonic::Status>> {
    let call = {
        let (admin, request) = (admin.clone(), move_request(namespace, to));
        tokio::spawn(async move { admin.clone().move_placement(request).await })
    };
    eventually(Duration::from_secs(20), "the source is fenced", || async {
        gate_on(from, namespace).await == Some(("leaving".into(), to.into()))
    })
    .await;
    call
}
