//! Listening for committed changes (`LISTEN` on [`KEY_CHANNEL`]), from this and other replicas,
//! and the key a waiter watches, marked so that no change of it commits unannounced.

use std::time::Duration;

use sqlx::postgres::PgListener;
use sqlx::{Connection, PgConnection};
use tokio_util::sync::CancellationToken;

use super::PgStore;
use super::error::classify;
use super::rows::{MarkedKeyRow, WatchedKeyRow};
use super::sql::{ERASED_CHANNEL, KEY_CHANNEL, LOOKUP_WATCHED, REPLICAS_CHANNEL, WATCH_KEY};
use super::statements::FromPgRow;
use crate::domain::{KeyHash, KeyState, LookupQuery};
use crate::store::{Erasure, KeyEvent, StoreError};

/// How many key events may wait for a slow subscriber before it is told it missed some.
pub(super) const EVENTS_QUEUED: usize = 4096;

/// How long the listener waits before connecting again, at first and at most.
const LISTEN_RETRY: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(5));

impl PgStore {
    /// Listens on [`KEY_CHANNEL`] until the connection drops (answered `Ok`), the store moves
    /// to another host (the connection is then dropped: notifications are sent on the
    /// primary only), or shutdown.
    pub(super) async fn listen_until_dropped(
        &self,
        shutdown: &CancellationToken,
    ) -> Result<(), sqlx::Error> {
        let mut moves = self.listen_follower.moves();
        moves.mark_unchanged();
        let mut connected = PgListener::connect_with(&self.listen_pool).await;
        if let Err(error) = &connected
            && self.after_refusal(error, false).await
        {
            connected = PgListener::connect_with(&self.listen_pool).await;
        }
        let mut listener = match connected {
            Ok(listener) => listener,
            // The pool says only that it timed out: one direct attempt tells why (the database
            // does not exist yet, authentication, the network).
            Err(sqlx::Error::PoolTimedOut) => {
                let options = self.listen_follower.current_options(&self.shapes.listen);
                return Err(match PgConnection::connect_with(&options).await {
                    Ok(connection) => {
                        let _ = connection.close().await;
                        sqlx::Error::PoolTimedOut
                    }
                    Err(cause) => cause,
                });
            }
            Err(other) => return Err(other),
        };
        listener
            .listen_all([
                KEY_CHANNEL,
                ERASED_CHANNEL,
                REPLICAS_CHANNEL,
                self.replica.channel.as_str(),
            ])
            .await?;
        // Whatever committed while nobody listened is unknown: every waiter looks again, and
        // every replay cache forgets what it holds (an erasure may have been missed). Sent
        // before anything heard on this connection, so that a heartbeat heard after it
        // confirms a cache that has forgotten.
        let _ = self.events.send(KeyEvent::Missed);
        let _ = self.erasures.send(Erasure::Missed);
        self.replica.listening();
        loop {
            let next = tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                _ = moves.changed() => {
                    tracing::info!("the writable host changed; listening there");
                    return Ok(());
                }
                next = listener.try_recv() => next?,
            };
            match next {
                Some(notification) if notification.channel() == ERASED_CHANNEL => {
                    let _ = self
                        .erasures
                        .send(Erasure::from_payload(notification.payload()));
                    // A waiter on an erased key must look again.
                    let _ = self.events.send(KeyEvent::Missed);
                }
                Some(notification) if notification.channel() != KEY_CHANNEL => {
                    if let Some(heard) = self
                        .replica
                        .heard(notification.channel(), notification.payload())
                    {
                        let _ = self.erasures.send(heard);
                    }
                }
                Some(notification) => match KeyHash::from_hex(notification.payload()) {
                    Some(hash) => {
                        let _ = self.events.send(KeyEvent::Changed(hash));
                    }
                    None => tracing::debug!("ignored a notification that names no key"),
                },
                None => {
                    self.suspect_listen_host();
                    return Ok(());
                }
            }
        }
    }
}

