//! Several PostgreSQL clusters behind one [`Store`] (`--cluster NAME=URL`, `--place`): each call
//! goes to the cluster its namespace (or consumer) is placed on (`placement.rs`), a coalesced
//! round is split per cluster and its parts run at once, and each cluster keeps what a single
//! store has of its own: its pools, its listener and heartbeat, its probe (`readiness.rs`), its
//! reaper (one per cluster, `AnyStore::parts`). Key events and erasures of every cluster are
//! merged into one stream each (`follow.rs`). A cluster's trouble stays its own: nothing here
//! waits for one cluster on behalf of a call placed on another.

mod admin;
mod follow;
pub mod moves;
pub mod placement;
mod readiness;
mod replicas;
mod routes;
pub mod standing;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::future::join_all;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

use self::placement::{ClusterName, Placement};
use self::routes::{Routes, on_home};
use super::postgres::{PgSettings, PgStore};
use super::{Erasure, ExpiredBacklog, KeyEvent, LockWait, Row, Store, StoreError};
use crate::domain::batch::{Batchable, Round};
use crate::domain::{
    CompleteCommand, Completion, ExtendLeaseCommand, Instant, KeyState, LookupQuery,
    MarkProcessedCommand, ProcessedEvent, Rejection, ReleaseCommand, TryStartCommand,
    TryStartOutcome,
};

/// One cluster: its name, its store, what its probe last found.
#[derive(Debug, Clone)]
pub struct Cluster {
    pub name: ClusterName,
    pub store: PgStore,
    state: Arc<ClusterState>,
}

#[derive(Debug, Default)]
struct ClusterState {
    /// Its schema was found migrated (by a migration or a probe): calls may go to it.
    schema_seen: AtomicBool,
    /// Its last probe succeeded.
    ready: AtomicBool,
    /// Why it is not ready, as last logged: a cause is logged when it changes, not at every
    /// probe.
    reported: std::sync::Mutex<Option<String>>,
}

#[derive(Clone)]
pub struct ClusteredStore {
    clusters: Arc<[Cluster]>,
    placement: Arc<Placement>,
    /// The scopes a move took off the cluster their rule names (`routes.rs`).
    routes: Arc<Routes>,
    events: broadcast::Sender<KeyEvent>,
    erasures: broadcast::Sender<Erasure>,
    /// `migrate` was asked for: a cluster unreachable then is migrated when its probe first
    /// reaches it.
    migrates: Arc<AtomicBool>,
    /// How long one cluster's probe may take, so that a stalled cluster does not hold the
    /// others' answer past the readiness check's bound.
    probe_bound: Duration,
    /// How long a call waits for a move's cut-over to end before it is answered UNAVAILABLE:
    /// half the operation's timeout, like a held key's first wait.
    cut_over_wait: Duration,
}

impl std::fmt::Debug for ClusteredStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.clusters.iter().map(|c| c.name.as_str()).collect();
        f.debug_struct("ClusteredStore")
            .field("clusters", &names)
            .finish_non_exhaustive()
    }
}

/// A cluster whose URL the driver refused.
#[derive(Debug, thiserror::Error)]
#[error("the URL of the cluster {name} is not valid")]
pub struct ClusterUrlError {
    pub name: ClusterName,
    #[source]
    pub source: sqlx::Error,
}

