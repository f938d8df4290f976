//! A claim that waited (docs/contract.md, "A claim that waited"): when the service held the
//! claiming TryStart longer than a tenth of the lease, `run_once` renews the lease before the
//! work starts, so that the work gets a whole lease; a renewal refused as lost, or one that
//! cannot get through, keeps the work from running. A real coordinator, with `fault-proxy`
//! between it and the client to count the calls and refuse the renewal.

use std::time::Duration;

use idempotency_client::{Error, Outcome, RunError};
use idempotency_coordinator::proto::idempotency::v1::lookup_response::State;
use idempotency_testkit::FaultProxy;

use super::{PAYMENTS, PaymentError, Runs, payments_state};
use crate::support::*;

/// The lease the waiting caller asks for.
const LEASE: Duration = Duration::from_secs(2);

/// A coordinator, a client whose calls go through a fault proxy, and a generated client that
/// reaches the coordinator directly (the holders that died, and the look at the keys).
struct Setup {
    _app: TestApp,
    proxy: FaultProxy,
    client: idempotency_client::Client,
    raw: Client,
}

impl Setup {
    async fn start(backend: Backend) -> Self {
        let app = TestApp::spawn(backend).await;
        let proxy = FaultProxy::start(app.addr)
            .await
            .expect("fault-proxy starts");
        let client = idempotency_client::Client::builder(proxy.endpoint())
            .build()
            .await
            .expect("connect through the proxy");
        let raw = app.client().await;
        Self {
            _app: app,
            proxy,
            client,
            raw,
        }
    }

    /// A key held by a caller whose process died at once: its lease runs out after `lease`.
    async fn held_by_a_dead_holder(&mut self, lease: Duration) -> String {
        let key = unique_key("waited");
        let mut request = try_start(&key)
            .with_fingerprint(b"")
            .with_lease(Some(duration(lease)));
        request.namespace = PAYMENTS.into();
        claim(&mut self.raw, request).await;
        key
    }

    /// `run_once` with `lease` that may wait 10 s for the holder; the work answers how many
    /// ExtendLease calls had gone through the proxy when it started, and the lease's attempt.
    async fn run_waiting(
        &self,
        key: &str,
        lease: Duration,
        runs: &Runs,
    ) -> Result<Outcome<(usize, u32)>, RunError<PaymentError>> {
        let proxy = &self.proxy;
        self.client
            .run_once(PAYMENTS, key)
            .lease_ttl(lease)
            .wait(Duration::from_secs(10))
            .run(|lease| async move {
                runs.record();
                let renewals = calls_of(proxy, "ExtendLease").await;
                Ok::<_, PaymentError>((renewals, lease.attempt()))
            })
            .await
    }

    async fn fault_every_renewal(&self, code: &str, reason: Option<&str>, times: i64) {
        let fault = serde_json::json!({
            "method": "ExtendLease", "action": "status", "code": code, "reason": reason,
            "times": times,
        });
        self.proxy
            .post("/faults", &fault.to_string())
            .await
            .expect("fault-proxy /faults");
    }
}

async fn calls_of(proxy: &FaultProxy, method: &str) -> usize {
    let calls = proxy.calls().await.expect("fault-proxy /calls");
    calls.get(method).map_or(0, Vec::len)
}

async fn a_claim_that_waited_is_renewed_once_before_the_work_starts(backend: Backend) {
    let mut setup = Setup::start(backend).await;
    let runs = Runs::default();

    // Answered at once (well within a tenth of a 30 s lease, however busy the machine): the
    // lease counted from the TryStart's sending is whole, and not renewed.
    let fresh = unique_key("at-once");
    let outcome = setup
        .run_waiting(&fresh, Duration::from_secs(30), &runs)
        .await
        .expect("the fresh claim runs");
    assert_eq!(outcome.value, (0, 1), "no renewal before the work");
    assert_eq!(calls_of(&setup.proxy, "ExtendLease").await, 0);

    // Held for a second (half the lease) by a holder that died: renewed before the work.
    let key = setup.held_by_a_dead_holder(Duration::from_secs(1)).await;
    let outcome = setup
        .run_waiting(&key, LEASE, &runs)
        .await
        .expect("the waited claim runs");
    assert_eq!(
        outcome.value,
        (1, 2),
        "one renewal, before the work started, of the key taken over"
    );
    assert_eq!(calls_of(&setup.proxy, "ExtendLease").await, 1);
    assert_eq!(runs.count(), 2);
    assert!(matches!(
        payments_state(&setup.raw, &key).await,
        State::Completed(_)
    ));
}

