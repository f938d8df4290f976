//! The operations a model-check sequence is made of, and their random generation.

use proptest::prelude::*;

use super::{ATTEMPTS, EVENTS, FINGERPRINTS, KEYS, RESPONSES};

/// Which token a call presents.
#[derive(Debug, Clone, Copy)]
pub(super) enum TokenChoice {
    /// The key's current token (or its last one, if it has none now).
    Current,
    /// A token the key had before its current one (or a stranger's, if none).
    Previous,
    /// A token that was never issued.
    Bogus,
}

impl TokenChoice {
    /// The token this choice picks among `seen`, the tokens a key was issued, oldest first.
    pub(super) fn pick(self, seen: &[u64]) -> u64 {
        match self {
            TokenChoice::Current => seen.last().copied().unwrap_or(1),
            TokenChoice::Previous => seen
                .len()
                .checked_sub(2)
                .map(|i| seen[i])
                .unwrap_or(i64::MAX as u64 - 1),
            TokenChoice::Bogus => i64::MAX as u64,
        }
    }
}

#[derive(Debug, Clone)]
pub(super) enum Op {
    TryStart {
        key: usize,
        fingerprint: usize,
        attempt: usize,
    },
    Complete {
        key: usize,
        token: TokenChoice,
        response: usize,
    },
    Release {
        key: usize,
        token: TokenChoice,
    },
    ExtendLease {
        key: usize,
        token: TokenChoice,
        checkpoint: Option<Vec<u8>>,
    },
    Lookup {
        key: usize,
    },
    MarkProcessed {
        events: Vec<usize>,
    },
}

fn token_choice() -> impl Strategy<Value = TokenChoice> {
    prop_oneof![
        3 => Just(TokenChoice::Current),
        1 => Just(TokenChoice::Previous),
        1 => Just(TokenChoice::Bogus),
    ]
}

pub(super) fn op() -> impl Strategy<Value = Op> {
    let key = 0..KEYS;
    prop_oneof![
        4 => (key.clone(), 0..FINGERPRINTS.len(), 0..ATTEMPTS.len())
            .prop_map(|(key, fingerprint, attempt)| Op::TryStart { key, fingerprint, attempt }),
        3 => (key.clone(), token_choice(), 0..RESPONSES.len())
            .prop_map(|(key, token, response)| Op::Complete { key, token, response }),
        2 => (key.clone(), token_choice()).prop_map(|(key, token)| Op::Release { key, token }),
        2 => (
            key.clone(),
            token_choice(),
            proptest::option::of(proptest::collection::vec(any::<u8>(), 0..4)),
        )
            .prop_map(|(key, token, checkpoint)| Op::ExtendLease { key, token, checkpoint }),
        2 => key.prop_map(|key| Op::Lookup { key }),
        2 => proptest::collection::vec(0..EVENTS, 1..6)
            .prop_map(|events| Op::MarkProcessed { events }),
    ]
}
