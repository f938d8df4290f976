//! Keys held by another transaction: the calls of a statement that met one leave the shared path
//! and run alone, and so does a call of a key known to be held, without reaching the executor.

use super::*;

#[tokio::test]
async fn the_calls_of_a_statement_that_met_a_held_key_leave_it_and_run_alone() {
    let isolation = Arc::new(TestIsolation::default());
    let gate = Arc::new(Semaphore::new(0));
    let (coalescer, seen) = recording_isolated(
        settings(100, Duration::from_secs(5)),
        Pace::Gate(gate.clone()),
        (&Executors::new(1), &Backlog::new(1_000_000)),
        TaskTracker::new(),
        isolation.clone(),
    );
    // The first call runs alone and holds the executor at the gate; the next three queue and
    // form one batch, in which key 900 is held.
    let first = spawn_submit(&coalescer, Command::keyed(1));
    until_rounds(&seen, 1).await;
    let queued: Vec<_> = [2, 900, 3]
        .into_iter()
        .map(|key| spawn_submit(&coalescer, Command::keyed(key)))
        .collect();
    until_holding(&coalescer, 4).await;
    gate.add_permits(2);
    assert_eq!(first.await.expect("task").expect("answered"), 2);
    let answers: Vec<u32> = futures::future::join_all(queued)
        .await
        .into_iter()
        .map(|joined| joined.expect("task").expect("answered"))
        .collect();
    // Each call of the failed statement was answered by its run alone (value × 3), told that
    // its statement was shared.
    assert_eq!(answers, vec![6, 2700, 9]);
    assert_eq!(
        isolation.sent_alone(),
        vec![
            (2, WhyAlone::MetHeld { shared: true }),
            (900, WhyAlone::MetHeld { shared: true }),
            (3, WhyAlone::MetHeld { shared: true })
        ]
    );
}

#[tokio::test]
async fn a_lone_call_of_a_held_key_runs_alone_as_its_own() {
    let isolation = Arc::new(TestIsolation::default());
    let (coalescer, seen) = recording_isolated(
        settings(100, Duration::from_secs(5)),
        Pace::Sleep(Duration::ZERO),
        (&Executors::new(1), &Backlog::new(1_000_000)),
        TaskTracker::new(),
        isolation.clone(),
    );
    let answered = |key| coalescer.submit(Command::keyed(key));
    assert_eq!(answered(901).await.expect("answered"), 2703);
    // A key known to be held does not even reach the executor.
    assert_eq!(answered(950).await.expect("answered"), 2850);
    assert_eq!(seen.lock().expect("rounds").len(), 1);
    assert_eq!(
        isolation.sent_alone(),
        vec![
            (901, WhyAlone::MetHeld { shared: false }),
            (950, WhyAlone::KnownHeld)
        ]
    );
}
