//! The client's bearer token against a server with a tokens file.

use idempotency_client::{Client, Error, RunError};

use super::{PaymentError, Runs};
use crate::support::security::{TokensFile, token};
use crate::support::*;

async fn a_token_is_sent_and_a_scope_it_lacks_is_a_typed_permission_error(backend: Backend) {
    let (secret, line) = token("payments", "payments");
    let tokens = TokensFile::new(&[&line]);
    let app = TestApp::spawn_with(backend, &["--tokens-file", &tokens.flag()]).await;
    let client = Client::builder(app.endpoint())
        .token(secret)
        .build()
        .await
        .expect("connect");
    let runs = Runs::default();

    let allowed = client
        .run_once("payments", unique_key("charge"))
        .run(|_lease| async {
            runs.record();
            Ok::<_, PaymentError>("ok".to_owned())
        })
        .await
        .expect("the token holds payments");
    assert_eq!(allowed.value, "ok");

    let denied = client
        .run_once("billing", unique_key("charge"))
        .run(|_lease| async {
            runs.record();
            Ok::<_, PaymentError>("no".to_owned())
        })
        .await;
    assert!(
        matches!(
            denied,
            Err(RunError::Coordinator(Error::PermissionDenied(_)))
        ),
        "{denied:?}"
    );
    let marked = client.mark_processed("billing", ["evt-1"]).send().await;
    assert!(
        matches!(marked, Err(Error::PermissionDenied(_))),
        "{marked:?}"
    );

    let anonymous = Client::builder(app.endpoint())
        .build()
        .await
        .expect("connect");
    let refused = anonymous.mark_processed("payments", ["evt-1"]).send().await;
    assert!(
        matches!(refused, Err(Error::Unauthenticated(_))),
        "{refused:?}"
    );
    assert_eq!(runs.count(), 1, "only the allowed work ran");
}

for_each_backend!(a_token_is_sent_and_a_scope_it_lacks_is_a_typed_permission_error);
