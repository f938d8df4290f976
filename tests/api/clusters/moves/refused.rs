//! Requests a move cannot take: each refused with the field or the reason named, nothing
//! changed.

use tonic::Code;

use super::*;

#[tokio::test]
async fn bad_moves_are_refused_naming_their_cause_and_change_nothing() {
    let clusters = three_clusters().await;
    let app = serve_on(&clusters, FLAGS).await;
    let admin = admin_of(app.endpoint()).await;
    let client = app.client().await;
    lifecycle(&client, "misc", &unique_key("kept"), b"kept").await;

    let refused = |request: pb::MovePlacementRequest| {
        let admin = admin.clone();
        async move {
            admin
                .clone()
                .move_placement(request)
                .await
                .expect_err("refused")
        }
    };
    let unknown = refused(move_request("misc", "z")).await;
    assert_eq!(unknown.code(), Code::InvalidArgument);
    assert!(
        unknown.message().contains("to") && unknown.message().contains("\"z\""),
        "{unknown:?}"
    );
    let both = refused(pb::MovePlacementRequest {
        rollback: true,
        ..move_request("misc", "b")
    })
    .await;
    assert_eq!(both.code(), Code::InvalidArgument);
    let neither = refused(move_request("misc", "")).await;
    assert_eq!(neither.code(), Code::InvalidArgument);
    let bad_name = refused(move_request("misc", "B!")).await;
    assert_eq!(bad_name.code(), Code::InvalidArgument);
    let no_reason = refused(pb::MovePlacementRequest {
        reason: String::new(),
        ..move_request("misc", "b")
    })
    .await;
    assert_eq!(no_reason.code(), Code::InvalidArgument);
    assert!(no_reason.message().contains("reason"), "{no_reason:?}");
    let nothing_to_roll_back = refused(rollback_request("misc")).await;
    assert_eq!(nothing_to_roll_back.code(), Code::FailedPrecondition);
    assert!(
        nothing_to_roll_back
            .message()
            .contains("no unfinished move")
    );

    // Nothing moved, nothing gated.
    for node in &clusters.nodes {
        assert_eq!(gate_on(node, "misc").await, None, "{}", node.name);
    }
    assert_eq!(keys_on(&clusters.nodes[0], "misc").await, 1);
    let already = moved(&admin, move_request("misc", "a")).await;
    assert_eq!(already.outcome, "already_there");

    // Where a namespace never moved stands: on its rules' cluster, no gate anywhere.
    assert_eq!(
        standing(&admin, "billing").await,
        "rules c, served by c, moving -, gates a:: b:: c::"
    );
    let bad_namespace = admin
        .clone()
        .get_placement(pb::GetPlacementRequest {
            namespace: String::new(),
        })
        .await
        .expect_err("refused");
    assert_eq!(bad_namespace.code(), Code::InvalidArgument);
    assert!(
        bad_namespace.message().contains("namespace"),
        "{bad_namespace:?}"
    );
}

/// On one database there is nowhere to move to, and no placement to show.
#[tokio::test]
async fn a_move_on_one_database_is_a_failed_precondition() {
    let app = TestApp::spawn(Backend::Postgres).await;
    let status = admin_of(app.endpoint())
        .await
        .move_placement(move_request("misc", "b"))
        .await
        .expect_err("refused");
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert!(status.message().contains("--cluster"), "{status:?}");
    let status = admin_of(app.endpoint())
        .await
        .get_placement(pb::GetPlacementRequest {
            namespace: "misc".into(),
        })
        .await
        .expect_err("refused");
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert!(status.message().contains("--cluster"), "{status:?}");
}
