//! The admin API's operations on a store ([`AdminStore`]): listings by the indexes of each
//! order, one key's record, a namespace's numbers, the changes an operator makes (each recorded
//! in the audit trail in the same transaction), and the stuck-keys gauges. Kept apart from
//! [`Store`] (the contract's operations): nothing on the hot path calls these.

use std::future::Future;

pub(super) mod rows;

use super::{AnyStore, Store, StoreError};
use crate::domain::admin::{
    AuditEntry, AuditEvent, AuditFilter, EraseBatch, ForceReleased, FullKey, KeyFilter, KeySummary,
    NamespaceStats, PageCursor, StuckSummary,
};
use crate::domain::{Key, Scope};

/// Where a pass of a namespace's erasure has got to: the greatest key and event id its batches
/// took (`None`: the start of the namespace). Each batch continues after it, so that a batch
/// never steps over the index entries of the rows the batches before it deleted (in
/// PostgreSQL they stay in the index until a vacuum, and a batch that started from the
/// namespace's start grew slower with every batch, past its statement timeout under load).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EraseCursor {
    pub after_key: Option<String>,
    pub after_event: Option<String>,
}

impl EraseCursor {
    /// Moves past what `erased`'s batch took; a side that took nothing stays where it was.
    pub fn advance(&mut self, erased: &Erased) {
        if let Some(key) = &erased.last_key {
            self.after_key = Some(key.clone());
        }
        if let Some(event) = &erased.last_event {
            self.after_event = Some(event.clone());
        }
    }
}

/// The next batch of a namespace's erasure: at most `size` keys of `namespace` and at most `size`
/// processed events of the consumer of the same name, the first ones after `from` in key (event
/// id) order.
#[derive(Debug, Clone, Copy)]
pub struct NamespaceBatch<'a> {
    pub namespace: &'a Scope,
    pub size: EraseBatch,
    pub from: &'a EraseCursor,
}

/// What one batch of a namespace's erasure deleted, and where the next batch starts: the
/// greatest key and event id it took (the next [`EraseCursor`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Erased {
    pub keys: u64,
    pub events: u64,
    pub last_key: Option<String>,
    pub last_event: Option<String>,
    /// Whether both sides found fewer rows after the cursor than a batch: the pass is over. (A
    /// row a batch took but could not delete, updated by another transaction meanwhile, does
    /// not end the pass: it lies behind the cursor, for the next one.)
    pub pass_over: bool,
}

/// Something a store announces that every replica must act on at once: the replay cache
/// forgets erased keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Erasure {
    Namespace(String),
    Key {
        namespace: String,
        key: String,
    },
    /// Erasures may have been missed (the store's listener reconnected): forget everything.
    Missed,
    /// Every erasure that committed before a heartbeat this replica sent at `sent` has been
    /// announced before this, on the store's part `part` (each cluster of a clustered store is
    /// one, else 0): a replay cache that applied them is confirmed for that part from then.
    Caught {
        sent: std::time::Instant,
        part: usize,
    },
    /// An eraser asks every replica to acknowledge, once it has applied what came before.
    Barrier(u64),
    /// `replica` (as `Replicas::ask_acknowledgements` names it) acknowledged `barrier`.
    Acknowledged {
        barrier: u64,
        replica: String,
    },
}

impl Erasure {
    /// The payload of the store's announcement (`<namespace>` or `<namespace> U+001F <key>`).
    pub fn payload(&self) -> String {
        match self {
            Self::Namespace(namespace) => namespace.clone(),
            Self::Key { namespace, key } => format!("{namespace}\u{1f}{key}"),
            Self::Missed | Self::Caught { .. } | Self::Barrier(_) | Self::Acknowledged { .. } => {
                String::new()
            }
        }
    }

    pub fn from_payload(payload: &str) -> Self {
        match payload.split_once('\u{1f}') {
            Some((namespace, key)) => Self::Key {
                namespace: namespace.to_owned(),
                key: key.to_owned(),
            },
            None => Self::Namespace(payload.to_owned()),
        }
    }
}

/// A page of a listing that a store is asked for: at most `limit` rows that `filter` selects,
/// those after `after` (where the page before ended; `None`: the first page) in the listing's
/// order.
#[derive(Debug)]
pub struct Page<'a, Filter, Cursor> {
    pub filter: &'a Filter,
    pub after: Option<Cursor>,
    pub limit: u32,
}

// By hand: a derived `Copy` would ask the filter to be `Copy` too, though only its reference is.
impl<Filter, Cursor: Copy> Clone for Page<'_, Filter, Cursor> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<Filter, Cursor: Copy> Copy for Page<'_, Filter, Cursor> {}

/// A page of keys, in `filter.order()`.
pub type KeyPage<'a> = Page<'a, KeyFilter, &'a PageCursor>;

/// A page of a namespace's audit trail, newest first: after an event, those with a lesser id.
pub type AuditPage<'a> = Page<'a, AuditFilter, i64>;

