//! The health probe: whether the store can write now, and how durable its commits are.
//!
//! A read cannot tell whether writes go through: a primary whose synchronous standby is gone
//! answers reads while every commit waits. So the probe commits a write of its own
//! ([`WRITE_PROBE`]: a logical message in the WAL, no table) and gives it a bound of its own,
//! kept on this side: a commit waiting for a synchronous standby is not ended by
//! `statement_timeout`. It then reads how commits are made
//! durable ([`DURABILITY`]), which it reports as metrics, and logs whenever it changes.

use std::time::Duration;

use super::PgStore;
use super::error::classify;
use super::primary::host_suspect;
use super::privileges;
use super::sql::{DURABILITY, WRITE_PROBE};
use crate::store::{StoreError, schema};

/// How this store's commits are made durable, as the probe last read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Durability {
    /// `synchronous_commit` of the store's sessions.
    pub synchronous_commit: String,
    /// `synchronous_standby_names`: empty when no standby is waited for.
    pub standby_names: String,
    /// Standbys attached as `sync` or `quorum`.
    pub synchronous_standbys: i64,
    /// Standbys whose state this role may not read (it lacks `pg_monitor`).
    pub unknown_standbys: i64,
    /// Every standby streaming from the store, synchronous or not.
    pub standbys: i64,
}

impl Durability {
    /// Whether a commit waits for a synchronous standby before it is acknowledged.
    pub fn commits_wait_for_standby(&self) -> bool {
        !self.standby_names.trim().is_empty()
            && matches!(
                self.synchronous_commit.as_str(),
                "on" | "remote_write" | "remote_apply"
            )
    }

    /// Why no synchronous standby holds each commit, if none does.
    fn without_synchronous_standby(&self) -> Option<String> {
        if !self.commits_wait_for_standby() {
            return Some(format!(
                "commits do not wait for a synchronous standby (synchronous_commit = {}, \
                 synchronous_standby_names = '{}')",
                self.synchronous_commit, self.standby_names
            ));
        }
        if self.synchronous_standbys == 0 && self.unknown_standbys == 0 {
            return Some("no synchronous standby is attached".to_owned());
        }
        None
    }

    /// Logs how commits are made durable, naming the cluster when the store has several.
    fn log(&self, cluster: Option<&str>) {
        if !self.commits_wait_for_standby() && self.standbys == 0 {
            // A lone server: there is no standby a failover could promote (a development
            // database, a test), and nothing to warn of.
            tracing::info!(
                cluster,
                synchronous_commit = %self.synchronous_commit,
                synchronous_standby_names = %self.standby_names,
                "commits do not wait for a standby, and none streams from the store"
            );
        } else if !self.commits_wait_for_standby() {
            tracing::warn!(
                cluster,
                standbys = self.standbys,
                synchronous_commit = %self.synchronous_commit,
                synchronous_standby_names = %self.standby_names,
                "commits do not wait for a synchronous standby: a failover to a standby can \
                 lose acknowledged keys (see docs/operations.md, Highly available PostgreSQL)"
            );
        } else if self.synchronous_standbys == 0 && self.unknown_standbys > 0 {
            tracing::info!(
                cluster,
                synchronous_commit = %self.synchronous_commit,
                synchronous_standby_names = %self.standby_names,
                standbys = self.unknown_standbys,
                "commits wait for a synchronous standby; whether one is attached cannot be read \
                 (grant the role pg_monitor)"
            );
        } else if self.synchronous_standbys == 0 {
            tracing::warn!(
                cluster,
                synchronous_commit = %self.synchronous_commit,
                synchronous_standby_names = %self.standby_names,
                "commits wait for a synchronous standby, and none is attached: writes wait \
                 until one is"
            );
        } else {
            tracing::info!(
                cluster,
                synchronous_commit = %self.synchronous_commit,
                synchronous_standby_names = %self.standby_names,
                synchronous_standbys = self.synchronous_standbys,
                "commits wait for a synchronous standby"
            );
        }
    }

