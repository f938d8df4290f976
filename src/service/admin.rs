//! The operator's actions (the admin API) on the store: listings a page at a time, a key's
//! record, a namespace's numbers, and the recorded changes (ForceRelease, EraseKey,
//! EraseNamespace), after which this replica's replay cache forgets what was erased at once,
//! and the erasure answers only once every other replica has too (`service/erasures.rs`).
//!
//! Nothing here is on the path of the contract's calls: an erasure runs one bounded batch at a
//! time on one connection, each after the last key the one before it erased, and rests
//! between batches, so that calls keep most of the store while it runs.

use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub mod moves;

use super::ReplayCache;
use super::erasures::{Honoured, every_replica_honoured};
use super::held_keys::{EraseKey, ForceRelease, HeldKeys, RunsAlone};
use crate::domain::admin::{
    AdminAction, AuditEntry, AuditEvent, AuditFilter, EraseBatch, ForceReleased, FullKey,
    KeyFilter, KeySummary, NamespaceStats, PageCursor, PageSize, Reason,
};
use crate::domain::{Key, Scope};
use crate::store::{AdminStore, AnyStore, EraseCursor, NamespaceBatch, Page, StoreError};
use crate::telemetry::error_chain;

/// How long the audit trail keeps an event by default (`--audit-retention`).
pub const DEFAULT_AUDIT_RETENTION: Duration = Duration::from_secs(90 * 24 * 3600);

/// How often an erasure whose pass left rows (held by others: a claim's statement; or written
/// behind it) goes over the namespace again, and how many times at most, before it ends with
/// those rows left: over 3 s, longer than a call's statement may run with the default
/// `--operation-timeout` (2.5 s), so that a row still held then is held by something else than
/// the service's calls. Bounded in passes too, since each pass starts from the beginning.
const HELD_ROWS_RETRY: Duration = Duration::from_millis(50);
const HELD_ROWS_ATTEMPTS: u32 = 60;

/// After each full batch an erasure rests this many times as long as the batch took (at most
/// [`LONGEST_REST`]), so that it takes about a fifth of the store's time. Unpaced, a million
/// keys went in 6-7 s on the 2-core development machine, but 64 callers' TryStart kept only
/// 62-72 % of its throughput meanwhile: the batches' deletes took the database's CPU from the
/// calls. Paced, the erasure takes 27-30 s and the calls keep 88-97 % (BENCHMARKS.md, "An
/// erasure under load"). A data-protection erasure has minutes; the calls do not.
const REST_PER_BATCH_TIME: u32 = 4;
const LONGEST_REST: Duration = Duration::from_secs(1);

/// How many times in a row a batch may fail with a transient store error before the erasure
/// gives up (it is recorded either way).
const TRANSIENT_FAILURES_ALLOWED: u32 = 5;

/// An erasure's progress, as its stream reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EraseProgress {
    pub keys: u64,
    pub events: u64,
    pub done: bool,
    /// Whether it ended before the namespace was empty (a store failure, shutdown, rows held
    /// for longer than it waits).
    pub incomplete: bool,
    pub audit_id: i64,
}

/// The operator's side of the coordinator. Cheap to clone.
#[derive(Clone)]
pub struct Admin {
    store: AnyStore,
    /// Held keys: a ForceRelease or EraseKey of a key another transaction holds waits for it
    /// in the held-key lane, in its key's turn, like the key's calls (`held_keys`).
    held: HeldKeys,
    operation_timeout: Duration,
    replays: Option<ReplayCache>,
    audit_retention: Duration,
    tasks: TaskTracker,
    shutdown: CancellationToken,
}

/// Who acts, and why, for the audit trail.
#[derive(Debug, Clone)]
pub struct Actor {
    pub name: String,
    pub reason: Reason,
}

impl Admin {
    pub fn new(
        (store, held): (AnyStore, HeldKeys),
        operation_timeout: Duration,
        replays: Option<ReplayCache>,
        audit_retention: Duration,
        tasks: TaskTracker,
        shutdown: CancellationToken,
    ) -> Self {
        Self {
            store,
            held,
            operation_timeout,
            replays,
            audit_retention,
            tasks,
            shutdown,
        }
    }

    /// `command`, a change to one key, under the held-key rule, by the operation's deadline
    /// (less the share left for the answer, as for every call).
    async fn on_held_key<C: RunsAlone>(&self, command: &C) -> Result<C::Answer, StoreError> {
        let deadline =
            tokio::time::Instant::now() + self.operation_timeout - self.operation_timeout / 20;
        // Awaited in the caller's own task: a caller that goes drops every wait with it.
        self.held
            .run_as_operator(&self.store, command, deadline)
            .await
    }

