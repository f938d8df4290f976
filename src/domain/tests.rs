use super::*;

fn command(fingerprint: &[u8], attempt_id: Option<&str>) -> TryStartCommand {
    TryStartCommand {
        namespace: Scope::parse("ns".into()).expect("valid scope"),
        key: Key::parse("k".into()).expect("valid key"),
        fingerprint: Fingerprint::parse(fingerprint.to_vec()).expect("valid fingerprint"),
        lease_ttl: LeaseTtl::parse(std::time::Duration::from_secs(30)).expect("valid ttl"),
        retention: KeyRetention::parse(std::time::Duration::from_secs(60))
            .expect("valid retention"),
        attempt_id: attempt_id.map(|a| {
            AttemptId::parse(a.into())
                .expect("valid attempt id")
                .expect("non-empty")
        }),
        holder: None,
    }
}

fn record(attempt_id: Option<&str>, completed: bool) -> KeyRecord {
    let now = Utc::now();
    KeyRecord {
        lease_token: LeaseToken::from_stored(9),
        attempt: 2,
        attempt_id: attempt_id.map(str::to_owned),
        lease_expires_at: now,
        fingerprint: b"fp".to_vec(),
        checkpoint: Some(b"cp".to_vec()),
        response: completed.then(|| b"resp".to_vec()),
        completed_at: completed.then_some(now),
        retention: Duration::from_secs(60),
        expires_at: now + chrono::Duration::hours(1),
    }
}

#[test]
fn fingerprint_mismatch_wins_over_attempt_id() {
    let outcome = TryStartOutcome::from_record(
        record(Some("a"), false),
        false,
        &command(b"other", Some("a")),
    );
    assert_eq!(outcome, TryStartOutcome::FingerprintMismatch);
}

#[test]
fn completed_wins_over_attempt_id() {
    let outcome =
        TryStartOutcome::from_record(record(Some("a"), true), false, &command(b"fp", Some("a")));
    assert_eq!(outcome.name(), "completed");
}

#[test]
fn same_attempt_id_is_started_with_the_same_token() {
    let outcome =
        TryStartOutcome::from_record(record(Some("a"), false), false, &command(b"fp", Some("a")));
    match outcome {
        TryStartOutcome::Started(claim) => assert_eq!(claim.lease_token.get(), 9),
        other => panic!("expected started, got {other:?}"),
    }
}

#[test]
fn other_attempt_ids_and_none_are_in_progress() {
    for attempt_id in [Some("b"), None] {
        let outcome = TryStartOutcome::from_record(
            record(Some("a"), false),
            false,
            &command(b"fp", attempt_id),
        );
        assert_eq!(outcome.name(), "in_progress");
    }
    let outcome = TryStartOutcome::from_record(record(None, false), false, &command(b"fp", None));
    assert_eq!(outcome.name(), "in_progress");
}

#[test]
fn claim_actions_follow_the_contract_order() {
    let now = Utc::now();
    let past = now - chrono::Duration::seconds(1);
    let live = |lease_expires_at, attempt_id: Option<&str>, completed| KeyRecord {
        lease_expires_at,
        ..record(attempt_id, completed)
    };
    let cmd = command(b"fp", Some("a"));
    assert_eq!(claim_action(None, now, &cmd), ClaimAction::Fresh);
    let expired = KeyRecord {
        expires_at: now,
        ..record(Some("a"), true)
    };
    assert_eq!(claim_action(Some(&expired), now, &cmd), ClaimAction::Fresh);
    let other = command(b"other", Some("a"));
    let running = now + chrono::Duration::seconds(5);
    // (the stored key, the later claim, what it does)
    let cases = [
        (live(now, Some("a"), false), &other, ClaimAction::Answer),
        (live(past, Some("a"), true), &cmd, ClaimAction::Answer),
        (live(past, Some("a"), false), &cmd, ClaimAction::Reenter),
        (live(running, Some("b"), false), &cmd, ClaimAction::Answer),
        (live(past, Some("b"), false), &cmd, ClaimAction::Takeover),
    ];
    for (stored, later, action) in cases {
        assert_eq!(
            claim_action(Some(&stored), now, later),
            action,
            "{stored:?}"
        );
    }
}

#[test]
fn a_takeover_keeps_the_checkpoint_and_the_later_expiry() {
    let now = Utc::now();
    let old = KeyRecord {
        lease_expires_at: now - chrono::Duration::seconds(1),
        expires_at: now + chrono::Duration::days(2),
        ..record(Some("old"), false)
    };
    let cmd = command(b"fp", Some("new"));
    let taken = claimed_record(
        Some(old.clone()),
        ClaimAction::Takeover,
        now,
        &cmd,
        LeaseToken::from_stored(10),
    )
    .expect("a record");
    assert_eq!(taken.attempt, 3);
    assert_eq!(taken.checkpoint, old.checkpoint);
    assert_eq!(taken.expires_at, old.expires_at);
    assert_eq!(taken.attempt_id.as_deref(), Some("new"));
    assert_eq!(taken.lease_token.get(), 10);
}