pub trait AdminStore: Store {
    /// The keys of `page`.
    fn list_keys(
        &self,
        page: KeyPage<'_>,
    ) -> impl Future<Output = Result<Vec<KeySummary>, StoreError>> + Send;

    /// One live key's whole record.
    fn get_key(
        &self,
        namespace: &Scope,
        key: &Key,
    ) -> impl Future<Output = Result<Option<FullKey>, StoreError>> + Send;

    fn namespace_stats(
        &self,
        namespace: &Scope,
    ) -> impl Future<Output = Result<NamespaceStats, StoreError>> + Send;

    /// Revokes the lease of an in-progress key whatever its token (a new token nobody holds,
    /// the lease ended now: its holder's writes are refused as lease lost, and the next claim
    /// takes it over), recording `audit` with the record before, in one transaction.
    fn force_release(
        &self,
        audit: &AuditEntry,
        key: &Key,
    ) -> impl Future<Output = Result<ForceReleased, StoreError>> + Send;

    /// Deletes a key in whatever state, recording `audit` with the record before (if it was
    /// live), in one transaction; answers that record and the audit event's id.
    fn erase_key(
        &self,
        audit: &AuditEntry,
        key: &Key,
    ) -> impl Future<Output = Result<(Option<KeySummary>, i64), StoreError>> + Send;

    /// Deletes `batch`, skipping rows other transactions hold.
    fn erase_namespace_batch(
        &self,
        batch: NamespaceBatch<'_>,
    ) -> impl Future<Output = Result<Erased, StoreError>> + Send;

    /// Whether `namespace` still has any key or processed event, expired ones included.
    fn namespace_has_rows(
        &self,
        namespace: &Scope,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Records an audit event without a record before; answers its id.
    fn record_audit(
        &self,
        audit: &AuditEntry,
    ) -> impl Future<Output = Result<i64, StoreError>> + Send;

    /// The live audit events of `page`.
    fn list_audit(
        &self,
        page: AuditPage<'_>,
    ) -> impl Future<Output = Result<Vec<AuditEvent>, StoreError>> + Send;

    /// Deletes at most `limit` expired audit events, like [`Store::reap_expired_keys`].
    fn reap_expired_audit(
        &self,
        limit: u32,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Stuck keys across all namespaces, from the in-progress keys' index.
    fn stuck_keys(&self) -> impl Future<Output = Result<StuckSummary, StoreError>> + Send;

    /// Erasures announced by any replica (this one included), as they commit, and what the
    /// replicas announce of them.
    fn erasures(&self) -> tokio::sync::broadcast::Receiver<Erasure>;
}

impl AdminStore for AnyStore {
    async fn list_keys(&self, page: KeyPage<'_>) -> Result<Vec<KeySummary>, StoreError> {
        delegate!(self, store => store.list_keys(page))
    }

    async fn get_key(&self, namespace: &Scope, key: &Key) -> Result<Option<FullKey>, StoreError> {
        delegate!(self, store => store.get_key(namespace, key))
    }

    async fn namespace_stats(&self, namespace: &Scope) -> Result<NamespaceStats, StoreError> {
        delegate!(self, store => store.namespace_stats(namespace))
    }

    async fn force_release(
        &self,
        audit: &AuditEntry,
        key: &Key,
    ) -> Result<ForceReleased, StoreError> {
        delegate!(self, store => store.force_release(audit, key))
    }

    async fn erase_key(
        &self,
        audit: &AuditEntry,
        key: &Key,
    ) -> Result<(Option<KeySummary>, i64), StoreError> {
        delegate!(self, store => store.erase_key(audit, key))
    }

    async fn erase_namespace_batch(&self, batch: NamespaceBatch<'_>) -> Result<Erased, StoreError> {
        delegate!(self, store => store.erase_namespace_batch(batch))
    }

    async fn namespace_has_rows(&self, namespace: &Scope) -> Result<bool, StoreError> {
        delegate!(self, store => store.namespace_has_rows(namespace))
    }

    async fn record_audit(&self, audit: &AuditEntry) -> Result<i64, StoreError> {
        delegate!(self, store => store.record_audit(audit))
    }

    async fn list_audit(&self, page: AuditPage<'_>) -> Result<Vec<AuditEvent>, StoreError> {
        delegate!(self, store => store.list_audit(page))
    }

    async fn reap_expired_audit(&self, limit: u32) -> Result<u64, StoreError> {
        delegate!(self, store => store.reap_expired_audit(limit))
    }

    async fn stuck_keys(&self) -> Result<StuckSummary, StoreError> {
        delegate!(self, store => store.stuck_keys())
    }

    fn erasures(&self) -> tokio::sync::broadcast::Receiver<Erasure> {
        match self {
            Self::Postgres(store) => store.erasures(),
            Self::Clusters(store) => store.erasures(),
            Self::Sqlite(store) => store.erasures(),
        }
    }
}