    fn audit(
        &self,
        actor: &Actor,
        action: AdminAction,
        namespace: &Scope,
        key: Option<&Key>,
    ) -> AuditEntry {
        AuditEntry {
            actor: actor.name.clone(),
            action,
            namespace: namespace.clone(),
            key: key.cloned(),
            reason: actor.reason.clone(),
            outcome_json: None,
            retention: self.audit_retention,
        }
    }

    /// One page of `filter`'s keys after `after`, and the cursor of the next page (none on the
    /// last).
    pub async fn list_keys(
        &self,
        filter: &KeyFilter,
        after: Option<&PageCursor>,
        page: PageSize,
    ) -> Result<(Vec<KeySummary>, Option<PageCursor>), StoreError> {
        let keys = self.store.list_keys(one_past(filter, after, page)).await?;
        Ok(cut_to(keys, page, |last| {
            PageCursor::after(filter.order(), last)
        }))
    }

    pub async fn get_key(
        &self,
        namespace: &Scope,
        key: &Key,
    ) -> Result<Option<FullKey>, StoreError> {
        self.store.get_key(namespace, key).await
    }

    pub async fn namespace_stats(&self, namespace: &Scope) -> Result<NamespaceStats, StoreError> {
        self.store.namespace_stats(namespace).await
    }

    pub async fn force_release(
        &self,
        actor: &Actor,
        namespace: &Scope,
        key: &Key,
    ) -> Result<ForceReleased, StoreError> {
        let audit = self.audit(actor, AdminAction::ForceRelease, namespace, Some(key));
        let release = ForceRelease {
            audit,
            key: key.clone(),
        };
        let released = self.on_held_key(&release).await?;
        if let ForceReleased::Released { audit_id, .. } = &released {
            tracing::warn!(
                actor = actor.name,
                namespace = namespace.as_str(),
                audit_id,
                "an operator released an in-progress key"
            );
        }
        Ok(released)
    }

    pub async fn erase_key(
        &self,
        actor: &Actor,
        namespace: &Scope,
        key: &Key,
    ) -> Result<(Option<KeySummary>, i64), StoreError> {
        let audit = self.audit(actor, AdminAction::EraseKey, namespace, Some(key));
        let erase = EraseKey {
            audit,
            key: key.clone(),
        };
        let erased = self.on_held_key(&erase).await?;
        let committed = Instant::now();
        if let Some(replays) = &self.replays {
            replays.forget_key(namespace.as_str(), key.as_str());
        }
        self.until_every_replica_honoured(committed, namespace, erased.1)
            .await;
        tracing::warn!(
            actor = actor.name,
            namespace = namespace.as_str(),
            audit_id = erased.1,
            "an operator erased a key"
        );
        Ok(erased)
    }

    /// Records the erasure and starts it in a task of its own, which runs to its end whether
    /// or not anyone follows its progress (until shutdown, which it heeds between batches).
    pub async fn erase_namespace(
        &self,
        actor: &Actor,
        namespace: &Scope,
        batch: EraseBatch,
    ) -> Result<watch::Receiver<EraseProgress>, StoreError> {
        let audit = self.audit(actor, AdminAction::EraseNamespace, namespace, None);
        let audit_id = self.store.record_audit(&audit).await?;
        tracing::warn!(
            actor = actor.name,
            namespace = namespace.as_str(),
            audit_id,
            "an operator began erasing a namespace"
        );
        let (progress, follow) = watch::channel(EraseProgress {
            audit_id,
            ..EraseProgress::default()
        });
        let this = self.clone();
        let mut done = AuditEntry {
            action: AdminAction::EraseNamespaceDone,
            ..audit
        };
        let namespace = namespace.clone();
        self.tasks.spawn(async move {
            let last = this.erase_all(&namespace, batch, audit_id, &progress).await;
            this.until_every_replica_honoured(Instant::now(), &namespace, audit_id)
                .await;
            done.outcome_json = Some(
                serde_json::json!({
                    "erase_namespace_audit_id": audit_id,
                    "keys_erased": last.keys,
                    "events_erased": last.events,
                    "complete": !last.incomplete,
                })
                .to_string(),
            );
            if let Err(error) = this.store.record_audit(&done).await {
                tracing::error!(namespace = namespace.as_str(), audit_id,
                    error = %error_chain(&error), "recording the end of an erasure failed");
            }
            tracing::warn!(
                namespace = namespace.as_str(),
                audit_id,
                keys = last.keys,
                events = last.events,
                complete = !last.incomplete,
                "an erasure ended"
            );
            progress.send_replace(EraseProgress { done: true, ..last });
        });
        Ok(follow)
    }

