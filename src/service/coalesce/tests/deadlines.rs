//! The queue budget: a call that could only start its statement past it is answered "timed out"
//! and never run, so nothing of it is applied. It is checked before every round, not only the
//! first.

use super::*;

#[tokio::test]
async fn a_command_that_waited_past_its_budget_is_not_run() {
    let budget = Duration::from_millis(50);
    let (coalescer, seen, gate) = gated(settings(1, budget));
    let first = spawn_submit(&coalescer, Command::keyed(1));
    until_rounds(&seen, 1).await;
    let second = spawn_submit(&coalescer, Command::keyed(2));
    until_holding(&coalescer, 2).await;
    // The second has queued; the first holds the executor past its budget.
    tokio::time::sleep(budget + Duration::from_millis(50)).await;
    gate.add_permits(100);
    let second = second.await.expect("task");
    assert!(
        matches!(second, Err(CoordinatorError::TimedOut(_))),
        "{second:?}"
    );
    assert_eq!(first.await.expect("task").expect("ran"), 2);
    assert_eq!(
        seen.lock().expect("rounds").len(),
        1,
        "the late one never ran"
    );
}

#[tokio::test]
async fn a_later_round_runs_only_commands_still_within_their_budget() {
    // The executor is held by a gate, so that what waits and how long is the test's order
    // of events, not a guess about how fast a loaded machine spawns tasks.
    let budget = Duration::from_millis(100);
    let (coalescer, seen, gate) = gated(settings(100, budget));
    let blocker = spawn_submit(&coalescer, Command::keyed(99));
    until_rounds(&seen, 1).await;
    let once = spawn_submit(&coalescer, Command::keyed(1));
    let twice = spawn_submit(&coalescer, Command::keyed(1));
    until_holding(&coalescer, 3).await;
    // Both have queued; the blocker holds the executor past their budget: neither runs.
    tokio::time::sleep(budget + Duration::from_millis(50)).await;
    gate.add_permits(1);
    blocker.await.expect("task").expect("answered");
    assert!(matches!(
        once.await.expect("task"),
        Err(CoordinatorError::TimedOut(_))
    ));
    assert!(matches!(
        twice.await.expect("task"),
        Err(CoordinatorError::TimedOut(_))
    ));

    // Two commands of one key: the first's round holds the executor past the budget of
    // the second, whose round (the next) must then not start.
    let first = spawn_submit(&coalescer, Command::keyed(7));
    until_rounds(&seen, 2).await;
    let second = spawn_submit(&coalescer, Command::keyed(7));
    until_holding(&coalescer, 2).await;
    tokio::time::sleep(budget + Duration::from_millis(50)).await;
    gate.add_permits(1);
    assert_eq!(first.await.expect("task").expect("ran"), 14);
    let second = second.await.expect("task");
    assert!(
        matches!(second, Err(CoordinatorError::TimedOut(_))),
        "the duplicate's round would start after its budget: {second:?}"
    );
    let ran: Vec<Vec<Option<u32>>> = seen
        .lock()
        .expect("rounds")
        .iter()
        .map(|round| round.iter().map(|c| c.key).collect())
        .collect();
    assert_eq!(ran, vec![vec![Some(99)], vec![Some(7)]]);
}