#[test]
fn refusals_follow_the_contract_order() {
    let token = LeaseToken::from_stored(5);
    let completion = Completion {
        completed_at: Utc::now(),
        expires_at: Utc::now(),
    };
    assert_eq!(classify_refusal(None, token), Err(Rejection::KeyNotFound));
    let completed = |lease_token, same_response| GuardedKey {
        lease_token,
        completion: Some(completion.clone()),
        same_response,
    };
    // Completed by another holder, by this one with another response, with the same response.
    let cases = [
        (
            completed(LeaseToken::from_stored(6), false),
            Err(Rejection::LeaseLost),
        ),
        (completed(token, false), Err(Rejection::AlreadyCompleted)),
        (completed(token, true), Ok(Some(completion.clone()))),
    ];
    for (guarded, refusal) in cases {
        assert_eq!(classify_refusal(Some(guarded), token), refusal);
    }
}

/// After `answer` to `earlier`, the holder's own attempt (`holder`) re-enters with the same
/// request (it writes), and is refused with another.
fn assert_the_holder_re_enters(earlier: &TryStartCommand, answer: &TryStartOutcome, holder: &str) {
    assert_eq!(
        answer_after(earlier, answer, &command(b"fp", Some(holder))),
        None,
        "the holder's own attempt re-enters: it writes"
    );
    assert_eq!(
        answer_after(earlier, answer, &command(b"other", Some(holder))),
        Some(TryStartOutcome::FingerprintMismatch)
    );
}

fn started(attempt_id: Option<&str>) -> (TryStartCommand, TryStartOutcome) {
    let claim = Claim {
        lease_token: LeaseToken::from_stored(9),
        lease_expires_at: Utc::now(),
        attempt: 3,
        checkpoint: None,
        kind: ClaimKind::Takeover,
    };
    (command(b"fp", attempt_id), TryStartOutcome::Started(claim))
}

#[test]
fn a_duplicate_after_a_claim_is_in_progress_unless_it_reenters_or_mismatches() {
    let (earlier, answer) = started(Some("a"));
    let TryStartOutcome::Started(claim) = &answer else {
        unreachable!("a claim")
    };
    let held = TryStartOutcome::InProgress {
        lease_expires_at: claim.lease_expires_at,
        attempt: 3,
        holder_attempt_id: Some("a".into()),
    };
    for later in [command(b"fp", None), command(b"fp", Some("b"))] {
        assert_eq!(answer_after(&earlier, &answer, &later), Some(held.clone()));
    }
    assert_the_holder_re_enters(&earlier, &answer, "a");
    // A claim without an attempt_id is re-entered by nobody: every later attempt is held off.
    let (anonymous, answer) = started(None);
    for later in [command(b"fp", None), command(b"fp", Some("x"))] {
        assert!(matches!(
            answer_after(&anonymous, &answer, &later),
            Some(TryStartOutcome::InProgress { attempt: 3, .. })
        ));
    }
}

#[test]
fn a_duplicate_after_in_progress_follows_unless_it_is_the_holders_own_attempt() {
    let held_by = |holder: Option<&str>| TryStartOutcome::InProgress {
        lease_expires_at: Utc::now(),
        attempt: 2,
        holder_attempt_id: holder.map(str::to_owned),
    };
    let earlier = command(b"fp", Some("a"));
    let held = held_by(Some("h"));
    for later in [
        command(b"fp", None),
        command(b"fp", Some("a")),
        command(b"fp", Some("b")),
    ] {
        assert_eq!(answer_after(&earlier, &held, &later), Some(held.clone()));
    }
    assert_the_holder_re_enters(&earlier, &held, "h");
    // A holder without an attempt_id is re-entered by nobody.
    let anonymous = held_by(None);
    assert_eq!(
        answer_after(&earlier, &anonymous, &command(b"fp", Some("h"))),
        Some(anonymous.clone())
    );
}

#[test]
fn a_duplicate_after_a_replay_replays_and_after_a_mismatch_mismatches_only_alike() {
    let now = Utc::now();
    let replay = TryStartOutcome::Completed {
        response: b"resp".to_vec(),
        completion: Completion {
            completed_at: now,
            expires_at: now,
        },
    };
    let earlier = command(b"fp", None);
    assert_eq!(
        answer_after(&earlier, &replay, &command(b"fp", Some("x"))),
        Some(replay.clone())
    );
    assert_eq!(
        answer_after(&earlier, &replay, &command(b"other", None)),
        Some(TryStartOutcome::FingerprintMismatch)
    );
    let mismatch = TryStartOutcome::FingerprintMismatch;
    assert_eq!(
        answer_after(&earlier, &mismatch, &command(b"fp", Some("x"))),
        Some(TryStartOutcome::FingerprintMismatch)
    );
    assert_eq!(
        answer_after(&earlier, &mismatch, &command(b"other", None)),
        None,
        "the key's own fingerprint may be \"other\""
    );
}
