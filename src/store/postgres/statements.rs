//! Statements within the budget: how one runs on a connection (directly, or in a transaction
//! of its own behind a pooler), on a kept connection of the calls' pool or on the probe's, with
//! what is left of an operation's time, alone after a shared statement met a held key, and a
//! guarded write that explains its refusal.

use std::time::Duration;

use sqlx::postgres::{PgArguments, PgRow};
use sqlx::query::QueryAs;
use sqlx::{Connection, FromRow, PgConnection, Postgres};

use super::PgStore;
use super::connect::begin_statement;
use super::error::classify;
use super::rows::GuardRow;
use super::sql::GUARD_STATE;
use crate::domain::batch::Round;
use crate::domain::{GuardedKey, LeaseToken, Rejection, classify_refusal};
use crate::store::StoreError;

/// A query of the store, answered by rows of type `O`.
pub(super) type Statement<'q, O> = QueryAs<'q, Postgres, O, PgArguments>;

/// The least time worth giving a statement: below it, a call is answered "timed out" at once.
const MIN_STATEMENT_TIME: Duration = Duration::from_millis(10);

/// SQLSTATE lock_not_available: the statement met a key that another transaction held (its row
/// locked, or its insert not yet committed) for longer than the session's `lock_timeout`.
fn is_lock_timeout(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(db) if db.code().as_deref() == Some("55P03"))
}

impl PgStore {
    /// Runs `query` on `connection` and answers its rows: directly, or behind a pooler in
    /// transaction mode in a transaction of its own that first sets the statement's timeout.
    pub(super) async fn fetch_all_with<O>(
        &self,
        connection: &mut PgConnection,
        query: Statement<'_, O>,
    ) -> Result<Vec<O>, sqlx::Error>
    where
        O: Send + Unpin + for<'r> FromRow<'r, PgRow>,
    {
        match &self.begin {
            None => query.fetch_all(connection).await,
            Some(begin) => {
                let mut transaction = connection.begin_with(begin.clone()).await?;
                // Unnamed: a named statement would stay on the server connection, which the
                // pooler hands to other clients, and collide with theirs.
                let rows = query.persistent(false).fetch_all(&mut *transaction).await?;
                transaction.commit().await?;
                Ok(rows)
            }
        }
    }

    /// The row `query` answers on `connection`, if any (it answers at most one), as
    /// [`Self::fetch_all_with`] runs it: directly, exactly the driver's own `fetch_optional`.
    pub(super) async fn fetch_optional_with<O>(
        &self,
        connection: &mut PgConnection,
        query: Statement<'_, O>,
    ) -> Result<Option<O>, sqlx::Error>
    where
        O: Send + Unpin + for<'r> FromRow<'r, PgRow>,
    {
        match &self.begin {
            None => query.fetch_optional(connection).await,
            Some(_) => Ok(self
                .fetch_all_with(connection, query)
                .await?
                .into_iter()
                .next()),
        }
    }

    /// [`Self::fetch_optional_with`] for one of several statements that an operation, begun at
    /// `began`, runs on one connection, all of them within the store's share of the budget (a
    /// connection's wait and one statement's time). While no more than a connection's wait has
    /// been spent, the statement has its whole time (the session's timeout, as if it had waited
    /// for its connection only); after that, only what is left, set for a transaction of its
    /// own. With less than [`MIN_STATEMENT_TIME`] left it is not run, and the operation is
    /// answered "timed out": nothing was written by this statement.
    pub(super) async fn fetch_optional_within<O>(
        &self,
        connection: &mut PgConnection,
        began: std::time::Instant,
        query: Statement<'_, O>,
    ) -> Result<Option<O>, StoreError>
    where
        O: Send + Unpin + for<'r> FromRow<'r, PgRow>,
    {
        let spent = began.elapsed();
        if spent <= self.budget.connection_wait {
            return self
                .fetch_optional_with(connection, query)
                .await
                .map_err(classify);
        }
        let share = self.budget.connection_wait + self.budget.statement;
        let left = share.saturating_sub(spent);
        if left < MIN_STATEMENT_TIME {
            return Err(StoreError::TimedOut(share));
        }
        let begin = begin_statement(&self.budget, left.as_millis(), self.begin.is_some());
        let mut transaction = connection.begin_with(begin).await.map_err(classify)?;
        let row = query
            .persistent(self.begin.is_none())
            .fetch_optional(&mut *transaction)
            .await
            .map_err(classify)?;
        transaction.commit().await.map_err(classify)?;
        Ok(row)
    }

