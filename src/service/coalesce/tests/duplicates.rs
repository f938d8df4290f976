//! Calls of one key in one batch: each runs in the round after the one before it, as if they had
//! come one after another, unless the earlier call's answer decides it: then it is answered
//! from that answer and runs nothing.

use super::*;

#[tokio::test]
async fn duplicates_of_a_key_run_in_successive_rounds() {
    let (coalescer, seen) = recording(
        settings(100, Duration::from_secs(5)),
        Duration::from_millis(50),
    );
    // The first keeps the executor busy while the rest queue into one batch.
    let blocker = spawn_submit(&coalescer, Command::keyed(99));
    while seen.lock().expect("rounds").is_empty() {
        tokio::task::yield_now().await;
    }
    let handles: Vec<_> = [1, 2, 1, 1, 3]
        .into_iter()
        .map(|key| spawn_submit(&coalescer, Command::keyed(key)))
        .collect();
    for handle in handles {
        handle.await.expect("task").expect("answered");
    }
    blocker.await.expect("task").expect("answered");
    assert_eq!(
        rounds_of(&seen, |c| c.key),
        vec![
            vec![Some(99)],
            vec![Some(1), Some(2), Some(3)],
            vec![Some(1)],
            vec![Some(1)]
        ]
    );
}

/// Commands of key 1 worth `values`, queued into one batch behind a blocker: each one's
/// answer (None for an error), and the values of every round the executor was given.
async fn one_batch_of_key_one(values: &[u32]) -> (Vec<Option<u32>>, Vec<Vec<u32>>) {
    let (coalescer, seen, gate) = gated(settings(100, Duration::from_secs(5)));
    let blocker = spawn_submit(&coalescer, Command::keyed(99));
    until_rounds(&seen, 1).await;
    let handles: Vec<_> = values
        .iter()
        .map(|&value| {
            let command = Command {
                key: Some(1),
                value,
                weight: 1,
            };
            spawn_submit(&coalescer, command)
        })
        .collect();
    until_holding(&coalescer, values.len() + 1).await;
    gate.add_permits(100);
    blocker.await.expect("task").expect("answered");
    let mut answers = Vec::new();
    for handle in handles {
        answers.push(handle.await.expect("task").ok());
    }
    (answers, rounds_of(&seen, |c| c.value))
}

#[tokio::test]
async fn a_duplicate_its_earlier_answer_decides_runs_no_round_of_its_own() {
    // A command that runs, two that follow its answer, one that runs again, and one that
    // follows the second answer.
    let (answers, ran) = one_batch_of_key_one(&[1, 1000, 1001, 3, 1002]).await;
    assert_eq!(answers, [2, 3, 3, 6, 7].map(Some));
    assert_eq!(
        ran,
        vec![vec![99], vec![1], vec![3]],
        "followers ran nothing"
    );
}

#[tokio::test]
async fn after_a_store_failure_the_next_command_of_the_key_runs_itself() {
    // The first fails: nobody knows how the key stands, so the would-be follower runs, and
    // the one after it follows that one's answer.
    let (answers, ran) = one_batch_of_key_one(&[777, 1000, 1001]).await;
    assert_eq!(answers, vec![None, Some(2000), Some(2001)]);
    assert_eq!(ran, vec![vec![99], vec![777], vec![1000]]);
}
