//! Following the writable host of a URL that names several (`hosts.rs`), or checking the one
//! host of a URL with `target_session_attrs`.
//!
//! The driver's pools connect to one host, the one their connection settings name. A
//! [`Follower`] knows every host of the URL and which one the store's pools connect to now; each
//! new connection is checked (`pg_is_in_recovery()`, `transaction_read_only`) and refused when
//! its host cannot write, so no statement ever runs on a standby or a demoted primary. When the
//! store meets trouble (a connection lost or refused, a statement refused as read-only, the
//! health probe failing) it asks every host at once which one is writable now and points its
//! pools there ([`PgStore::suspect_host`]); connections made before the move are then closed as
//! they come back, and the `LISTEN` connection reconnects to the new host.
//!
//! Unlike libpq, which tries hosts one after another, the hosts are asked at once and the first
//! writable one to answer is taken: a host that is cut off (its packets dropped) would otherwise
//! hold the search up for a whole connection timeout before the next host is tried.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection, PgConnection, PgPool};
use tokio::sync::watch;

mod settings;

use super::PgStore;
use super::credentials::{CredentialFiles, Credentials};
use super::hosts::{HostList, SessionAttrs, host_name};
use super::refusal::ConnectFailure;
use super::sql::SESSION_WRITABLE;

/// What a pool adds to a host's settings (its startup options, its application name).
pub(super) type Shape = Arc<dyn Fn(PgConnectOptions) -> PgConnectOptions + Send + Sync>;

/// How long the search waits before asking every host again, at first and at most, while none
/// is writable (a failover under way).
const SEARCH_RETRY: (Duration, Duration) = (Duration::from_millis(50), Duration::from_millis(500));

/// The hosts of one URL and the one the store's pools connect to now. Shared by the pools'
/// connection checks; it holds no pool itself (a pool's checks hold it, so it holding the pool
/// would keep the pool alive for ever).
#[derive(Debug)]
pub(super) struct Follower {
    list: HostList,
    /// Who the connections log in as, read again as it rotates.
    credentials: Credentials,
    /// Per host: whether a host refused the session `sslmode=allow` (plain) or `prefer` (TLS)
    /// tries first, and the other kind was accepted: its connections are of that kind since.
    fallback: Vec<AtomicBool>,
    /// Held while the pools are pointed at a host with settings (a move, a new login, TLS files
    /// changed, a host's other kind of session): one at a time, so that none puts back a host
    /// or a login another has just replaced.
    repointing: Mutex<()>,
    /// Counts the times the pools were pointed anew, so that a caller that waited can tell
    /// whether the settings changed meanwhile.
    generation: std::sync::atomic::AtomicU64,
    /// What the TLS files (`sslrootcert`, `sslcert`, `sslkey`) were when the pools' settings
    /// were last made (the driver keeps what it read of them in the settings).
    tls_stamp: Mutex<Vec<Option<(std::time::SystemTime, u64, u64)>>>,
    /// The index in `list.hosts` of the host new connections go to.
    current: AtomicUsize,
    /// When the store last moved to another host: a connection made before it may be to the
    /// old one, and is closed instead of reused.
    moved_at: LastTime,
    /// Counts the moves, for the `LISTEN` connection, which reconnects on each.
    moves: watch::Sender<u64>,
    /// Whether a search for the writable host is under way (one at a time).
    searching: AtomicBool,
    /// Whether the writable host has been looked for before the first connection.
    located: AtomicBool,
    /// When the store last met trouble that a failover would explain: a connection that has
    /// sat unused since before it may be to a host that is gone or cut off (where a ping would
    /// wait for the TCP keepalives), and is closed instead of reused.
    distrusted_at: LastTime,
}

/// When something last happened to the store (a move, trouble), if it has.
#[derive(Debug, Default)]
struct LastTime(Mutex<Option<Instant>>);

impl LastTime {
    fn set_now(&self) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(Instant::now());
    }

    /// Whether what began `age` ago began before it.
    fn since_before(&self, age: Duration) -> bool {
        let last = *self.0.lock().unwrap_or_else(PoisonError::into_inner);
        last.is_some_and(|last| age >= last.elapsed())
    }
}

