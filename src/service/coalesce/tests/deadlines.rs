//! The queue budget: a call that could only start its statement past it is answered "timed out"
//! and never run, so nothing of it is applied. It is checked before every round, not only the
//! first.

use super::*;

/// Submits `first` and, once its round (the executor's `round`th) holds the executor,
/// `queued` behind it; answers once they have all queued: the first's call, then theirs.
async fn queued_behind<const N: usize>(
    coalescer: &Coalescer<Command, u32>,
    seen: &Seen,
    round: usize,
    first: Command,
    queued: [Command; N],
) -> (Submitted, [Submitted; N]) {
    let first = spawn_submit(coalescer, first);
    until_rounds(seen, round).await;
    let queued = queued.map(|command| spawn_submit(coalescer, command));
    until_holding(coalescer, N + 1).await;
    (first, queued)
}

/// Keeps the gate shut until `budget` has passed (with a margin), so that what has queued
/// meanwhile waited past it, then lets `rounds` rounds run.
async fn open_once_past(gate: &Semaphore, budget: Duration, rounds: usize) {
    tokio::time::sleep(budget + Duration::from_millis(50)).await;
    gate.add_permits(rounds);
}

#[tokio::test]
async fn a_command_that_waited_past_its_budget_is_not_run() {
    let budget = Duration::from_millis(50);
    let (coalescer, seen, gate) = gated(settings(1, budget));
    let (first, [second]) =
        queued_behind(&coalescer, &seen, 1, Command::keyed(1), [Command::keyed(2)]).await;
    // The second has queued; the first holds the executor past its budget.
    open_once_past(&gate, budget, 100).await;
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
    let (blocker, [once, twice]) = queued_behind(
        &coalescer,
        &seen,
        1,
        Command::keyed(99),
        [Command::keyed(1), Command::keyed(1)],
    )
    .await;
    // Both have queued; the blocker holds the executor past their budget: neither runs.
    open_once_past(&gate, budget, 1).await;
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
    let (first, [second]) =
        queued_behind(&coalescer, &seen, 2, Command::keyed(7), [Command::keyed(7)]).await;
    open_once_past(&gate, budget, 1).await;
    assert_eq!(first.await.expect("task").expect("ran"), 14);
    let second = second.await.expect("task");
    assert!(
        matches!(second, Err(CoordinatorError::TimedOut(_))),
        "the duplicate's round would start after its budget: {second:?}"
    );
    assert_eq!(
        rounds_of(&seen, |c| c.key),
        vec![vec![Some(99)], vec![Some(7)]]
    );
}
