//! The calls that can meet a held key, as the registry of held keys sees them: the rows each
//! locks, and how it runs on its own.

use std::future::Future;
use std::hash::{BuildHasher, RandomState};
use std::pin::Pin;

use crate::domain::admin::{AuditEntry, ForceReleased, KeySummary};
use crate::domain::{
    CompleteCommand, Completion, ExtendLeaseCommand, Key, KeyState, LookupQuery,
    MarkProcessedCommand, ProcessedEvent, Rejection, ReleaseCommand, TryStartCommand,
    TryStartOutcome,
};
pub use crate::store::Row;
use crate::store::{AdminStore, AnyStore, Store, StoreError};

/// A store future that borrows its command.
pub type StoreFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>>;

/// A command that can run on its own, and the rows it locks.
pub trait RunsAlone: Send + Sync + 'static {
    type Answer: Send + 'static;

    /// Whether the call is the key holder's (it carries its lease token): a claim of the key
    /// may be waiting for exactly what it does.
    const FROM_HOLDER: bool = false;

    /// The rows the command locks, in the order its statement locks them.
    fn rows(&self) -> Vec<Row<'_>>;

    /// The command alone, on `store`.
    fn run_alone<'a>(&'a self, store: &'a AnyStore) -> StoreFuture<'a, Self::Answer>;
}

/// The one row of a command on a key.
macro_rules! runs_alone_on_its_key {
    ($command:ty, $answer:ty, $method:ident, from_holder: $from_holder:expr) => {
        impl RunsAlone for $command {
            type Answer = $answer;
            const FROM_HOLDER: bool = $from_holder;
            fn rows(&self) -> Vec<Row<'_>> {
                vec![Row::Key {
                    namespace: self.namespace.as_str(),
                    key: self.key.as_str(),
                }]
            }
            fn run_alone<'a>(&'a self, store: &'a AnyStore) -> StoreFuture<'a, Self::Answer> {
                Box::pin(store.$method(self))
            }
        }
    };
}

runs_alone_on_its_key!(TryStartCommand, TryStartOutcome, try_start, from_holder: false);
runs_alone_on_its_key!(
    CompleteCommand,
    Result<Completion, Rejection>,
    complete,
    from_holder: true
);
runs_alone_on_its_key!(ReleaseCommand, Result<(), Rejection>, release, from_holder: true);
runs_alone_on_its_key!(
    ExtendLeaseCommand,
    Result<crate::domain::Instant, Rejection>,
    extend_lease,
    from_holder: true
);

impl RunsAlone for MarkProcessedCommand {
    type Answer = Vec<ProcessedEvent>;
    fn rows(&self) -> Vec<Row<'_>> {
        self.event_ids
            .iter()
            .map(|id| Row::Event {
                consumer: self.consumer.as_str(),
                id: id.as_str(),
            })
            .collect()
    }
    fn run_alone<'a>(&'a self, store: &'a AnyStore) -> StoreFuture<'a, Self::Answer> {
        Box::pin(store.mark_processed(self))
    }
}

/// A waiting TryStart's look at its key, which marks the row watched (an update, so it may meet
/// a held row like any write).
pub struct Watch(pub LookupQuery);

impl RunsAlone for Watch {
    type Answer = KeyState;
    fn rows(&self) -> Vec<Row<'_>> {
        vec![Row::Key {
            namespace: self.0.namespace.as_str(),
            key: self.0.key.as_str(),
        }]
    }
    fn run_alone<'a>(&'a self, store: &'a AnyStore) -> StoreFuture<'a, Self::Answer> {
        Box::pin(store.watch(&self.0))
    }
}

/// Names rows by a hash of their table and primary key (a collision only sends a call to the
/// lane that did not need it).
#[derive(Debug, Clone, Default)]
pub struct RowNames(RandomState);

impl RowNames {
    pub fn of(&self, row: &Row<'_>) -> u64 {
        self.0.hash_one(row)
    }

    /// The names of `command`'s rows.
    pub fn of_command<C: RunsAlone>(&self, command: &C) -> Vec<u64> {
        command.rows().iter().map(|row| self.of(row)).collect()
    }

    /// A number spread evenly over 0..`bound` for `row` at `now` (for the registry's jitter).
    pub fn spread(&self, row: u64, now: tokio::time::Instant, bound: u64) -> u64 {
        if bound == 0 {
            return 0;
        }
        self.0.hash_one((row, now)) % bound
    }
}

/// An operator's ForceRelease of `key`, recorded as `audit` (whose namespace is the key's).
pub struct ForceRelease {
    pub audit: AuditEntry,
    pub key: Key,
}

/// An operator's EraseKey of `key`, recorded as `audit`.
pub struct EraseKey {
    pub audit: AuditEntry,
    pub key: Key,
}

/// The one row of an operator's change to a key.
macro_rules! runs_alone_as_operator {
    ($command:ty, $answer:ty, $method:ident) => {
        impl RunsAlone for $command {
            type Answer = $answer;
            fn rows(&self) -> Vec<Row<'_>> {
                vec![Row::Key {
                    namespace: self.audit.namespace.as_str(),
                    key: self.key.as_str(),
                }]
            }
            fn run_alone<'a>(&'a self, store: &'a AnyStore) -> StoreFuture<'a, Self::Answer> {
                Box::pin(store.$method(&self.audit, &self.key))
            }
        }
    };
}

runs_alone_as_operator!(ForceRelease, ForceReleased, force_release);
runs_alone_as_operator!(EraseKey, (Option<KeySummary>, i64), erase_key);