/// Why a new connection was refused: its host cannot write.
#[derive(Debug, thiserror::Error)]
#[error("{host} cannot write ({why}); target_session_attrs={attrs} looks for another host")]
pub(super) struct NotWritable {
    host: String,
    why: &'static str,
    attrs: SessionAttrs,
}

impl Follower {
    pub(super) fn new(
        list: HostList,
        files: CredentialFiles,
        url_file_rest: Option<String>,
    ) -> Self {
        let credentials = Credentials::new(
            files,
            list.passfile.clone(),
            list.host_keys(),
            (list.login.clone(), list.env_password.clone()),
            url_file_rest,
        );
        Self {
            fallback: list.hosts.iter().map(|_| AtomicBool::new(false)).collect(),
            repointing: Mutex::new(()),
            generation: std::sync::atomic::AtomicU64::new(0),
            tls_stamp: Mutex::new(list.tls.files_stamp()),
            credentials,
            list,
            current: AtomicUsize::new(0),
            moved_at: LastTime::default(),
            moves: watch::channel(0).0,
            searching: AtomicBool::new(false),
            located: AtomicBool::new(false),
            distrusted_at: LastTime::default(),
        }
    }

    /// Whether the store may move to another host (several hosts, each checked).
    pub(super) fn can_move(&self) -> bool {
        self.list.hosts.len() > 1 && self.list.attrs.checked()
    }

    pub(super) fn attrs(&self) -> SessionAttrs {
        self.list.attrs
    }

    /// The index in the URL's hosts of the one new connections go to now.
    pub(super) fn index(&self) -> usize {
        self.current.load(Ordering::SeqCst)
    }

    /// Whether a connection that has existed for `age` was made before the last move (and may
    /// be to the old host).
    pub(super) fn predates_move(&self, age: Duration) -> bool {
        // A store that cannot move pays nothing for this on each statement.
        self.can_move() && self.moved_at.since_before(age)
    }

    /// Whether `since` (when a connection was taken) is before the last move.
    pub(super) fn taken_before_move(&self, since: Instant) -> bool {
        self.predates_move(since.elapsed())
    }

    /// Whether a connection unused for `idle_for` has been so since before the last trouble.
    pub(super) fn idle_since_trouble(&self, idle_for: Duration) -> bool {
        self.can_move() && self.distrusted_at.since_before(idle_for)
    }

    /// Changes on each move.
    pub(super) fn moves(&self) -> watch::Receiver<u64> {
        self.moves.subscribe()
    }

    /// Checks a new connection: `Ok` when its host can write as `target_session_attrs` asks.
    pub(super) async fn check(&self, connection: &mut PgConnection) -> Result<(), sqlx::Error> {
        check_writable(connection, self.list.attrs, &self.host()).await
    }
}

/// Whether the session on `connection` can write as `attrs` asks (one round trip).
async fn check_writable(
    connection: &mut PgConnection,
    attrs: SessionAttrs,
    host: &str,
) -> Result<(), sqlx::Error> {
    let (in_recovery, read_only): (bool, String) = sqlx::query_as(SESSION_WRITABLE)
        .persistent(false)
        .fetch_one(&mut *connection)
        .await?;
    let why = match attrs {
        SessionAttrs::Any => None,
        SessionAttrs::Primary => in_recovery.then_some("in recovery: a standby"),
        SessionAttrs::ReadWrite if in_recovery => Some("in recovery: a standby"),
        SessionAttrs::ReadWrite => (read_only == "on").then_some("read-only by default"),
    };
    match why {
        None => Ok(()),
        Some(why) => Err(sqlx::Error::Configuration(Box::new(NotWritable {
            host: host.to_owned(),
            why,
            attrs,
        }))),
    }
}

/// Whether `error` suggests that the host the store connects to may no longer be the writable
/// one: the connection was lost or refused, the pool found none, the session turned read-only
/// (a demoted primary), or the server is shutting down.
pub(super) fn host_suspect(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_) | sqlx::Error::Tls(_) | sqlx::Error::PoolTimedOut => true,
        // A statement not sent for want of time says nothing of its host.
        sqlx::Error::Configuration(_) => !super::statements::is_not_sent(error),
        sqlx::Error::Protocol(_) => super::error::tls_request_unanswered(error),
        sqlx::Error::Database(db) => {
            let code = db.code().unwrap_or_default();
            // read_only_sql_transaction, invalid_transaction_state (a standby cannot assign a
            // transaction id), connection_exception, admin/crash shutdown, cannot_connect_now.
            code == "25006" || code == "25000" || code.starts_with("08") || code.starts_with("57P")
        }
        _ => false,
    }
}

