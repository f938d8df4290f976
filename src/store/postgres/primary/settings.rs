//! The settings each pool connects with: a host's options with TLS as the URL says (and as the
//! host negotiated), the login the credentials give now, the failures described; and pointing
//! the pools at them anew, one repointing at a time.

use sqlx::postgres::PgConnectOptions;

use super::{Followed, Follower, Shape};
use crate::store::postgres::credentials::{Credentials, Login};
use crate::store::postgres::hosts::host_name;
use crate::store::postgres::refusal::{Attempt, ConnectFailure};
use std::sync::atomic::Ordering;

impl Follower {
    /// `host:port` of the host new connections go to now.
    pub(in crate::store::postgres) fn host(&self) -> String {
        host_name(&self.list.hosts[self.index()])
    }

    /// Host `index`'s settings as a pool that adds `shape` connects to it: with TLS as the URL
    /// says (and as the host negotiated), logging in as the credentials last read say.
    pub(in crate::store::postgres) fn options(
        &self,
        index: usize,
        shape: &Shape,
    ) -> PgConnectOptions {
        self.options_as(index, shape, &self.credentials.login(index))
    }

    /// [`Self::options`] logging in as `login`.
    pub(in crate::store::postgres) fn options_as(
        &self,
        index: usize,
        shape: &Shape,
        login: &Login,
    ) -> PgConnectOptions {
        let fallback = self.fallback[index].load(Ordering::SeqCst);
        // Made anew each time (`apply` starts the driver's TLS state afresh): what the files
        // hold now is read by the next connection.
        let options = self
            .list
            .tls
            .apply(shape(self.list.hosts[index].clone()), fallback);
        let options = options.username(&login.user);
        match &login.password {
            Some(password) => options.password(password),
            None => options,
        }
    }

    /// [`Self::options`] of the host new connections go to now.
    pub(in crate::store::postgres) fn current_options(&self, shape: &Shape) -> PgConnectOptions {
        self.options(self.index(), shape)
    }

    /// The credentials the connections log in with.
    pub(in crate::store::postgres) fn credentials(&self) -> &Credentials {
        &self.credentials
    }

    /// A problem with the certificate or key files the URL names, as a failure to connect to
    /// the current host: checked before the store connects, since the driver itself does not
    /// hold a private key to libpq's rule (no access for others).
    pub(in crate::store::postgres) fn files_problem(&self) -> Option<ConnectFailure> {
        self.list.tls.check_files().map(|cause| ConnectFailure {
            host: self.host(),
            cause,
        })
    }

    /// How a failure to connect to host `index` reads for an operator.
    pub(in crate::store::postgres) fn describe(
        &self,
        index: usize,
        error: &sqlx::Error,
    ) -> ConnectFailure {
        let options = &self.list.hosts[index];
        let login = self.credentials.login(index);
        Attempt {
            host: &host_name(options),
            host_name: options.get_host(),
            user: &login.user,
            database: options.get_database().unwrap_or_default(),
            tls: &self.list.tls,
            credentials_problem: self.credentials.problem(),
        }
        .failure(error)
    }

    /// Whether host `index` may still change between plain and TLS after a refusal, and
    /// `error` is one that the other kind of session may not meet: `allow` tried plain and
    /// was refused at authentication; `prefer` tried TLS and was refused at authentication or
    /// failed its handshake.
    pub(in crate::store::postgres) fn may_fall_back(
        &self,
        index: usize,
        error: &sqlx::Error,
    ) -> bool {
        if !self.list.tls.negotiates() || self.fallback[index].load(Ordering::SeqCst) {
            return false;
        }
        let refused_at_login = matches!(error, sqlx::Error::Database(db)
            if db.code().is_some_and(|code| code.starts_with("28")));
        match self.list.tls.mode {
            crate::store::postgres::tls::SslMode::Allow => refused_at_login,
            _ => refused_at_login || crate::store::postgres::refusal::handshake_failed(error),
        }
    }

    /// Host `index`'s connections use the other kind of session from now on.
    pub(in crate::store::postgres) fn fall_back(&self, index: usize) {
        self.fallback[index].store(true, Ordering::SeqCst);
    }

    /// Points `pools` at the current host with its settings as they stand now, one repointing
    /// at a time (see [`Self::repointing`]).
    pub(in crate::store::postgres) fn repoint(&self, pools: &[Followed<'_>]) {
        let _one = self
            .repointing
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let index = self.index();
        for followed in pools {
            followed
                .pool
                .set_connect_options(self.options(index, followed.shape));
        }
        self.generation.fetch_add(1, Ordering::SeqCst);
    }

    /// How many times the pools were pointed anew ([`Self::repoint`], a move).
    pub(in crate::store::postgres) fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// Whether the TLS files changed since the pools' settings were last made (a CA bundle or a
    /// client certificate replaced in place): then the settings must be made again, since the
    /// driver keeps what it read of the files in them.
    pub(in crate::store::postgres) fn tls_files_changed(&self) -> bool {
        let now = self.list.tls.files_stamp();
        let mut stamp = self
            .tls_stamp
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if *stamp == now {
            return false;
        }
        *stamp = now;
        true
    }

    /// [`Self::options`] of host `index` as they would be after [`Self::fall_back`].
    pub(in crate::store::postgres) fn fallback_options(
        &self,
        index: usize,
        shape: &Shape,
    ) -> PgConnectOptions {
        self.list.tls.apply(self.options(index, shape), true)
    }
}