    /// Erases batch after batch until the namespace has nothing left; answers the totals.
    ///
    /// A pass goes through the namespace once in key order, each batch after the last key the
    /// one before it erased. Rows a batch skipped because another transaction held them, and
    /// rows written behind the pass, are left by it: when a pass ends with rows left, another
    /// one starts from the beginning, a few times ([`HELD_ROWS_ATTEMPTS`]) before giving up.
    async fn erase_all(
        &self,
        namespace: &Scope,
        batch: EraseBatch,
        audit_id: i64,
        progress: &watch::Sender<EraseProgress>,
    ) -> EraseProgress {
        let mut total = EraseProgress {
            audit_id,
            ..EraseProgress::default()
        };
        let mut cursor = EraseCursor::default();
        let mut failures = 0;
        let mut held_attempts = 0;
        loop {
            if self.shutdown.is_cancelled() {
                total.incomplete = true;
                return total;
            }
            let began = Instant::now();
            match self
                .store
                .erase_namespace_batch(NamespaceBatch {
                    namespace,
                    size: batch,
                    from: &cursor,
                })
                .await
            {
                Ok(erased) => {
                    failures = 0;
                    total.keys += erased.keys;
                    total.events += erased.events;
                    if erased.keys > 0
                        && let Some(replays) = &self.replays
                    {
                        replays.forget_namespace(namespace.as_str());
                    }
                    progress.send_replace(total);
                    cursor.advance(&erased);
                    if !erased.pass_over {
                        let rest = (began.elapsed() * REST_PER_BATCH_TIME).min(LONGEST_REST);
                        // A shutdown ends the rest at once (it is heeded at the loop's top).
                        tokio::select! {
                            () = tokio::time::sleep(rest) => {}
                            () = self.shutdown.cancelled() => {}
                        }
                        continue;
                    }
                    cursor = EraseCursor::default();
                    match self.store.namespace_has_rows(namespace).await {
                        Ok(false) => return total,
                        Ok(true) if held_attempts < HELD_ROWS_ATTEMPTS => {
                            held_attempts += 1;
                            tokio::time::sleep(HELD_ROWS_RETRY).await;
                        }
                        Ok(true) | Err(_) => {
                            total.incomplete = true;
                            return total;
                        }
                    }
                }
                Err(error) if error.is_transient() && failures < TRANSIENT_FAILURES_ALLOWED => {
                    failures += 1;
                    tracing::warn!(namespace = namespace.as_str(), audit_id,
                        error = %error_chain(&error), "an erasure's batch failed; retrying");
                    tokio::time::sleep(Duration::from_millis(200) * failures).await;
                }
                Err(error) => {
                    tracing::error!(namespace = namespace.as_str(), audit_id,
                        error = %error_chain(&error), "an erasure failed");
                    total.incomplete = true;
                    return total;
                }
            }
        }
    }

    pub async fn list_audit(
        &self,
        filter: &AuditFilter,
        before: Option<i64>,
        page: PageSize,
    ) -> Result<(Vec<AuditEvent>, Option<i64>), StoreError> {
        let events = self
            .store
            .list_audit(one_past(filter, before, page))
            .await?;
        Ok(cut_to(events, page, |last| last.id))
    }
}

/// A listing's request for a page of `size`: one entry past it is read, so that whether another
/// page follows is known without a second statement ([`cut_to`]).
fn one_past<'a, Filter, Cursor>(
    filter: &'a Filter,
    after: Option<Cursor>,
    size: PageSize,
) -> Page<'a, Filter, Cursor> {
    Page {
        filter,
        after,
        limit: size.get() + 1,
    }
}

/// The page of `size` out of `entries` read [`one_past`] it, and the cursor of the next page,
/// which `cursor_of` makes of the page's last entry, when another page follows.
fn cut_to<Entry, Cursor>(
    mut entries: Vec<Entry>,
    size: PageSize,
    cursor_of: impl FnOnce(&Entry) -> Cursor,
) -> (Vec<Entry>, Option<Cursor>) {
    let more = entries.len() > size.get() as usize;
    entries.truncate(size.get() as usize);
    let next = entries.last().filter(|_| more).map(cursor_of);
    (entries, next)
}

impl Admin {
    /// Waits until no replica can replay what the erasure recorded as `audit_id` erased, whose
    /// commits had all been answered at `committed` (`service/erasures.rs`).
    async fn until_every_replica_honoured(
        &self,
        committed: Instant,
        namespace: &Scope,
        audit_id: i64,
    ) {
        match every_replica_honoured(&self.store, committed, namespace.as_str()).await {
            Honoured::Acknowledged => {}
            Honoured::OutlastedBy(silent) => tracing::warn!(audit_id, replicas = ?silent,
                "replicas did not acknowledge an erasure in time; they serve no replay from \
                 memory until they have caught up"),
            Honoured::Unasked => tracing::warn!(
                audit_id,
                "the replicas could not be asked to acknowledge an erasure; it answered once \
                 none could serve a replay from memory without having caught up"
            ),
        }
    }
}
