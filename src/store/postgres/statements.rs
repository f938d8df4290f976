//! Statements within the budget: how one runs on a connection (directly, or in a transaction
//! of its own behind a pooler or for a patient store), on a kept connection of the calls' pool
//! or on the probe's, with what is left of an operation's time, and a guarded write that
//! explains its refusal.

use std::time::Duration;

use sqlx::postgres::{PgArguments, PgRow};
use sqlx::query::QueryAs;
use sqlx::{Connection, FromRow, PgConnection, Postgres, SqlStr};

use super::PgStore;
use super::connect::begin_statement;
use super::error::classify;
use super::kept::{Lent, Settling};
use super::primary::host_suspect;
use super::rows::GuardRow;
use super::sql::GUARD_STATE;
use crate::domain::{GuardedKey, LeaseToken, Rejection, classify_refusal};
use crate::store::LockWait;
use crate::store::StoreError;

/// A statement this service did not send because the operation's own deadline left too little
/// time for it (a local decision, not the host's doing): the connection is as healthy as it
/// was, and is kept; the call is answered UNAVAILABLE, nothing written.
#[derive(Debug, thiserror::Error)]
#[error("not sent: too little of the operation's time was left for the statement")]
pub(super) struct NotSent;

pub(super) fn not_sent() -> sqlx::Error {
    sqlx::Error::Configuration(Box::new(NotSent))
}

/// Whether `error` is [`NotSent`].
pub(super) fn is_not_sent(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Configuration(inner) if inner.is::<NotSent>())
}

/// A query of the store, answered by rows of type `O`.
pub(super) type Statement<'q, O> = QueryAs<'q, Postgres, O, PgArguments>;

/// What a statement's rows decode into: a type made from a PostgreSQL row, which the store's
/// futures carry across threads.
pub(super) trait FromPgRow: Send + Unpin + for<'r> FromRow<'r, PgRow> {}

impl<O: Send + Unpin + for<'r> FromRow<'r, PgRow>> FromPgRow for O {}

/// The least time worth giving a statement: below it, a call is answered "timed out" at once.
pub(super) const MIN_STATEMENT_TIME: Duration = Duration::from_millis(10);

impl PgStore {
    /// The statement that opens the transaction `query` runs in, if it needs one: behind a
    /// pooler in transaction mode, the one that sets what a direct connection's startup packet
    /// does; for a limited store, one that ends the statement by the store's deadline and waits
    /// for row locks as the store was told. Refused ([`NotSent`]: the connection stays as it
    /// was) when less than [`MIN_STATEMENT_TIME`] is left before the deadline.
    fn transaction_for_statement(&self) -> Result<Option<SqlStr>, sqlx::Error> {
        let Some((deadline, lock_wait)) = self.limits else {
            return Ok(self.begin.clone());
        };
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left < MIN_STATEMENT_TIME {
            return Err(not_sent());
        }
        let lock = match lock_wait {
            LockWait::Brief => self.budget.brief_lock,
            LockWait::Patient => self.budget.lock,
        };
        Ok(Some(begin_statement(
            left.min(self.budget.statement).as_millis(),
            lock,
            self.begin.is_some(),
        )))
    }

    /// Runs `query` on `connection` and answers its rows: directly, or in a transaction of its
    /// own that first sets its limits ([`Self::transaction_for_statement`]).
    pub(super) async fn fetch_all_with<O: FromPgRow>(
        &self,
        connection: &mut PgConnection,
        query: Statement<'_, O>,
    ) -> Result<Vec<O>, sqlx::Error> {
        match self.transaction_for_statement()? {
            None => query.fetch_all(connection).await,
            Some(begin) => {
                let mut transaction = connection.begin_with(begin).await?;
                // Behind a pooler, unnamed: a named statement would stay on the server
                // connection, which the pooler hands to other clients, and collide with theirs.
                let rows = query
                    .persistent(self.begin.is_none())
                    .fetch_all(&mut *transaction)
                    .await?;
                transaction.commit().await?;
                Ok(rows)
            }
        }
    }

