//! When a connection cannot be opened: the credentials are read again (a rotated password), a
//! host is switched between plain and TLS sessions as `sslmode=allow` and `prefer` say, and
//! what is left is described for the operator ([`ConnectFailure`]: the host and the cause).

use std::sync::Arc;

use sqlx::{ConnectOptions, Connection, PgConnection};

use super::PgStore;
use super::primary::{Follower, Shape};
use super::refusal::ConnectFailure;
use crate::store::StoreError;

impl PgStore {
    /// Reads the credential files of both URLs again, and looks at their TLS files, and points
    /// the pools at what they give now: `true` when a login changed. A credential file that
    /// cannot be read is logged once and its last login kept; a TLS file replaced in place (a
    /// CA bundle, a renewed client certificate) is read by the connections opened next.
    pub(super) fn refresh_credentials(&self) -> bool {
        let mut changed = false;
        for calls in [true, false] {
            let (follower, pools) = self.followed(calls);
            let mut repoint = follower.tls_files_changed();
            if follower.credentials().rotates() {
                match follower.credentials().refresh() {
                    Ok(true) => {
                        tracing::info!(
                            host = %follower.host(),
                            "the database credentials changed; new connections use them"
                        );
                        repoint = true;
                        changed = true;
                    }
                    Ok(false) | Err(None) => {}
                    Err(Some(problem)) => {
                        tracing::warn!(%problem, "cannot read the database credentials; keeping the last ones");
                    }
                }
            }
            if repoint {
                follower.repoint(&pools);
            }
        }
        changed
    }

    /// After a connection of the calls' pools (`calls`) or of the listener failed to open with
    /// `error`: whether trying again may succeed now, because the credentials were refused and
    /// others are accepted (read again, or the login before the last change), or because the
    /// host accepts the other kind of session that `sslmode=allow` or `prefer` permits (tried
    /// once here, directly; the host keeps that kind from then on, as the pools are told).
    ///
    /// One refusal is handled at a time: the connections refused at the same moment wait for
    /// it, and try again at once if it pointed the pools anew, without logging in themselves.
    pub(super) async fn after_refusal(&self, error: &sqlx::Error, calls: bool) -> bool {
        let credentials = super::refusal::credentials_refused(error);
        let (follower, pools) = self.followed(calls);
        let index = follower.index();
        if !credentials && !follower.may_fall_back(index, error) {
            return false;
        }
        let seen = follower.generation();
        let _one = self.refusals.lock().await;
        if follower.generation() != seen {
            return true;
        }
        let Some(first) = pools.first() else {
            return false;
        };
        if credentials {
            // The file may hold a newer login than the one refused; and a rotation changes the
            // file and the database a moment apart, so the login before the last change may be
            // the one the database accepts still. Each is tried once, directly.
            if self.refresh_credentials() {
                return true;
            }
            let index = follower.index();
            let (latest, previous) = follower.credentials().candidates(index);
            // Nothing changed, and no login before it: the refused one is all there is.
            let Some(previous) = previous else {
                return false;
            };
            for (login, is_previous) in [(latest, false), (previous, true)] {
                let options = follower.options_as(index, first.shape, &login);
                if self.opens(options).await {
                    follower.credentials().use_previous(is_previous);
                    follower.repoint(&pools);
                    return true;
                }
            }
            return false;
        }
        if !self
            .opens(follower.fallback_options(index, first.shape))
            .await
        {
            return false;
        }
        follower.fall_back(index);
        tracing::info!(host = %follower.host(), "the host refused the first kind of session \
            sslmode allows and accepted the other; its connections use that from now on");
        follower.repoint(&pools);
        true
    }

    /// Whether a connection with `options` opens within a connection's wait (it is closed).
    async fn opens(&self, options: sqlx::postgres::PgConnectOptions) -> bool {
        let tried = tokio::time::timeout(
            self.budget.connection_wait,
            options.disable_statement_logging().connect(),
        )
        .await;
        match tried {
            Ok(Ok(connection)) => {
                let _ = connection.close().await;
                true
            }
            _ => false,
        }
    }

    /// `error`, met while opening a connection of the calls' pools, as the store's failure:
    /// the host and the cause in an operator's words. A pool that only timed out is asked why
    /// by one connection made by hand.
    pub(super) async fn unreachable(&self, error: sqlx::Error) -> StoreError {
        let error = match error {
            sqlx::Error::PoolTimedOut => self.why_no_connection().await,
            other => other,
        };
        match error {
            sqlx::Error::PoolTimedOut => StoreError::Unavailable(sqlx::Error::PoolTimedOut),
            error => StoreError::Unreachable(describe_current(&self.follower, &error)),
        }
    }

    /// Why the probe's pool could not open a connection. The pool retries failures it takes
    /// for passing (a refused connection, a database starting up) until its wait runs out and
    /// then says only "pool timed out"; one connection made by hand reports the cause (a
    /// refused connection, a wrong host), which is what an operator needs to read.
    pub(super) async fn why_no_connection(&self) -> sqlx::Error {
        let attempt = tokio::time::timeout(
            self.budget.connection_wait,
            PgConnection::connect_with(&self.follower.current_options(&self.shapes.probe)),
        )
        .await;
        match attempt {
            Ok(Err(cause)) => cause,
            Ok(Ok(connection)) => {
                let _ = connection.close().await;
                sqlx::Error::PoolTimedOut
            }
            Err(_) => sqlx::Error::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("nothing within {:?}", self.budget.connection_wait),
            )),
        }
    }

    /// One connection to the host the calls go to now, made directly (not through a pool)
    /// within a connection's wait, and checked writable when the URL asks: for migrations,
    /// which must not wait for a pool's retries to learn that the database cannot be reached.
    pub(super) async fn connect_directly(
        &self,
        shape: &Shape,
    ) -> Result<PgConnection, sqlx::Error> {
        let mut retried = false;
        loop {
            let options = self.follower.current_options(shape);
            let attempt =
                tokio::time::timeout(self.budget.connection_wait, options.connect()).await;
            let error = match attempt {
                Ok(Ok(mut connection)) => {
                    if self.follower.attrs().checked()
                        && let Err(error) = self.follower.check(&mut connection).await
                    {
                        let _ = connection.close().await;
                        self.suspect_host();
                        return Err(error);
                    }
                    return Ok(connection);
                }
                Ok(Err(error)) => error,
                Err(_) => sqlx::Error::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("nothing within {:?}", self.budget.connection_wait),
                )),
            };
            if !retried && self.after_refusal(&error, true).await {
                retried = true;
                continue;
            }
            if super::primary::host_suspect(&error) {
                self.suspect_host();
            }
            return Err(error);
        }
    }
}

/// `error` met on `follower`'s current host, described.
fn describe_current(follower: &Arc<Follower>, error: &sqlx::Error) -> ConnectFailure {
    follower.describe(follower.index(), error)
}