impl PgStore {
    /// The key for a waiter ([`Store::watch`]): [`LOOKUP_WATCHED`], and when the key is in
    /// progress and nobody watches it yet, [`WATCH_KEY`], whose answer is the row as that
    /// statement left it, marked: no Complete or Release of it can then commit unannounced.
    /// Should the key change between the two (another waiter marked it, or its row went), it is
    /// looked at again, all on one connection within the store's share of the budget.
    pub(super) async fn watch_key(&self, query: &LookupQuery) -> Result<KeyState, StoreError> {
        let began = std::time::Instant::now();
        let mut connection = self.lend().await.map_err(classify)?;
        let watched = self.watch_on(&mut connection, began, query).await;
        match &watched {
            Ok(_) => connection.keep(),
            // The server answered (a row held past the brief wait): the connection is sound and
            // goes back to the pool. Any other failure may have left it mid-statement, or on a
            // host the store is leaving: it is closed.
            Err(error) if error.key_held().is_some() => connection.settle(),
            Err(_) => {}
        }
        watched
    }

    /// `statement`'s row for `query`'s key (its namespace `$1`, its name `$2`), on `connection`,
    /// within the time of the operation begun at `began`.
    async fn key_row_within<O: FromPgRow>(
        &self,
        connection: &mut PgConnection,
        began: std::time::Instant,
        statement: &'static str,
        query: &LookupQuery,
    ) -> Result<Option<O>, StoreError> {
        let statement = sqlx::query_as(statement)
            .bind(query.namespace.as_str())
            .bind(query.key.as_str());
        self.fetch_optional_within(connection, began, statement)
            .await
    }

    /// [`Self::watch_key`]'s statements on `connection`.
    async fn watch_on(
        &self,
        connection: &mut PgConnection,
        began: std::time::Instant,
        query: &LookupQuery,
    ) -> Result<KeyState, StoreError> {
        loop {
            let looked: Option<WatchedKeyRow> = self
                .key_row_within(connection, began, LOOKUP_WATCHED, query)
                .await?;
            return Ok(match looked {
                None => KeyState::Absent,
                Some(looked) if looked.watched || looked.key.completed_at.is_some() => {
                    KeyState::of(Some(looked.key.into()))
                }
                Some(_) => {
                    let marked: Option<MarkedKeyRow> = self
                        .key_row_within(connection, began, WATCH_KEY, query)
                        .await?;
                    match marked {
                        Some(marked) => KeyState::of(marked.live.then(|| marked.key.into())),
                        None => continue,
                    }
                }
            });
        }
    }

    /// Listens until shutdown, connecting again after a pause that doubles while connecting
    /// fails ([`LISTEN_RETRY`]).
    pub(super) async fn listen_with_retries(&self, shutdown: CancellationToken) {
        let mut retry = LISTEN_RETRY.0;
        // The cause last logged: a listener that cannot connect says why once, and again when
        // the cause changes, not at every retry.
        let mut reported: Option<String> = None;
        while !shutdown.is_cancelled() {
            match self.listen_until_dropped(&shutdown).await {
                Ok(()) => {
                    retry = LISTEN_RETRY.0;
                    reported = None;
                    if !shutdown.is_cancelled() {
                        tracing::warn!("the listening connection dropped; reconnecting");
                    }
                }
                Err(error) => {
                    if super::primary::host_suspect(&error) {
                        self.suspect_listen_host();
                    }
                    let cause = self
                        .listen_follower
                        .describe(self.listen_follower.index(), &error)
                        .to_string();
                    if reported.as_deref() == Some(cause.as_str()) {
                        tracing::debug!(error = %cause, ?retry, "still cannot listen");
                    } else {
                        tracing::warn!(error = %cause, ?retry,
                            "cannot listen for other replicas' changes; retrying");
                        reported = Some(cause);
                    }
                    retry = (retry * 2).min(LISTEN_RETRY.1);
                }
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(retry) => {}
            }
        }
    }
}