    /// The row `query` answers on `connection`, if any (it answers at most one), as
    /// [`Self::fetch_all_with`] runs it: without a transaction of its own, exactly the driver's
    /// own `fetch_optional`.
    pub(super) async fn fetch_optional_with<O: FromPgRow>(
        &self,
        connection: &mut PgConnection,
        query: Statement<'_, O>,
    ) -> Result<Option<O>, sqlx::Error> {
        if self.begin.is_none() && self.limits.is_none() {
            return query.fetch_optional(connection).await;
        }
        Ok(self
            .fetch_all_with(connection, query)
            .await?
            .into_iter()
            .next())
    }

    /// [`Self::fetch_optional_with`] for one of several statements that an operation, begun at
    /// `began`, runs on one connection, all of them within the store's share of the budget (a
    /// connection's wait and one statement's time). While no more than a connection's wait has
    /// been spent, the statement has its whole time (the session's timeout, as if it had waited
    /// for its connection only); after that, only what is left, set for a transaction of its
    /// own. With less than [`MIN_STATEMENT_TIME`] left it is not run, and the operation is
    /// answered "timed out": nothing was written by this statement.
    pub(super) async fn fetch_optional_within<O: FromPgRow>(
        &self,
        connection: &mut PgConnection,
        began: std::time::Instant,
        query: Statement<'_, O>,
    ) -> Result<Option<O>, StoreError> {
        let spent = began.elapsed();
        if spent <= self.budget.connection_wait || self.limits.is_some() {
            let row = self.fetch_optional_with(connection, query).await;
            return self.noted(row).map_err(classify);
        }
        let share = self.budget.connection_wait + self.budget.statement;
        let left = share.saturating_sub(spent);
        if left < MIN_STATEMENT_TIME {
            return Err(StoreError::TimedOut(share));
        }
        let begin = begin_statement(
            left.as_millis(),
            self.budget.brief_lock,
            self.begin.is_some(),
        );
        let row = async {
            let mut transaction = connection.begin_with(begin).await?;
            let row = query
                .persistent(self.begin.is_none())
                .fetch_optional(&mut *transaction)
                .await?;
            transaction.commit().await?;
            Ok(row)
        }
        .await;
        self.noted(row).map_err(classify)
    }

    /// `answer`, after setting the store looking for the writable host if its failure says the
    /// current one may no longer be.
    fn noted<T>(&self, answer: Result<T, sqlx::Error>) -> Result<T, sqlx::Error> {
        if answer.as_ref().is_err_and(host_suspect) {
            self.suspect_host();
        }
        answer
    }

    /// [`Self::fetch_all_with`] on a connection of the calls' pool, kept for the next
    /// statement once this one has answered.
    pub(super) async fn fetch_all<O: FromPgRow>(
        &self,
        query: Statement<'_, O>,
    ) -> Result<Vec<O>, sqlx::Error> {
        let mut connection = self.lend().await?;
        let rows = self.fetch_all_with(&mut connection, query).await;
        let rows = self.settled(&mut connection, rows)?;
        connection.keep();
        Ok(rows)
    }

    /// [`Self::fetch_optional_with`] on a connection of the calls' pool, kept for the next
    /// statement once this one has answered.
    pub(super) async fn fetch_optional<O: FromPgRow>(
        &self,
        query: Statement<'_, O>,
    ) -> Result<Option<O>, sqlx::Error> {
        let mut connection = self.lend().await?;
        let row = self.fetch_optional_with(&mut connection, query).await;
        let row = self.settled(&mut connection, row)?;
        connection.keep();
        Ok(row)
    }

