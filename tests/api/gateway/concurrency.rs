//! Many identical requests at once: the upstream runs once and every caller gets its answer.

use crate::support::{Backend, TestApp, for_each_backend};

use super::{Http, TestGateway, Upstream, key};

for_each_backend!(fifty_identical_posts_run_the_upstream_once);

/// 50 concurrent POSTs with one key: one runs (held in the upstream until the other 49 wait
/// in the coordinator), all 50 get the same status and body, 49 of them replayed.
async fn fifty_identical_posts_run_the_upstream_once(backend: Backend) {
    let app = TestApp::spawn(backend).await;
    let upstream = Upstream::start().await;
    let gateway = TestGateway::start(&upstream, &app.endpoint(), &["--wait", "30s"]).await;
    let http = Http::new();
    let key = key("fifty");
    upstream.hold();
    let url = format!("{}/orders", gateway.url());
    let calls: Vec<_> = (0..50)
        .map(|_| http.spawn_post(&url, &key, r#"{"item":"book"}"#))
        .collect();
    upstream.wait_for_in_flight(1).await;
    app.wait_for_waiters(49).await;
    upstream.open();
    let mut answers = Vec::new();
    for call in calls {
        answers.push(call.await.expect("the call ran").expect("an answer"));
    }
    assert_eq!(upstream.executions(), 1, "the upstream ran once");
    for answer in &answers {
        assert_eq!(answer.status, 201, "{answer:?}");
        assert_eq!(answer.text(), r#"{"order":1}"#);
        assert_eq!(answer.header("x-execution"), Some("1"));
    }
    let replayed = answers.iter().filter(|a| a.replayed()).count();
    assert_eq!(
        replayed, 49,
        "every caller but the first got the stored response"
    );
}
