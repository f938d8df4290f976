//! Limits on callers: a rate per token, refused with RetryInfo, and a cap on the calls one
//! connection may have open.

use std::time::Duration;

use tonic::Code;
use tonic_types::StatusExt;

use crate::support::security::*;
use crate::support::*;

async fn the_rate_limit_answers_resource_exhausted_per_token(backend: Backend) {
    let (busy, busy_line) = token("busy", "*");
    let (quiet, quiet_line) = token("quiet", "*");
    let tokens = TokensFile::new(&[&busy_line, &quiet_line]);
    let app = TestApp::spawn_with(
        backend,
        &["--tokens-file", &tokens.flag(), "--rate-limit", "5"],
    )
    .await;
    let mut busy = authed_client(app.endpoint(), Bearer::token(&busy)).await;
    let mut codes = Vec::new();
    let mut waits = Vec::new();
    for _ in 0..20 {
        let answer = busy.lookup(lookup("k")).await;
        if let Err(status) = &answer
            && let Some(retry) = status.get_error_details().retry_info()
        {
            waits.push(retry.retry_delay.expect("a delay"));
        }
        codes.push(answer.err().map_or(Code::Ok, |s| s.code()));
    }
    // The refusal says how long until the next call is allowed: at 5/s, at most 200 ms.
    assert!(!waits.is_empty(), "refusals carry RetryInfo: {codes:?}");
    assert!(
        waits.iter().all(|wait| *wait > std::time::Duration::ZERO
            && *wait <= std::time::Duration::from_millis(200)),
        "{waits:?}"
    );
    assert!(
        codes[..5].iter().all(|c| *c == Code::Ok),
        "a burst of the rate: {codes:?}"
    );
    assert!(codes.contains(&Code::ResourceExhausted), "{codes:?}");
    assert!(
        codes
            .iter()
            .all(|c| matches!(c, Code::Ok | Code::ResourceExhausted))
    );
    let mut quiet = authed_client(app.endpoint(), Bearer::token(&quiet)).await;
    quiet
        .lookup(lookup("k"))
        .await
        .expect("another token has a budget of its own");
}

async fn a_connection_may_have_only_so_many_calls_open(backend: Backend) {
    let (app, mut client) = app_and_client_with(backend, &["--max-concurrent-streams", "2"]).await;
    // Five calls on one connection; the server lets two run.
    let (hold, calls) =
        completes_behind_a_held_row(&app, &mut client, &unique_key("streams"), 5).await;
    app.wait_for_blocked(2).await;
    // The others wait on the client side for the connection's streams; give them time to show
    // that they are not admitted (nothing to await: the absence of a third call).
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        app.calls_in_flight(),
        2,
        "two calls at a time on one connection"
    );
    hold.release().await;
    // Every call is answered in turn.
    for call in calls {
        answer_of(call).await;
    }
}

for_each_backend!(
    the_rate_limit_answers_resource_exhausted_per_token,
    a_connection_may_have_only_so_many_calls_open,
);