    /// [`Self::fetch_all_with`] on a connection of the calls' pool, kept for the next
    /// statement once this one has answered.
    pub(super) async fn fetch_all<O>(&self, query: Statement<'_, O>) -> Result<Vec<O>, sqlx::Error>
    where
        O: Send + Unpin + for<'r> FromRow<'r, PgRow>,
    {
        let mut connection = self.connections.lend().await?;
        let rows = self.fetch_all_with(&mut connection, query).await?;
        connection.keep();
        Ok(rows)
    }

    /// [`Self::fetch_optional_with`] on a connection of the calls' pool, kept for the next
    /// statement once this one has answered.
    pub(super) async fn fetch_optional<O>(
        &self,
        query: Statement<'_, O>,
    ) -> Result<Option<O>, sqlx::Error>
    where
        O: Send + Unpin + for<'r> FromRow<'r, PgRow>,
    {
        let mut connection = self.connections.lend().await?;
        let row = self.fetch_optional_with(&mut connection, query).await?;
        connection.keep();
        Ok(row)
    }

    /// The one row `query` answers.
    pub(super) async fn fetch_one<O>(&self, query: Statement<'_, O>) -> Result<O, sqlx::Error>
    where
        O: Send + Unpin + for<'r> FromRow<'r, PgRow>,
    {
        self.fetch_optional(query)
            .await?
            .ok_or(sqlx::Error::RowNotFound)
    }

    /// The one row `query` answers, on the health probe's own connection.
    pub(super) async fn fetch_one_probing<O>(
        &self,
        query: Statement<'_, O>,
    ) -> Result<O, sqlx::Error>
    where
        O: Send + Unpin + for<'r> FromRow<'r, PgRow>,
    {
        let mut connection = self.probe_pool.acquire().await?;
        self.fetch_optional_with(&mut connection, query)
            .await?
            .ok_or(sqlx::Error::RowNotFound)
    }
}

/// How often a guarded write is tried when the read that explains its refusal finds the caller
/// to be the current holder of an in-progress key after all (the key changed in between).
const GUARD_ATTEMPTS: usize = 3;

impl PgStore {
    /// Runs `write` (a statement guarded on the caller's token that answers a row only when it
    /// applied: Release, ExtendLease) and answers that row, or, when it changed nothing, reads
    /// the key to say why. Tokens are never reused
    /// and completed keys never reopen, so what the read finds explains the refusal; should it
    /// find the caller holding an in-progress key after all (which only a token guessed before
    /// it was handed out can cause), the write is tried again.
    pub(super) async fn guarded_write<'q, T, F>(
        &self,
        namespace: &str,
        key: &str,
        token: LeaseToken,
        mut write: F,
    ) -> Result<Result<T, Rejection>, StoreError>
    where
        F: FnMut() -> Statement<'q, T>,
        T: Send + Unpin + for<'r> FromRow<'r, PgRow>,
    {
        for _ in 0..GUARD_ATTEMPTS {
            if let Some(applied) = self.fetch_optional(write()).await.map_err(classify)? {
                return Ok(Ok(applied));
            }
            let found: Option<GuardRow> = self
                .fetch_optional(sqlx::query_as(GUARD_STATE).bind(namespace).bind(key))
                .await
                .map_err(classify)?;
            match classify_refusal(found.map(GuardedKey::from), token) {
                Err(rejection) => return Ok(Err(rejection)),
                // Without an offered response, a completed key is always ALREADY_COMPLETED.
                Ok(Some(_)) => return Ok(Err(Rejection::AlreadyCompleted)),
                Ok(None) => continue,
            }
        }
        Err(StoreError::Inconsistent(
            "a guarded write kept refusing the current holder of an in-progress key",
        ))
    }
}

impl PgStore {
    /// One statement alone on a connection of the calls' pool, within what is left of the
    /// store's share of an operation begun at `began` ([`Self::fetch_optional_within`]).
    pub(super) async fn alone_within<O>(
        &self,
        began: std::time::Instant,
        query: Statement<'_, O>,
    ) -> Result<O, StoreError>
    where
        O: Send + Unpin + for<'r> FromRow<'r, PgRow>,
    {
        let mut connection = self.connections.lend().await.map_err(classify)?;
        let row = self
            .fetch_optional_within(&mut connection, began, query)
            .await?;
        connection.keep();
        row.ok_or_else(|| classify(sqlx::Error::RowNotFound))
    }

    /// The rows a round's shared statement (begun at `began`) `fetched`, with the round; or,
    /// when it failed, every call's answer: after it met a key held longer than the lock budget,
    /// each call run again alone by `alone` ([`Self::each_alone`]), else the error for all.
    pub(super) async fn shared_or_each_alone<C, R, T, F, Fut>(
        &self,
        fetched: Result<Vec<R>, sqlx::Error>,
        round: Round<C>,
        began: std::time::Instant,
        alone: F,
    ) -> Result<(Round<C>, Vec<R>), Vec<Result<T, StoreError>>>
    where
        C: Send + 'static,
        T: Send + 'static,
        F: Fn(Self, C, std::time::Instant) -> Fut,
        Fut: std::future::Future<Output = Result<T, StoreError>> + Send + 'static,
    {
        match fetched {
            Ok(rows) => Ok((round, rows)),
            Err(error) if is_lock_timeout(&error) => {
                Err(self.each_alone(round.into_commands(), began, alone).await)
            }
            Err(error) => Err(super::failed(classify(error), round.len())),
        }
    }

    /// After a shared statement begun at `began` met a key held longer than the lock budget
    /// (`lock_timeout`; the statement wrote nothing): every call of it runs again alone, all at
    /// once, so a held key fails only its own callers (at their own lock timeout), and the
    /// others are answered without waiting for it. The answers come back in call order.
    pub(super) async fn each_alone<C, T, F, Fut>(
        &self,
        commands: Vec<C>,
        began: std::time::Instant,
        run: F,
    ) -> Vec<Result<T, StoreError>>
    where
        C: Send + 'static,
        T: Send + 'static,
        F: Fn(Self, C, std::time::Instant) -> Fut,
        Fut: std::future::Future<Output = Result<T, StoreError>> + Send + 'static,
    {
        let count = commands.len();
        let mut runs = tokio::task::JoinSet::new();
        for (position, command) in commands.into_iter().enumerate() {
            let run = run(self.clone(), command, began);
            runs.spawn(async move { (position, run.await) });
        }
        let mut answers: Vec<Option<Result<T, StoreError>>> = (0..count).map(|_| None).collect();
        while let Some(joined) = runs.join_next().await {
            if let Ok((position, answer)) = joined
                && let Some(slot) = answers.get_mut(position)
            {
                *slot = Some(answer);
            }
        }
        answers
            .into_iter()
            .map(|answer| {
                answer.unwrap_or(Err(StoreError::Inconsistent(
                    "a call run again alone did not finish",
                )))
            })
            .collect()
    }
}
