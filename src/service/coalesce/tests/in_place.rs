//! A lone call on an idle coalescer runs in its caller's task, and is still answered, or run to
//! its end, when that task stops waiting or the run panics.

use super::*;

#[tokio::test]
async fn a_lone_command_runs_in_its_callers_task() {
    // The executor notes the task each round runs in.
    let ran_in = Arc::new(Mutex::new(Vec::new()));
    let noted = ran_in.clone();
    let coalescer = Coalescer::start(
        "test dispatcher",
        &lifecycle(),
        settings(100, Duration::from_secs(5)),
        (&Executors::new(1), &Backlog::new(1000)),
        TaskTracker::new(),
        InFlight::default(),
        Arc::new(TestIsolation::default()),
        move |round: &Round<Command>| {
            noted.lock().expect("tasks").push(tokio::task::try_id());
            let commands: Vec<Command> = round.iter().copied().collect();
            Box::pin(async move { commands.into_iter().map(|c| Ok(c.value)).collect() })
        },
    );
    let caller = tokio::spawn(async move {
        let answer = coalescer.submit(Command::keyed(5)).await;
        (tokio::task::id(), answer)
    });
    let (caller_task, answer) = caller.await.expect("task");
    assert_eq!(answer.expect("answered"), 5);
    assert_eq!(*ran_in.lock().expect("tasks"), vec![Some(caller_task)]);
}

#[tokio::test]
async fn a_lone_command_whose_caller_stops_waiting_still_runs_to_its_end() {
    use futures::FutureExt;

    let tasks = TaskTracker::new();
    let (coalescer, seen, gate) = gated_tracked(settings(100, Duration::from_secs(5)), &tasks);
    let caller = spawn_submit(&coalescer, Command::keyed(7));
    // Its round has begun, in the caller's task, and waits at the gate; it counts among the
    // tracked tasks, so that a shutdown would wait for it.
    until_rounds(&seen, 1).await;
    assert_eq!(tasks.len(), 1, "the run in place is tracked");
    tasks.close();
    caller.abort();
    assert!(caller.await.is_err_and(|error| error.is_cancelled()));
    // The run goes on without its caller, still tracked: the command keeps its place until
    // it is answered, and the wait for the tracked tasks does not end under it.
    assert_eq!(coalescer.queued(), 1, "the run was dropped with its caller");
    assert_eq!(tasks.len(), 1, "the run on its own is tracked");
    assert!(
        tasks.wait().now_or_never().is_none(),
        "shutdown waits for it"
    );
    gate.add_permits(1);
    tokio::time::timeout(Duration::from_secs(10), tasks.wait())
        .await
        .expect("the run, on its own, got to its end");
    assert_eq!(coalescer.queued(), 0, "and answered its command");
    assert_eq!(seen.lock().expect("rounds").len(), 1, "it ran once");
}

#[tokio::test]
async fn a_lone_command_whose_run_panics_is_answered_and_its_caller_goes_on() {
    let (coalescer, _seen) = recording(settings(100, Duration::from_secs(5)), Duration::ZERO);
    // Were the panic to reach the caller, this test's own task would fail with it.
    let answer = coalescer.submit(Command::keyed(666)).await;
    assert!(
        matches!(answer, Err(CoordinatorError::TimedOut(_))),
        "{answer:?}"
    );
    assert_eq!(coalescer.submit(Command::keyed(4)).await.expect("ran"), 8);
}
