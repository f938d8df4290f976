//! The Rust client (`idempotency-client`) against the real server: `run_once`, `process_once`
//! and `mark_processed` as a user calls them, on both stores, with the faults the client exists
//! to absorb (a lost TryStart answer, a restart, a lost lease).

mod conformance;
mod faults;
mod leases;
mod run_once;
pub mod scenarios;
mod security;
mod waited;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use idempotency_client::Client;

use crate::support::TestApp;

/// The namespace the client tests use.
pub const PAYMENTS: &str = "payments";

/// A Rust client connected to `app`.
pub async fn client_for(app: &TestApp) -> Client {
    Client::builder(app.endpoint())
        .build()
        .await
        .expect("connect to the test server")
}

/// A Rust client of `endpoint` whose calls retry for at most `total` (the default policy
/// otherwise).
pub async fn client_retrying_for(endpoint: String, total: std::time::Duration) -> Client {
    let retry = idempotency_client::RetryPolicy {
        total,
        ..Default::default()
    };
    Client::builder(endpoint)
        .retry(retry)
        .build()
        .await
        .expect("connect")
}

/// A server on `backend`, a Rust client of it, and a generated client of it (`raw`) to look at
/// or hold keys from outside the Rust client.
pub async fn app_and_clients(
    backend: crate::support::Backend,
) -> (TestApp, Client, crate::support::Client) {
    let app = TestApp::spawn(backend).await;
    let client = client_for(&app).await;
    let raw = app.client().await;
    (app, client, raw)
}

/// The state of `key` in the payments namespace, read with the generated client.
pub async fn payments_state(
    raw: &crate::support::Client,
    key: &str,
) -> idempotency_coordinator::proto::idempotency::v1::lookup_response::State {
    let mut request = crate::support::lookup(key);
    request.namespace = PAYMENTS.into();
    crate::support::state(crate::support::answered(
        raw.clone().lookup(request).await,
        "Lookup",
    ))
}

/// Counts how often a work ran.
#[derive(Clone, Default)]
pub struct Runs(Arc<AtomicUsize>);

impl Runs {
    pub fn record(&self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }

    pub fn count(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

/// A work's own error, for the tests where the work fails.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum PaymentError {
    #[error("the payment provider is down")]
    ProviderDown,
    #[error("the card was declined")]
    Declined,
}

/// Counts the TryStarts `run_once` sends to claim a key (its debug event "claiming the key"),
/// so that a test can tell a caller that waited on the service from one that polled. Captures
/// the events of the current thread, which runs every task of a `#[tokio::test]`.
pub struct TryStarts {
    seen: Arc<AtomicUsize>,
    _guard: tracing::subscriber::DefaultGuard,
}

impl TryStarts {
    pub fn capture() -> Self {
        use tracing_subscriber::layer::SubscriberExt;
        let seen = Arc::new(AtomicUsize::new(0));
        let subscriber = tracing_subscriber::registry().with(TryStartLayer(seen.clone()));
        Self {
            seen,
            _guard: tracing::subscriber::set_default(subscriber),
        }
    }

    pub fn count(&self) -> usize {
        self.seen.load(Ordering::SeqCst)
    }
}

struct TryStartLayer(Arc<AtomicUsize>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for TryStartLayer {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Message(bool);
        impl tracing::field::Visit for Message {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "message" {
                    self.0 |= format!("{value:?}").contains("claiming the key");
                }
            }
        }
        if event.metadata().target().starts_with("idempotency_client") {
            let mut message = Message(false);
            event.record(&mut message);
            if message.0 {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
    }
}
