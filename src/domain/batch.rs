//! What batching needs to know about commands, without any I/O: which commands conflict (may not
//! share a statement), how much of a batch each takes, and how a batch splits into rounds in
//! which no two commands conflict.
//!
//! **Who guarantees that no statement carries a key twice:** the service's coalescer, which
//! splits every batch with [`rounds`]; a store's batch methods accept only a [`Round`], which
//! cannot be built with two commands for one key.

use std::collections::{HashMap, HashSet};
use std::hash::Hash;

use super::{CompleteCommand, MarkProcessedCommand, TryStartCommand, key_id};

/// A command that can share a batch with others.
pub trait Batchable {
    type Key: Eq + Hash;

    /// Commands with the same key never share a statement: they run in successive rounds (or
    /// are answered from the answer before, see `service::coalesce`).
    /// `None`: the command may share a statement with any other.
    fn conflict_key(&self) -> Option<Self::Key>;

    /// How much of a batch's capacity the command takes.
    fn weight(&self) -> usize {
        1
    }
}

impl Batchable for TryStartCommand {
    type Key = (String, String);
    fn conflict_key(&self) -> Option<Self::Key> {
        Some(key_id(&self.namespace, &self.key))
    }
}

impl Batchable for CompleteCommand {
    type Key = (String, String);
    fn conflict_key(&self) -> Option<Self::Key> {
        Some(key_id(&self.namespace, &self.key))
    }
}

/// Marks of one id by several calls may share a statement: the statement takes the ids in call
/// order, so the first call records the id and the later ones find it processed.
impl Batchable for MarkProcessedCommand {
    type Key = ();
    fn conflict_key(&self) -> Option<()> {
        None
    }
    fn weight(&self) -> usize {
        self.event_ids.len()
    }
}

/// Commands of which no two share a conflict key, in the order they were given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Round<C>(Vec<C>);

/// Two commands of a would-be [`Round`] share a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("two commands of one round share a key")]
pub struct SharedKey;

impl<C: Batchable> Round<C> {
    /// A round of `commands`, refused if two of them share a conflict key.
    pub fn new(commands: Vec<C>) -> Result<Self, SharedKey> {
        if commands.len() < 2 {
            return Ok(Self(commands));
        }
        let mut seen = HashSet::with_capacity(commands.len());
        for key in commands.iter().filter_map(Batchable::conflict_key) {
            if !seen.insert(key) {
                return Err(SharedKey);
            }
        }
        Ok(Self(commands))
    }

    /// A round of one command.
    pub fn one(command: C) -> Self {
        Self(vec![command])
    }
}

impl<C> Round<C> {
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn iter(&self) -> std::slice::Iter<'_, C> {
        self.0.iter()
    }

    pub fn as_slice(&self) -> &[C] {
        &self.0
    }

    pub fn into_commands(self) -> Vec<C> {
        self.0
    }
}

impl<C> IntoIterator for Round<C> {
    type Item = C;
    type IntoIter = std::vec::IntoIter<C>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

/// Which round each of `items` runs in: the first occurrence of every key in round 0, the
/// second in round 1, and so on; items without a key in round 0. Running the rounds one after
/// another resolves duplicates as if the calls had come one after another.
pub fn round_numbers<T, K: Eq + Hash>(items: &[T], key: impl Fn(&T) -> Option<K>) -> Vec<usize> {
    // A lone item (most batches when the store is idle) is round 0 without its key being made.
    if items.len() < 2 {
        return vec![0; items.len()];
    }
    let mut seen: HashMap<K, usize> = HashMap::new();
    items
        .iter()
        .map(|item| match key(item) {
            Some(key) => {
                let occurrence = seen.entry(key).or_insert(0);
                *occurrence += 1;
                *occurrence - 1
            }
            None => 0,
        })
        .collect()
}

/// Splits `items` into rounds in which no two share a key, keeping their order and each item's
/// index in `items` (see [`round_numbers`]).
pub fn rounds<T, K: Eq + Hash>(
    items: Vec<T>,
    key: impl Fn(&T) -> Option<K>,
) -> Vec<Vec<(usize, T)>> {
    let numbers = round_numbers(&items, key);
    let mut rounds: Vec<Vec<(usize, T)>> = Vec::new();
    for ((index, item), round) in items.into_iter().enumerate().zip(numbers) {
        if rounds.len() <= round {
            rounds.resize_with(round + 1, Vec::new);
        }
        rounds[round].push((index, item));
    }
    rounds
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    struct Keyed(Option<u32>);

    impl Batchable for Keyed {
        type Key = u32;
        fn conflict_key(&self) -> Option<u32> {
            self.0
        }
    }

    #[test]
    fn rounds_keep_order_and_separate_duplicates() {
        let split = rounds(
            vec![Some("a"), Some("b"), Some("a"), None, Some("a"), Some("b")],
            |k| *k,
        );
        assert_eq!(
            split,
            vec![
                vec![(0, Some("a")), (1, Some("b")), (3, None)],
                vec![(2, Some("a")), (5, Some("b"))],
                vec![(4, Some("a"))],
            ]
        );
    }

    #[test]
    fn a_round_refuses_a_key_twice_and_takes_keyless_commands_freely() {
        assert_eq!(
            Round::new(vec![Keyed(Some(1)), Keyed(Some(2)), Keyed(Some(1))]),
            Err(SharedKey)
        );
        let round = Round::new(vec![Keyed(None), Keyed(Some(1)), Keyed(None)]).expect("a round");
        assert_eq!(round.len(), 3);
    }
}
