use std::sync::atomic::Ordering;
use std::time::Duration;

use super::registry::{MAX_REMEMBERED, SWEEP_EVERY};
use super::*;
use crate::domain::MarkProcessedCommand;

fn row(names: &RowNames, n: usize) -> u64 {
    let id = n.to_string();
    names.of(&Row::Event {
        consumer: "c",
        id: &id,
    })
}

fn registry(remember_for: Duration) -> HeldKeys {
    HeldKeys::new(1, 1, 1, remember_for)
}

#[test]
fn the_lane_and_the_reruns_are_a_quarter_each_of_what_the_database_runs_at_once() {
    let held = HeldKeys::for_capacity(1, 16, Duration::from_secs(5));
    assert_eq!(held.inner.places[0].lane.available_permits(), 4);
    assert_eq!(held.inner.places[0].reruns.available_permits(), 4);
    let smallest = HeldKeys::for_capacity(1, 4, Duration::from_secs(5));
    assert_eq!(smallest.inner.places[0].lane.available_permits(), 1);
    assert_eq!(smallest.inner.places[0].reruns.available_permits(), 1);
}

#[test]
fn rows_are_remembered_until_forgotten() {
    let held = registry(Duration::from_secs(60));
    let row = row(held.names(), 1);
    held.remember(&[row]);
    assert_eq!(held.remembered(), 1);
    held.forget(&[row]);
    assert_eq!(held.remembered(), 0);
}

#[test]
fn a_row_not_found_held_again_is_forgotten_by_itself() {
    let held = registry(Duration::from_millis(50));
    let command = MarkProcessedCommand {
        consumer: crate::domain::Scope::parse("c".into()).expect("scope"),
        event_ids: vec![crate::domain::EventId::parse("e".into()).expect("id")],
        retention: crate::domain::EventRetention::parse(Duration::from_secs(60))
            .expect("retention"),
    };
    held.remember(&held.names().of_command(&command));
    assert!(held.any_held(&command));
    // A short real time: past the row's time and the next sweep.
    std::thread::sleep(SWEEP_EVERY + Duration::from_millis(60));
    // Past its time: not held, and the count (which spares the hot path the lock) is back
    // to zero without anything else remembered or forgotten.
    assert!(!held.any_held(&command));
    assert_eq!(held.inner.count.load(Ordering::Relaxed), 0);
    assert_eq!(held.remembered(), 0);
}

#[test]
fn keys_found_held_together_are_forgotten_apart() {
    // Each row is remembered for between half the time and all of it: of 200 rows found held
    // at one instant, some are forgotten after 60% of it and some still held at 90%.
    let names = RowNames::default();
    let rows: Vec<u64> = (0..200).map(|n| row(&names, n)).collect();
    let mut remembered = registry::Remembered::default();
    let now = Instant::now();
    remembered.remember(&rows, &names, now, Duration::from_secs(10));
    let held_at = |seconds: u64| {
        rows.iter()
            .filter(|row| remembered.is_held(**row, now + Duration::from_secs(seconds)))
            .count()
    };
    let (at_four, at_six, at_nine, at_eleven) = (held_at(4), held_at(6), held_at(9), held_at(11));
    assert_eq!(at_four, 200, "none is forgotten before half the time");
    assert!(
        at_six < 200 && at_six > at_nine && at_nine > 0,
        "held: {at_six} after 6 s, {at_nine} after 9 s"
    );
    assert_eq!(at_eleven, 0, "none outlives the whole time");
}

#[test]
fn the_registry_is_bounded() {
    let held = registry(Duration::from_secs(60));
    let rows: Vec<u64> = (0..MAX_REMEMBERED + 10)
        .map(|n| row(held.names(), n))
        .collect();
    held.remember(&rows);
    assert_eq!(held.remembered(), MAX_REMEMBERED);
}

#[tokio::test]
async fn a_caller_that_has_gone_leaves_the_queue_for_a_place() {
    let held = registry(Duration::from_secs(60));
    let taken = held.inner.places[0]
        .lane
        .acquire()
        .await
        .expect("the lane's one place");
    let gone = CancellationToken::new();
    let waiting = {
        let (held, gone) = (held.clone(), gone.clone());
        tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(60);
            held.wait(held.inner.places[0].lane.acquire(), deadline, &gone)
                .await
                .map(drop)
        })
    };
    gone.cancel();
    let left = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("it leaves at once")
        .expect("task");
    assert!(left.is_err(), "it took no place");
    drop(taken);
    assert_eq!(held.inner.places[0].lane.available_permits(), 1);
}
