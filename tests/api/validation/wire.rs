//! Messages refused before any field is looked at: one beyond the decoding limit, and invalid
//! UTF-8 in a string field; nothing is written and the server keeps serving.

use tonic::Code;

use crate::support::*;

async fn a_message_beyond_the_decoding_limit_is_refused_and_the_server_is_unharmed(
    backend: Backend,
) {
    let (_app, mut client) = app_and_client(backend).await;
    let started = claim(&mut client, try_start("k")).await;
    // 1 MiB + 64 KiB is the decoding limit; this message is well past it.
    let status = client
        .complete(complete(
            "k",
            started.lease_token,
            &vec![1; 1024 * 1024 + 65 * 1024],
        ))
        .await
        .expect_err("message too large");
    assert!(
        status.code() == Code::OutOfRange,
        "refused by the gRPC layer: {status:?}"
    );
    expect_in_progress(try_start_response(&client, try_start("k")).await);
    client
        .complete(complete("k", started.lease_token, b"fine"))
        .await
        .expect("the same connection still works");
}

async fn invalid_utf8_in_a_string_field_is_refused_by_the_decoder_and_writes_nothing(
    backend: Backend,
) {
    let app = TestApp::spawn(backend).await;
    // A TryStartRequest encoded by hand: field 1 (namespace) = "ns", field 2 (key) = 0xFF 0xFE,
    // which is not UTF-8. The generated client cannot produce it, so it goes out as raw bytes.
    let message: Vec<u8> = vec![0x0a, 0x02, b'n', b's', 0x12, 0x02, 0xff, 0xfe];
    let answer = raw_unary(
        app.endpoint(),
        "/idempotency.v1.IdempotencyService/TryStart",
        message,
        None,
    )
    .await;
    // The contract: an undecodable message is INVALID_ARGUMENT with reason INVALID_ARGUMENT.
    let status = answer.expect_err("invalid UTF-8 is refused");
    assert_error(&status, Code::InvalidArgument, "INVALID_ARGUMENT");
    assert_eq!(app.total_rows().await, 0);
    let mut client = app.client().await;
    claim(&mut client, try_start("still-serving")).await;
}

for_each_backend!(
    a_message_beyond_the_decoding_limit_is_refused_and_the_server_is_unharmed,
    invalid_utf8_in_a_string_field_is_refused_by_the_decoder_and_writes_nothing,
);