impl ClusteredStore {
    /// Builds each cluster's pools without connecting, like [`PgStore::connect_lazy`]; `shared`
    /// gives every setting but the URL.
    pub fn connect_lazy(
        urls: &[(ClusterName, String)],
        placement: Placement,
        shared: &PgSettings,
    ) -> Result<Self, ClusterUrlError> {
        let clusters = urls
            .iter()
            .map(|(name, url)| {
                let settings = PgSettings {
                    url: url.clone(),
                    ..shared.clone()
                };
                PgStore::connect_lazy(&settings)
                    .map(|store| Cluster {
                        name: name.clone(),
                        store: store.in_cluster(name.as_str()),
                        state: Arc::default(),
                    })
                    .map_err(|source| ClusterUrlError {
                        name: name.clone(),
                        source,
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            clusters: clusters.into(),
            placement: Arc::new(placement),
            routes: Arc::default(),
            events: broadcast::channel(1024).0,
            erasures: broadcast::channel(1024).0,
            migrates: Arc::default(),
            probe_bound: shared.operation_timeout / 2,
            cut_over_wait: shared.operation_timeout / 2,
        })
    }

    pub fn clusters(&self) -> &[Cluster] {
        &self.clusters
    }

    fn usable(&self, at: usize) -> Result<&PgStore, StoreError> {
        let cluster = &self.clusters[at];
        if cluster.state.schema_seen.load(Ordering::Acquire) {
            Ok(&cluster.store)
        } else {
            Err(StoreError::NotMigrated(format!(
                "the cluster {} has not been reached and found migrated since the service \
                 started",
                cluster.name
            )))
        }
    }

    /// The clusters that `scopes` are placed on, each with the positions of its scopes, in
    /// the order each cluster first appears.
    fn groups<'a>(&self, scopes: impl Iterator<Item = &'a str>) -> Vec<(usize, Vec<usize>)> {
        let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
        for (position, scope) in scopes.enumerate() {
            let cluster = self.cluster_of(scope);
            match groups.iter_mut().find(|(at, _)| *at == cluster) {
                Some((_, positions)) => positions.push(position),
                None => groups.push((cluster, vec![position])),
            }
        }
        groups
    }

    /// The one cluster every command of `round` is placed on, if there is one (always so for
    /// the coordinator's rounds, which are formed per cluster): the round then runs there as it
    /// is, without being copied.
    fn sole_cluster<C>(
        &self,
        round: &Round<C>,
        scope: impl Fn(&C) -> &str,
    ) -> Option<Result<&PgStore, StoreError>> {
        let mut clusters = round.iter().map(|command| self.cluster_of(scope(command)));
        let first = clusters.next()?;
        clusters
            .all(|cluster| cluster == first)
            .then(|| self.usable(first))
    }

    /// Runs `round` on its clusters, one part per cluster, concurrently, the answers put back
    /// in order.
    async fn split<C, T, F, Fut>(
        &self,
        round: &Round<C>,
        scope: impl Fn(&C) -> &str,
        run: F,
    ) -> Vec<Result<T, StoreError>>
    where
        C: Batchable + Clone,
        F: Fn(PgStore, Round<C>) -> Fut,
        Fut: Future<Output = Vec<Result<T, StoreError>>>,
    {
        let groups = self.groups(round.iter().map(&scope));
        let commands = round.as_slice();
        let parts = groups.iter().map(|(cluster, positions)| {
            let part = Round::new(positions.iter().map(|&p| commands[p].clone()).collect());
            let store = self.usable(*cluster).cloned();
            let run = &run;
            async move {
                match (store, part) {
                    (Ok(store), Ok(part)) => run(store, part).await,
                    (Err(error), _) => failed(error, positions.len()),
                    (_, Err(_)) => failed(
                        StoreError::Inconsistent("a part of a round shared a key"),
                        positions.len(),
                    ),
                }
            }
        });
        let answered = join_all(parts).await;
        let mut answers: Vec<Option<Result<T, StoreError>>> =
            (0..commands.len()).map(|_| None).collect();
        for ((_, positions), part) in groups.iter().zip(answered) {
            for (&position, answer) in positions.iter().zip(part) {
                answers[position] = Some(answer);
            }
        }
        answers
            .into_iter()
            .map(|answer| {
                answer.unwrap_or(Err(StoreError::Inconsistent(
                    "a cluster answered fewer calls than it was given",
                )))
            })
            .collect()
    }

    /// `run` on every cluster whose schema was seen, at once.
    async fn on_each<T, F, Fut>(&self, run: F) -> Vec<Result<T, StoreError>>
    where
        F: Fn(PgStore) -> Fut,
        Fut: Future<Output = Result<T, StoreError>>,
    {
        join_all((0..self.clusters.len()).map(|at| {
            let store = self.usable(at).cloned();
            let run = &run;
            async move { run(store?).await }
        }))
        .await
    }

    /// `migrate`: every cluster (the first failure, naming its cluster, stops it).
    pub async fn migrate_granting(&self, grant_to: Option<&str>) -> Result<(), StoreError> {
        for cluster in self.clusters.iter() {
            cluster
                .store
                .migrate_granting(grant_to)
                .await
                .map_err(|error| in_cluster(&cluster.name, &error))?;
            tracing::info!(cluster = %cluster.name, "cluster migrated");
        }
        Ok(())
    }
}

/// `error` as every answer of `count` calls.
fn failed<T>(error: StoreError, count: usize) -> Vec<Result<T, StoreError>> {
    error.for_each_of(count).into_iter().map(Err).collect()
}

/// `error` of the cluster `name`, named, for an operator.
fn in_cluster(name: &ClusterName, error: &StoreError) -> StoreError {
    StoreError::Unready(format!(
        "cluster {name}: {}",
        crate::telemetry::error_chain(error)
    ))
}

/// What the clusters that answered answered, combined by `add`; a failure only when every
/// cluster failed (a cluster that is down leaves the others' numbers standing).
fn combined<T: Default>(
    answers: Vec<Result<T, StoreError>>,
    add: impl Fn(&mut T, T),
) -> Result<T, StoreError> {
    let mut total: Option<T> = None;
    let mut first_error = None;
    for answer in answers {
        match answer {
            Ok(part) => add(total.get_or_insert_default(), part),
            Err(error) => {
                first_error.get_or_insert(error);
            }
        }
    }
    match (total, first_error) {
        (Some(total), _) => Ok(total),
        (None, Some(error)) => Err(error),
        (None, None) => Ok(T::default()),
    }
}

fn sum_of(answers: Vec<Result<u64, StoreError>>) -> Result<u64, StoreError> {
    combined(answers, |total, part| *total += part)
}

/// `$method` for `$round`: as it is on the one cluster it lies on (`sole_cluster`), else split
/// per cluster (`split`).
/// The commands a gate refused are then run again where it points (`rerouted`).
macro_rules! on_clusters {
    ($self:ident, $round:ident, |$c:ident| $scope:expr, $method:ident) => {{
        let run = |store: PgStore, part: Round<_>| async move { store.$method(&part).await };
        let answers = match $self.sole_cluster($round, |$c| $scope) {
            Some(Ok(store)) => store.$method($round).await,
            Some(Err(error)) => failed(error, $round.len()),
            None => $self.split($round, |$c| $scope, run).await,
        };
        $self.rerouted($round, |$c| $scope, answers, run).await
    }};
}

impl Store for ClusteredStore {
    async fn try_start(&self, command: &TryStartCommand) -> Result<TryStartOutcome, StoreError> {
        on_home!(self, command.namespace.as_str(), try_start(command))
    }

