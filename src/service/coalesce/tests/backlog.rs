//! The bounded queue: a call that finds no room is refused at once, with nothing run, and
//! coalescers sharing the executors share one backlog, each call taking its places.

use super::*;

#[tokio::test]
async fn a_full_queue_refuses_at_once_without_running() {
    let (coalescer, seen, gate) = gated(CoalescerSettings {
        queue_capacity: 2,
        ..settings(1, Duration::from_secs(5))
    });
    let running = spawn_submit(&coalescer, Command::keyed(1));
    until_rounds(&seen, 1).await;
    // The running command holds one place until it is answered: one more fits, and the
    // other three are refused at once, all while the executor is held.
    let queued: Vec<_> = (2..6)
        .map(|key| spawn_submit(&coalescer, Command::keyed(key)))
        .collect();
    while queued.iter().filter(|handle| handle.is_finished()).count() < 3 {
        tokio::task::yield_now().await;
    }
    until_holding(&coalescer, 2).await;
    gate.add_permits(100);
    let mut refused = 0;
    let mut answered = 0;
    for handle in queued {
        match handle.await.expect("task") {
            Err(CoordinatorError::Busy) => refused += 1,
            Ok(_) => answered += 1,
            Err(other) => panic!("unexpected: {other:?}"),
        }
    }
    running.await.expect("task").expect("ran");
    assert_eq!((answered, refused), (1, 3));
    let overflow = coalescer.submit(Command::keyed(9)).await;
    assert_eq!(overflow.expect("an empty queue takes it again"), 18);
    let ran = seen.lock().expect("rounds").len();
    assert_eq!(ran, 1 + answered + 1, "refused commands never ran");
}

/// Two kinds share the executor and a backlog of 4 places, the second kind's calls taking
/// two places each: while the first kind holds 3, a call of the second is refused at once
/// although its own queue is empty, and the first kind may still take the last place; once
/// the work is answered, the second kind is served.
#[tokio::test]
async fn kinds_sharing_the_executors_share_one_backlog() {
    let (executors, backlog) = (Executors::new(1), Backlog::new(4));
    let (first, first_seen, first_gate) =
        gated_sharing(settings(1, Duration::from_secs(5)), &executors, &backlog);
    let (second, _, second_gate) = gated_sharing(
        CoalescerSettings {
            places_per_weight: 2,
            ..settings(1, Duration::from_secs(5))
        },
        &executors,
        &backlog,
    );
    let mut first_calls = vec![spawn_submit(&first, Command::keyed(1))];
    until_rounds(&first_seen, 1).await;
    first_calls.extend((2..4).map(|key| spawn_submit(&first, Command::keyed(key))));
    until_holding(&first, 3).await;
    assert!(
        matches!(
            second.submit(Command::keyed(10)).await,
            Err(CoordinatorError::Busy)
        ),
        "the backlog has one place left, the call needs two"
    );
    first_calls.push(spawn_submit(&first, Command::keyed(4)));
    until_holding(&first, 4).await;
    first_gate.add_permits(100);
    second_gate.add_permits(100);
    for call in first_calls {
        call.await.expect("task").expect("answered");
    }
    assert_eq!(second.submit(Command::keyed(10)).await.expect("served"), 20);
}