    /// A connection of the calls' pool, within the pool's wait, and for a limited store only
    /// while its deadline allows; a failure that a failover would explain sets the store
    /// looking for the writable host.
    pub(super) async fn lend(&self) -> Result<Lent<'_>, sqlx::Error> {
        let mut lent = self.lend_once().await;
        // A refused login may succeed at once with the credentials read again (a rotated
        // password) or the other kind of session sslmode allows.
        if let Err(error) = &lent
            && self.after_refusal(error, true).await
        {
            lent = self.lend_once().await;
        }
        lent.inspect_err(|error| {
            if host_suspect(error) {
                self.suspect_host();
            }
        })
    }

    async fn lend_once(&self) -> Result<Lent<'_>, sqlx::Error> {
        match self.limits {
            None => self.connections.lend().await,
            Some((deadline, _)) => {
                tokio::time::timeout_at(deadline.into(), self.connections.lend())
                    .await
                    .unwrap_or_else(|_| Err(not_sent()))
            }
        }
    }

    /// `answer`, the statement's on `connection`: a connection whose statement the server
    /// answered goes back to the pool when dropped, unless the failure says its host may no
    /// longer be the writable one (lost, read-only, shutting down): then it is closed, and the
    /// store looks for the writable host.
    pub(super) fn settled<T>(
        &self,
        connection: &mut Lent<'_>,
        answer: Result<T, sqlx::Error>,
    ) -> Result<T, sqlx::Error> {
        match &answer {
            Err(error) if host_suspect(error) => self.suspect_host(),
            _ => connection.settle(),
        }
        answer
    }

    /// The one row `query` answers.
    pub(super) async fn fetch_one<O: FromPgRow>(
        &self,
        query: Statement<'_, O>,
    ) -> Result<O, sqlx::Error> {
        self.fetch_optional(query)
            .await?
            .ok_or(sqlx::Error::RowNotFound)
    }

    /// The one row `query` answers, on the health probe's own connection.
    pub(super) async fn fetch_one_probing<O: FromPgRow>(
        &self,
        query: Statement<'_, O>,
    ) -> Result<O, sqlx::Error> {
        let mut connection = self.probe_connection().await?;
        let row = self.fetch_optional_with(&mut connection, query).await;
        if !row.as_ref().is_err_and(host_suspect) {
            connection.settle();
        }
        row?.ok_or(sqlx::Error::RowNotFound)
    }

    /// The health probe's connection, closed rather than given back if its statement does not
    /// settle (the probe's time ran out): the probe's pool has one connection, which a ping
    /// behind a stalled commit would hold.
    pub(super) async fn probe_connection(&self) -> Result<Settling, sqlx::Error> {
        let mut acquired = self.probe_pool.acquire().await;
        if let Err(error) = &acquired
            && self.after_refusal(error, true).await
        {
            acquired = self.probe_pool.acquire().await;
        }
        match acquired {
            Ok(connection) => Ok(Settling::new(connection)),
            Err(error) => {
                if host_suspect(&error) {
                    self.suspect_host();
                }
                Err(error)
            }
        }
    }
}

/// How often a guarded write is tried when the read that explains its refusal finds the caller
/// to be the current holder of an in-progress key after all (the key changed in between).
const GUARD_ATTEMPTS: usize = 3;

impl PgStore {
    /// Runs `write` (a statement guarded on the caller's token that answers a row only when it
    /// applied: Release, ExtendLease; `statement` with the key's namespace, name and token, then
    /// the values `with_values` binds) and answers that row, or, when it changed nothing, reads
    /// the key to say why. Tokens are never reused
    /// and completed keys never reopen, so what the read finds explains the refusal; should it
    /// find the caller holding an in-progress key after all (which only a token guessed before
    /// it was handed out can cause), the write is tried again.
    pub(super) async fn guarded_write<'q, T: FromPgRow, F>(
        &self,
        statement: &'static str,
        namespace: &'q str,
        key: &'q str,
        token: LeaseToken,
        with_values: F,
    ) -> Result<Result<T, Rejection>, StoreError>
    where
        F: Fn(Statement<'q, T>) -> Statement<'q, T>,
    {
        // Each guarded statement takes the key and its token first, then its own values.
        let write = || {
            with_values(
                sqlx::query_as(statement)
                    .bind(namespace)
                    .bind(key)
                    .bind(token.get()),
            )
        };
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

    /// Runs a reaping statement (`REAP_KEYS`, `REAP_EVENTS`, `REAP_AUDIT`: at most `limit`
    /// expired rows deleted) and answers how many it deleted.
    pub(super) async fn reap(
        &self,
        statement: &'static str,
        limit: u32,
    ) -> Result<u64, StoreError> {
        let (deleted,): (i64,) = self
            .fetch_one(sqlx::query_as(statement).bind(i64::from(limit)))
            .await
            .map_err(classify)?;
        Ok(deleted.unsigned_abs())
    }
}