    async fn complete(
        &self,
        command: &CompleteCommand,
    ) -> Result<Result<Completion, Rejection>, StoreError> {
        on_home!(self, command.namespace.as_str(), complete(command))
    }

    async fn try_start_batch(
        &self,
        round: &Round<TryStartCommand>,
    ) -> Vec<Result<TryStartOutcome, StoreError>> {
        on_clusters!(self, round, |c| c.namespace.as_str(), try_start_batch)
    }

    async fn mark_processed_batch(
        &self,
        round: &Round<MarkProcessedCommand>,
    ) -> Vec<Result<Vec<ProcessedEvent>, StoreError>> {
        on_clusters!(self, round, |c| c.consumer.as_str(), mark_processed_batch)
    }

    async fn complete_batch(
        &self,
        round: &Round<CompleteCommand>,
    ) -> Vec<Result<Result<Completion, Rejection>, StoreError>> {
        on_clusters!(self, round, |c| c.namespace.as_str(), complete_batch)
    }

    async fn release(&self, command: &ReleaseCommand) -> Result<Result<(), Rejection>, StoreError> {
        on_home!(self, command.namespace.as_str(), release(command))
    }

    fn limited(&self, deadline: std::time::Instant, lock_wait: LockWait) -> Self {
        let clusters: Vec<Cluster> = self
            .clusters
            .iter()
            .map(|cluster| Cluster {
                store: cluster.store.limited(deadline, lock_wait),
                ..cluster.clone()
            })
            .collect();
        Self {
            clusters: clusters.into(),
            ..self.clone()
        }
    }

