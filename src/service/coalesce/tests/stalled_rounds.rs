//! A round that stalls does not hold up the calls queued behind it: after `STALLED_AFTER` they
//! run beside it, in the few places kept for that, and beyond those they wait.

use super::*;

#[tokio::test]
async fn the_calls_behind_a_stalled_round_run_beside_it() {
    let gate = Arc::new(Semaphore::new(0));
    let (coalescer, seen) = recording_shared(
        settings(100, Duration::from_secs(5)),
        Pace::Gate(gate.clone()),
        (
            &Executors::new(1).with_stalled_statements(1),
            &Backlog::new(1_000_000),
        ),
        TaskTracker::new(),
    );
    // The first round stalls at the gate, holding the executor; the call queued behind it waits
    // STALLED_AFTER for the executor, then runs in a round of its own beside it.
    let stalled = spawn_submit(&coalescer, Command::keyed(1));
    until_rounds(&seen, 1).await;
    let behind = spawn_submit(&coalescer, Command::keyed(2));
    until_rounds(&seen, 2).await;
    assert!(!stalled.is_finished(), "the first round still stalls");
    // Only one place beside the executor: a third call waits for either.
    let third = spawn_submit(&coalescer, Command::keyed(3));
    until_holding(&coalescer, 3).await;
    tokio::time::sleep(crate::service::coalesce::queue::STALLED_AFTER * 3).await;
    assert_eq!(seen.lock().expect("rounds").len(), 2, "no third round yet");
    gate.add_permits(3);
    assert_eq!(stalled.await.expect("task").expect("answered"), 2);
    assert_eq!(behind.await.expect("task").expect("answered"), 4);
    assert_eq!(third.await.expect("task").expect("answered"), 6);
}