/// One of the store's pools and what it adds to each host's settings.
pub(super) struct Followed<'a> {
    pub pool: &'a PgPool,
    pub shape: &'a Shape,
}

impl PgStore {
    /// Looks for the writable host in the background, unless a search is under way or the URL
    /// names one host: called whenever the store meets trouble that a failover would explain.
    pub(super) fn suspect_host(&self) {
        self.suspect(true);
    }

    /// [`Self::suspect_host`] for the `LISTEN` connection's URL.
    pub(super) fn suspect_listen_host(&self) {
        self.suspect(false);
    }

    fn suspect(&self, calls: bool) {
        let follower = if calls {
            &self.follower
        } else {
            &self.listen_follower
        };
        if !follower.can_move() {
            return;
        }
        follower.distrusted_at.set_now();
        if follower.searching.swap(true, Ordering::SeqCst) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            follower.searching.store(false, Ordering::SeqCst);
            return;
        };
        let store = self.clone();
        runtime.spawn(async move { store.search(calls).await });
    }

    /// The follower of the calls' URL (`calls`) or of the listener's, and the pools that follow
    /// it.
    pub(super) fn followed(&self, calls: bool) -> (&Arc<Follower>, Vec<Followed<'_>>) {
        let follower: &std::sync::Arc<Follower> = if calls {
            &self.follower
        } else {
            &self.listen_follower
        };
        let mut pools = Vec::new();
        if std::sync::Arc::ptr_eq(follower, &self.follower) {
            pools.push(Followed {
                pool: self.connections.pool(),
                shape: &self.shapes.calls,
            });
            pools.push(Followed {
                pool: &self.probe_pool,
                shape: &self.shapes.probe,
            });
        }
        // The listener follows whichever URL it listens on: the calls' own when it has none.
        if std::sync::Arc::ptr_eq(follower, &self.listen_follower) {
            pools.push(Followed {
                pool: &self.listen_pool,
                shape: &self.shapes.listen,
            });
            pools.push(Followed {
                pool: &self.beat_pool,
                shape: &self.shapes.heartbeat,
            });
        }
        (follower, pools)
    }

    /// Before the store's first connections (its first migration or probe): when the URL names
    /// several hosts, the writable one is looked for now, rather than after a connection to
    /// the first host has been refused. Once only: later moves follow trouble. When no host is
    /// writable, the failure names every host and what each answered.
    pub(super) async fn locate(&self) -> Result<(), ConnectFailure> {
        let mut failure = Ok(());
        for calls in [true, false] {
            let (follower, pools) = self.followed(calls);
            if !follower.can_move() || follower.located.swap(true, Ordering::SeqCst) {
                continue;
            }
            match self.writable_host(follower, None).await {
                Ok(found) => {
                    let host = host_name(&follower.list.hosts[found]);
                    tracing::info!(%host, attrs = %follower.attrs(), "the writable PostgreSQL host");
                    follower.move_to(found, &pools);
                }
                // Looked for again at the next trouble.
                Err(causes) => {
                    follower.located.store(false, Ordering::SeqCst);
                    if calls {
                        failure = Err(none_writable(follower, causes));
                    }
                }
            }
        }
        failure
    }

    /// Asks every host until one is writable (or the store closes), and moves there.
    async fn search(&self, calls: bool) {
        let (follower, pools) = self.followed(calls);
        let store_open = pools.first().map(|followed| followed.pool.clone());
        if let Ok(found) = self.writable_host(follower, store_open).await {
            follower.located.store(true, Ordering::SeqCst);
            follower.move_to(found, &pools);
        }
        follower.searching.store(false, Ordering::SeqCst);
    }

    /// The index of a writable host: every host is asked at once, each within a connection's
    /// wait, and the first writable one to answer is taken. With `until_closed`, each host is
    /// asked again (every [`SEARCH_RETRY`]) until one is writable or that pool closes, each on
    /// its own: a standby is found as soon as it is promoted, however long a host that is cut
    /// off takes to time out. Without one, `Err` holds what each host answered, in the URL's
    /// order.
    async fn writable_host(
        &self,
        follower: &Arc<Follower>,
        until_closed: Option<PgPool>,
    ) -> Result<usize, Vec<String>> {
        let shape: Shape = Arc::new(|options: PgConnectOptions| {
            options
                .application_name("idempotency-coordinator primary search")
                .disable_statement_logging()
        });
        let mut asking = tokio::task::JoinSet::new();
        for index in 0..follower.list.hosts.len() {
            let (follower, shape) = (follower.clone(), shape.clone());
            let attrs = follower.list.attrs;
            let wait = self.budget.connection_wait;
            let until_closed = until_closed.clone();
            asking.spawn(async move {
                let mut retry = SEARCH_RETRY.0;
                loop {
                    // Made again at each try: a long failover may outlast a rotated login.
                    let options = follower.options(index, &shape);
                    let asked = ask_host(&options, attrs, wait).await;
                    if asked.is_ok() {
                        return (index, asked);
                    }
                    match &until_closed {
                        Some(pool) if !pool.is_closed() => {
                            tokio::time::sleep(retry).await;
                            retry = (retry * 2).min(SEARCH_RETRY.1);
                        }
                        _ => return (index, asked),
                    }
                }
            });
        }
        let mut causes = vec![String::new(); follower.list.hosts.len()];
        while let Some(asked) = asking.join_next().await {
            match asked {
                Ok((index, Ok(()))) => return Ok(index),
                Ok((index, Err(error))) => {
                    causes[index] = match error {
                        Asked::Failed(error) => follower.describe(index, &error).cause,
                        Asked::NoAnswer(wait) => format!("no answer within {wait:?}"),
                    };
                }
                Err(_) => {}
            }
        }
        Err(causes)
    }
}

