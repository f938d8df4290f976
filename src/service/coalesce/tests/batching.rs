//! Which calls share a statement: a lone call on an idle store runs at once, on its own (there
//! is no timer to wait out), while calls that queue as the store is busy share batches, each
//! closed at its weight.

use super::*;

#[tokio::test]
async fn a_lone_command_runs_at_once_and_a_crowd_shares_batches() {
    let (coalescer, seen) = recording(
        settings(100, Duration::from_secs(5)),
        Duration::from_millis(20),
    );
    assert_eq!(
        coalescer
            .submit(Command::keyed(21))
            .await
            .expect("answered"),
        42
    );
    assert_eq!(
        seen.lock().expect("rounds").len(),
        1,
        "a lone command is not held back"
    );

    let handles: Vec<_> = (0..50)
        .map(|c| spawn_submit(&coalescer, Command::keyed(c)))
        .collect();
    for (c, handle) in (0..50).zip(handles) {
        assert_eq!(handle.await.expect("task").expect("answered"), c * 2);
    }
    let rounds = seen.lock().expect("rounds").len();
    assert!(rounds < 10, "fifty commands shared rounds: {rounds}");
}

#[tokio::test]
async fn batches_close_at_their_weight_and_a_heavy_command_runs_alone() {
    let (coalescer, seen, gate) = gated(settings(10, Duration::from_secs(5)));
    let blocker = spawn_submit(&coalescer, Command::keyed(99));
    until_rounds(&seen, 1).await;
    let weights = [4, 4, 4, 30, 1];
    let mut handles = Vec::new();
    for (value, &weight) in weights.iter().enumerate() {
        let command = Command {
            key: None,
            value: value as u32,
            weight,
        };
        handles.push(spawn_submit(&coalescer, command));
        // Queued in this order, all while the blocker holds the executor.
        let queued: usize = weights[..=value].iter().sum();
        until_holding(&coalescer, 1 + queued).await;
    }
    gate.add_permits(100);
    for (value, handle) in handles.into_iter().enumerate() {
        assert_eq!(handle.await.expect("task").expect("ran"), value as u32 * 2);
    }
    blocker.await.expect("task").expect("answered");
    let batches: Vec<Vec<usize>> = rounds_of(&seen, |c| c.weight).into_iter().skip(1).collect();
    assert_eq!(batches, vec![vec![4, 4], vec![4], vec![30], vec![1]]);
}
