//! Hostile clients against the real server: messages the protobuf decoder refuses.

use tonic::Code;

use crate::support::*;

/// Messages the protobuf decoder refuses are the client's fault: INVALID_ARGUMENT with
/// ErrorInfo reason INVALID_ARGUMENT, never INTERNAL (which means a bug here), and nothing is
/// written.
async fn an_undecodable_message_is_invalid_argument_not_internal(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let undecodable: [(&str, Vec<u8>); 3] = [
        // field 2 (key) = 0xFF 0xFE: not UTF-8.
        (
            "invalid UTF-8",
            vec![0x0a, 0x02, b'n', b's', 0x12, 0x02, 0xff, 0xfe],
        ),
        // field 1 announces 5 bytes and carries 1.
        ("truncated", vec![0x0a, 0x05, b'n']),
        // field 1 with wire type 7, which does not exist.
        ("wrong wire type", vec![0x0f, 0x01]),
    ];
    for (what, message) in undecodable {
        let status = raw_unary(
            app.endpoint(),
            "/idempotency.v1.IdempotencyService/TryStart",
            message,
            None,
        )
        .await
        .expect_err(what);
        assert_error(&status, Code::InvalidArgument, "INVALID_ARGUMENT");
        assert!(
            status.message().contains("could not be decoded"),
            "{what}: {status:?}"
        );
    }
    assert_eq!(app.total_rows().await, 0);
    let mut client = app.client().await;
    claim(&mut client, try_start("still-serving")).await;
}

for_each_backend!(an_undecodable_message_is_invalid_argument_not_internal);