    async fn extend_lease(
        &self,
        command: &ExtendLeaseCommand,
    ) -> Result<Result<Instant, Rejection>, StoreError> {
        on_home!(self, command.namespace.as_str(), extend_lease(command))
    }

    async fn lookup(&self, query: &LookupQuery) -> Result<KeyState, StoreError> {
        on_home!(self, query.namespace.as_str(), lookup(query))
    }

    async fn watch(&self, query: &LookupQuery) -> Result<KeyState, StoreError> {
        on_home!(self, query.namespace.as_str(), watch(query))
    }

    async fn mark_processed(
        &self,
        command: &MarkProcessedCommand,
    ) -> Result<Vec<ProcessedEvent>, StoreError> {
        on_home!(self, command.consumer.as_str(), mark_processed(command))
    }

    async fn reap_expired_keys(&self, limit: u32) -> Result<u64, StoreError> {
        sum_of(
            self.on_each(|store| async move { store.reap_expired_keys(limit).await })
                .await,
        )
    }

    async fn reap_expired_events(&self, limit: u32) -> Result<u64, StoreError> {
        sum_of(
            self.on_each(|store| async move { store.reap_expired_events(limit).await })
                .await,
        )
    }

    async fn expired_backlog(&self) -> Result<ExpiredBacklog, StoreError> {
        let answers = self
            .on_each(|store| async move { store.expired_backlog().await })
            .await;
        combined(answers, |oldest, backlog| {
            oldest.keys = oldest.keys.max(backlog.keys);
            oldest.events = oldest.events.max(backlog.events);
        })
    }

    async fn migrate(&self) -> Result<(), StoreError> {
        self.migrate_reachable().await
    }

    async fn probe(&self) -> Result<(), StoreError> {
        self.probe_each().await
    }

    async fn close(&self) {
        join_all(self.clusters.iter().map(|cluster| cluster.store.close())).await;
    }

    /// The first ready cluster's clock, in the order the flags give them (the clusters' clocks
    /// are assumed to agree as closely as NTP keeps them: docs/scaling.md).
    async fn clock(&self) -> Result<Instant, StoreError> {
        let mut first_error = None;
        for cluster in self.clusters.iter() {
            if !cluster.state.ready.load(Ordering::Acquire) {
                continue;
            }
            match cluster.store.clock().await {
                Ok(now) => return Ok(now),
                Err(error) => {
                    first_error.get_or_insert(error);
                }
            }
        }
        Err(first_error
            .unwrap_or_else(|| StoreError::Unready("no cluster is ready to read its clock".into())))
    }

    fn key_events(&self) -> broadcast::Receiver<KeyEvent> {
        self.events.subscribe()
    }

    async fn watch_keys(&self, shutdown: CancellationToken) {
        follow::follow_clusters(self, shutdown).await;
    }

    async fn rows_held(&self, rows: &[Row<'_>]) -> Result<Vec<bool>, StoreError> {
        let scope_of = |row: &Row<'_>| match *row {
            Row::Key { namespace, .. } => namespace.to_owned(),
            Row::Event { consumer, .. } => consumer.to_owned(),
        };
        let scopes: Vec<String> = rows.iter().map(scope_of).collect();
        let groups = self.groups(scopes.iter().map(String::as_str));
        let mut held = vec![false; rows.len()];
        for (cluster, positions) in groups {
            let part: Vec<Row<'_>> = positions.iter().map(|&p| rows[p]).collect();
            let answers = self.usable(cluster)?.rows_held(&part).await?;
            for (position, answer) in positions.into_iter().zip(answers) {
                held[position] = answer;
            }
        }
        Ok(held)
    }
}