/// No host of `follower`'s URL is writable: each named with what it answered.
fn none_writable(follower: &Arc<Follower>, causes: Vec<String>) -> ConnectFailure {
    let hosts: Vec<String> = follower.list.hosts.iter().map(host_name).collect();
    let each = hosts
        .iter()
        .zip(causes)
        .map(|(host, cause)| format!("{host}: {cause}"))
        .collect::<Vec<_>>()
        .join("; ");
    ConnectFailure {
        host: hosts.join(","),
        cause: format!(
            "no host is writable (target_session_attrs={}): {each}",
            follower.attrs()
        ),
    }
}

/// Why a host was not taken.
enum Asked {
    Failed(sqlx::Error),
    NoAnswer(Duration),
}

/// Whether the host of `options` answers within `wait` with a session that can write as
/// `attrs` asks.
async fn ask_host(
    options: &PgConnectOptions,
    attrs: SessionAttrs,
    wait: Duration,
) -> Result<(), Asked> {
    let host = host_name(options);
    let asked = tokio::time::timeout(wait, async {
        let mut connection = match PgConnection::connect_with(options).await {
            // The database is not created yet (the first migration creates it on the writable
            // host): the host is asked through the maintenance one.
            Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some("3D000") => {
                PgConnection::connect_with(&options.clone().database("postgres")).await?
            }
            connected => connected?,
        };
        let checked = check_writable(&mut connection, attrs, &host).await;
        let _ = connection.close().await;
        checked
    })
    .await;
    match asked {
        Ok(Ok(())) => Ok(()),
        Ok(Err(error)) => {
            tracing::debug!(%host, error = %crate::telemetry::error_chain(&error),
                "not the writable host");
            Err(Asked::Failed(error))
        }
        Err(_) => {
            tracing::debug!(%host, ?wait, "no answer while looking for the writable host");
            Err(Asked::NoAnswer(wait))
        }
    }
}

impl Follower {
    /// Points `pools` at host `index`, if it is not the current one already.
    fn move_to(&self, index: usize, pools: &[Followed<'_>]) {
        let _one = self
            .repointing
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let before = self.current.swap(index, Ordering::SeqCst);
        if before == index {
            return;
        }
        for followed in pools {
            followed
                .pool
                .set_connect_options(self.options(index, followed.shape));
        }
        self.generation.fetch_add(1, Ordering::SeqCst);
        self.moved_at.set_now();
        self.moves.send_modify(|moves| *moves += 1);
        tracing::warn!(from = %host_name(&self.list.hosts[before]),
            to = %host_name(&self.list.hosts[index]),
            "the writable PostgreSQL host changed; the store follows it");
    }
}