async fn a_renewal_refused_as_lost_is_lease_lost_and_the_work_does_not_run(backend: Backend) {
    let mut setup = Setup::start(backend).await;
    let runs = Runs::default();
    for (code, reason) in [("ABORTED", "LEASE_LOST"), ("NOT_FOUND", "KEY_NOT_FOUND")] {
        let key = setup.held_by_a_dead_holder(Duration::from_secs(1)).await;
        setup.fault_every_renewal(code, Some(reason), 1).await;
        let outcome = setup.run_waiting(&key, LEASE, &runs).await;
        assert!(
            matches!(outcome, Err(RunError::Coordinator(Error::LeaseLost(_)))),
            "a renewal refused {reason}: {outcome:?}"
        );
    }
    assert_eq!(runs.count(), 0, "the work never ran");
    assert_eq!(
        calls_of(&setup.proxy, "Release").await,
        0,
        "a lost key is not this caller's to release"
    );
}

async fn a_renewal_that_cannot_get_through_fails_and_releases_the_key(backend: Backend) {
    let mut setup = Setup::start(backend).await;
    let runs = Runs::default();
    setup.fault_every_renewal("UNAVAILABLE", None, -1).await;

    // The TryStart took half the lease: the renewal is retried while the lease counted from
    // the TryStart's sending lasts, not for the whole retry budget (30 s).
    let key = setup.held_by_a_dead_holder(Duration::from_secs(1)).await;
    let asked_at = std::time::Instant::now();
    let outcome = setup.run_waiting(&key, LEASE, &runs).await;
    let took = asked_at.elapsed();
    assert!(
        matches!(outcome, Err(RunError::Coordinator(Error::Unavailable(_)))),
        "{outcome:?}"
    );
    assert!(
        took < LEASE + Duration::from_millis(500),
        "gave up after {took:?}"
    );
    let renewals = calls_of(&setup.proxy, "ExtendLease").await;
    assert!(renewals >= 2, "the renewal was retried: {renewals} tries");
    assert_eq!(calls_of(&setup.proxy, "Release").await, 1);
    assert!(
        matches!(payments_state(&setup.raw, &key).await, State::Absent(_)),
        "released, so that a retry need not wait for the lease"
    );

    // The TryStart took longer than the lease: the lease counted from its sending has run out
    // already, so the renewal is sent once and not retried.
    let key = setup
        .held_by_a_dead_holder(Duration::from_millis(2500))
        .await;
    let outcome = setup.run_waiting(&key, LEASE, &runs).await;
    assert!(
        matches!(outcome, Err(RunError::Coordinator(Error::Unavailable(_)))),
        "{outcome:?}"
    );
    assert_eq!(calls_of(&setup.proxy, "ExtendLease").await, renewals + 1);
    assert_eq!(calls_of(&setup.proxy, "Release").await, 2);
    assert!(matches!(
        payments_state(&setup.raw, &key).await,
        State::Absent(_)
    ));
    assert_eq!(runs.count(), 0, "the work never ran");
}

for_each_backend!(
    a_claim_that_waited_is_renewed_once_before_the_work_starts,
    a_renewal_refused_as_lost_is_lease_lost_and_the_work_does_not_run,
    a_renewal_that_cannot_get_through_fails_and_releases_the_key,
);