    /// Sets the durability gauges, labelled with the cluster's name when the store has several.
    fn record_metrics(&self, cluster: Option<&str>) {
        let labelled = |state: Option<&'static str>| -> Vec<metrics::Label> {
            state
                .map(|state| metrics::Label::new("state", state))
                .into_iter()
                .chain(cluster.map(|name| metrics::Label::new("cluster", name.to_owned())))
                .collect()
        };
        metrics::gauge!("idempotency_store_commits_wait_for_standby", labelled(None)).set(
            if self.commits_wait_for_standby() {
                1.0
            } else {
                0.0
            },
        );
        metrics::gauge!(
            "idempotency_store_synchronous_standbys",
            labelled(Some("attached"))
        )
        .set(self.synchronous_standbys as f64);
        metrics::gauge!(
            "idempotency_store_synchronous_standbys",
            labelled(Some("unknown"))
        )
        .set(self.unknown_standbys as f64);
    }
}

impl PgStore {
    /// What the probe last read of how commits are made durable.
    pub fn durability(&self) -> Option<Durability> {
        self.durability
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// The bound of the probe's write: half the operation's time (a statement's share).
    fn write_probe_bound(&self) -> Duration {
        self.budget.statement
    }

    /// The store is reachable, migrated, and commits a write within the probe's bound; with
    /// `--require-synchronous-standby`, a synchronous standby is attached as well.
    pub(super) async fn probe_store(&self) -> Result<(), StoreError> {
        // A rotated password is taken up here, at every check, for the connections opened next.
        self.refresh_credentials();
        if let Some(problem) = self.follower.files_problem() {
            return Err(StoreError::Unreachable(problem));
        }
        self.locate().await.map_err(StoreError::Unreachable)?;
        let mut connection = match self.probe_connection().await {
            Ok(connection) => connection,
            Err(error) => return Err(self.unreachable(error).await),
        };
        let version = self
            .fetch_optional_with(&mut connection, sqlx::query_as(schema::SCHEMA_VERSION))
            .await;
        let version: Option<(i64,)> = self.probed(version)?;
        let (version,) = version.ok_or(StoreError::Inconsistent("no schema version row"))?;
        schema::require_version(&super::MIGRATOR, version)?;
        if !self
            .rights_checked
            .load(std::sync::atomic::Ordering::SeqCst)
        {
            let missing = privileges::missing(&mut connection).await;
            let missing = self.probed(missing)?;
            if !missing.is_empty() {
                connection.settle();
                let user = self
                    .follower
                    .credentials()
                    .login(self.follower.index())
                    .user;
                return Err(privileges::unfit(&user, &missing));
            }
            self.rights_checked
                .store(true, std::sync::atomic::Ordering::SeqCst);
        }
        let bound = self.write_probe_bound();
        let written = tokio::time::timeout(
            bound,
            self.fetch_optional_with::<(String, String)>(
                &mut connection,
                sqlx::query_as(WRITE_PROBE),
            ),
        )
        .await;
        let written = match written {
            Err(_) => {
                // The connection is closed as it is dropped (its commit has not settled).
                self.suspect_host();
                return Err(StoreError::WritesStalled(bound));
            }
            Ok(written) => self.probed(written)?,
        };
        if let Some((_, read_only)) = written
            && read_only == "on"
        {
            self.suspect_host();
            return Err(StoreError::Unready(
                "the store's sessions are read-only (default_transaction_read_only)".to_owned(),
            ));
        }
        let read = self
            .fetch_optional_with::<(String, String, i64, i64, i64)>(
                &mut connection,
                sqlx::query_as(DURABILITY),
            )
            .await;
        let read = self.probed(read)?;
        connection.settle();
        let Some((
            synchronous_commit,
            standby_names,
            synchronous_standbys,
            unknown_standbys,
            standbys,
        )) = read
        else {
            return Err(StoreError::Inconsistent("no durability row"));
        };
        let durability = Durability {
            synchronous_commit,
            standby_names,
            synchronous_standbys,
            unknown_standbys,
            standbys,
        };
        durability.record_metrics(self.cluster.as_deref());
        let changed = {
            let mut last = self
                .durability
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let changed = last.as_ref() != Some(&durability);
            *last = Some(durability.clone());
            changed
        };
        if changed {
            durability.log(self.cluster.as_deref());
        }
        if self.require_synchronous_standby
            && let Some(why) = durability.without_synchronous_standby()
        {
            return Err(StoreError::Unready(format!(
                "{why}, and --require-synchronous-standby is set"
            )));
        }
        Ok(())
    }

    /// A probe statement's answer; a failure a failover would explain sets the store looking
    /// for the writable host.
    fn probed<T>(&self, answer: Result<T, sqlx::Error>) -> Result<T, StoreError> {
        answer.map_err(|error| {
            if host_suspect(&error) {
                self.suspect_host();
            }
            classify(error)
        })
    }
}
