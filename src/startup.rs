//! Builds the service from settings and runs it until shutdown. Tests start the same
//! [`Application`] on port 0.
//!
//! Shutdown, once the token is cancelled: health turns NOT_SERVING (and Watch streams end), the
//! listener closes, calls in flight get their answers within the grace period, the reaper stops
//! between batches, store work still running (for callers that hung up) finishes under its own
//! timeout, and the pool closes.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::auth::{Authenticator, TokensFileError};
use crate::config::{SecuritySettings, Settings};
use crate::grpc::{self, Security, TlsMaterial};
use crate::health::{HealthState, ServingStatus};
use crate::readiness;
use crate::reaper;
use crate::service::erasures::Confirmation;
use crate::service::held_keys::HeldKeys;
use crate::service::waiting::{DatabaseClock, Waiters};
use crate::service::{Coordinator, InFlight, ReplayCache, Waiting};
use crate::store::{AdminStore, AnyStore, OpenError, Replicas, Store};
use crate::supervise::Lifecycle;
use crate::supervise::{Supervisor, TaskFailure};

/// How long past the grace period the process may take to let go of what is left.
const EXIT_MARGIN: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    #[error(transparent)]
    Store(#[from] OpenError),
    #[error("could not listen on {address}")]
    Bind {
        address: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Serve(#[from] grpc::ServeError),
    #[error("the tokens file is not valid")]
    Tokens(#[from] TokensFileError),
    #[error(transparent)]
    TaskFailed(#[from] TaskFailure),
    #[error(transparent)]
    Metrics(#[from] crate::metrics::MetricsError),
    #[error("reading {path}")]
    TlsFile {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

pub struct Application {
    listener: TcpListener,
    local_addr: SocketAddr,
    store: AnyStore,
    security: Security,
    /// Every store task in flight, including those whose callers have hung up.
    store_work: TaskTracker,
    /// The calls the store has yet to finish.
    in_flight: InFlight,
    /// The TryStarts waiting for a key's holder (`None` with `--max-waiters 0`).
    waiters: Option<Waiters>,
    /// Watches the essential tasks; one that fails stops the service with an error.
    supervisor: Supervisor,
    settings: Settings,
    /// `/metrics`, when `--metrics-listen` asks for it: its listener and the recorder.
    metrics: Option<(TcpListener, metrics_exporter_prometheus::PrometheusHandle)>,
}

impl Application {
    /// Binds the listener and prepares the store without connecting to it: the service starts,
    /// and reports NOT_SERVING, while the database is still unreachable.
    pub async fn build(settings: Settings) -> Result<Self, StartupError> {
        let store = AnyStore::open_lazy(&settings.store)?;
        let bind_error = |source| StartupError::Bind {
            address: settings.listen,
            source,
        };
        let listener = TcpListener::bind(settings.listen)
            .await
            .map_err(bind_error)?;
        let local_addr = listener.local_addr().map_err(bind_error)?;
        let metrics = match settings.metrics_listen {
            Some(address) => {
                let handle = crate::metrics::install()?;
                let listener = crate::metrics::bind(address)
                    .await
                    .map_err(|source| StartupError::Bind { address, source })?;
                Some((listener, handle))
            }
            None => None,
        };
        let security = security(
            &settings.security,
            settings.operation_timeout,
            settings.connections.clone(),
        )?;
        Ok(Self {
            listener,
            local_addr,
            store,
            security,
            store_work: TaskTracker::new(),
            in_flight: InFlight::default(),
            waiters: (settings.waiting.max_waiters > 0).then(|| Waiters::new(settings.waiting)),
            supervisor: Supervisor::new(),
            settings,
            metrics,
        })
    }

    /// The address actually bound (the port is chosen by the system when 0 was asked for).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Where `/metrics` is served, when it is.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics
            .as_ref()
            .and_then(|(listener, _)| listener.local_addr().ok())
    }

    pub fn store(&self) -> &AnyStore {
        &self.store
    }

    /// The tokens in force, to reload them (on SIGHUP), when the API requires tokens.
    pub fn authenticator(&self) -> Option<Arc<Authenticator>> {
        self.security.authenticator.clone()
    }

    /// Registers essential tasks (signal handling, the tokens reload, ...): if one fails, the
    /// service stops and `run_until_stopped` answers the failure.
    pub fn supervisor(&self) -> Supervisor {
        self.supervisor.clone()
    }

    /// The calls the store has yet to finish, whether or not their callers still wait (a
    /// handle that stays valid while the service runs).
    pub fn calls_in_flight(&self) -> InFlight {
        self.in_flight.clone()
    }

    /// The TryStarts waiting for a key's holder (a handle that stays valid while the service
    /// runs), unless waiting is off.
    pub fn waiters(&self) -> Option<Waiters> {
        self.waiters.clone()
    }

    pub async fn run_until_stopped(self, shutdown: CancellationToken) -> Result<(), StartupError> {
        let Self {
            listener,
            store,
            store_work,
            in_flight,
            security,
            waiters,
            supervisor,
            settings,
            metrics,
            ..
        } = self;
        let health = HealthState::new();
        let clock = DatabaseClock::default();
        let waiters_seen = waiters.clone();
        let waiting = waiters.map(|waiters| Waiting {
            waiters,
            clock: clock.clone(),
            shutdown: shutdown.clone(),
        });
        // Changes committed by any replica wake this replica's waiters. Listening needs the
        // database, which a first start creates in its migration: the watcher starts once the
        // store is first ready (no waiter is served before that), not with a warning each retry.
        let key_watch = supervisor.spawn("key watcher", &shutdown, {
            let store = store.clone();
            let shutdown = shutdown.clone();
            let mut status = health.subscribe();
            async move {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    _ = status.wait_for(|status| *status == ServingStatus::Serving) => {}
                }
                store.watch_keys(shutdown).await
            }
        });
        let waking = waiting.as_ref().map(|waiting| {
            supervisor.spawn(
                "waiter wake-ups",
                &shutdown,
                waiting
                    .waiters
                    .clone()
                    .follow(store.key_events(), shutdown.clone()),
            )
        });
        let confirmation = if store.has_replicas() {
            let parts = store.clone();
            Confirmation::by_heartbeats(
                store.partitions(),
                Arc::new(move |namespace: &str| parts.partition_of(namespace)),
            )
        } else {
            Confirmation::always()
        };
        let replays = ReplayCache::new(settings.replay_cache_bytes, clock.clone(), confirmation);
        // Erasures by any replica (this one's too) empty this replica's replay cache of what
        // they erased, and each eraser's request is acknowledged. Subscribed before serving
        // begins, so that none is missed.
        supervisor.spawn(
            "erasure follower",
            &shutdown,
            crate::service::erasures::follow_erasures(
                store.clone(),
                store.erasures(),
                replays.clone(),
                shutdown.clone(),
            ),
        );
        let held_keys = HeldKeys::for_capacity(
            store.partitions(),
            settings.store.concurrent_statements,
            settings.operation_timeout,
        );
        let admin = crate::service::admin::Admin::new(
            (store.clone(), held_keys.clone()),
            settings.operation_timeout,
            replays.clone(),
            settings.audit_retention,
            store_work.clone(),
            shutdown.clone(),
        );
        let coordinator = Coordinator::new(
            store.clone(),
            store_work.clone(),
            in_flight,
            settings.operation_timeout,
            settings.coalescing,
            waiting,
            replays,
            held_keys,
            &Lifecycle {
                supervisor: supervisor.clone(),
                shutdown: shutdown.clone(),
            },
        );

        let metrics_serving = metrics.map(|(listener, handle)| {
            let sources = crate::metrics::Sources {
                store: store.clone(),
                health: health.clone(),
                waiters: waiters_seen,
                authenticator: security.authenticator.clone(),
                coordinator: coordinator.clone(),
            };
            tokio::spawn(crate::metrics::serve(
                listener,
                handle,
                sources,
                shutdown.clone(),
            ))
        });

        let monitor = supervisor.spawn(
            "health monitor",
            &shutdown,
            readiness::monitor(
                store.clone(),
                health.clone(),
                clock,
                settings.readiness.clone(),
                shutdown.clone(),
            ),
        );
        let reaper = supervisor.spawn(
            "reaper",
            &shutdown,
            reaper::run_each(store.parts(), settings.reaper.clone(), shutdown.clone()),
        );

        // Health flips inside the server's shutdown signal, so it is NOT_SERVING before the
        // listener closes. The signal also fixes when the grace period ends.
        let grace_ends = Arc::new(OnceLock::new());
        let signal = {
            let health = health.clone();
            let shutdown = shutdown.clone();
            let grace_ends = grace_ends.clone();
            let grace = settings.shutdown_grace;
            async move {
                shutdown.cancelled().await;
                let _ = grace_ends.set(Instant::now() + grace);
                health.begin_shutdown();
            }
        };
        let serving = grpc::serve(
            listener,
            coordinator,
            admin,
            settings.limits.clone(),
            security,
            health.clone(),
            grpc::MetricsSettings {
                on: settings.metrics_listen.is_some(),
                namespace_labels: settings.metrics_namespace_labels,
            },
            signal,
        );
        let grace_over = async {
            shutdown.cancelled().await;
            tokio::time::sleep(settings.shutdown_grace).await;
        };
        let served = tokio::select! {
            served = serving => served,
            () = grace_over => {
                tracing::warn!(grace = ?settings.shutdown_grace,
                    "grace period over with calls still in flight; closing their connections");
                Ok(())
            }
        };
        // An error from the server (not from shutdown) ends the service too.
        shutdown.cancel();
        health.begin_shutdown();

        // What is left (the reaper's batch, store work whose callers hung up, closing the pool)
        // gets the rest of the grace period, and a second at most beyond it, so that the
        // process is gone before an orchestrator's kill.
        let exit_by = grace_ends.get().copied().unwrap_or_else(Instant::now) + EXIT_MARGIN;
        store_work.close();
        let finished = tokio::time::timeout_at(exit_by, async {
            let _ = reaper.await;
            let _ = monitor.await;
            let _ = key_watch.await;
            if let Some(waking) = waking {
                let _ = waking.await;
            }
            store_work.wait().await;
            store.close().await;
            if let Some(metrics_serving) = metrics_serving {
                let _ = metrics_serving.await;
            }
        })
        .await;
        if finished.is_err() {
            tracing::warn!(
                running = store_work.len(),
                "store work still running when the grace period ended"
            );
        }
        tracing::info!("stopped");
        if let Some(failure) = supervisor.failure() {
            return Err(failure.into());
        }
        served.map_err(StartupError::from)
    }
}

/// Loads the tokens file and reads the TLS files, so that a bad file stops the start.
fn security(
    settings: &SecuritySettings,
    operation_timeout: std::time::Duration,
    connections: crate::grpc::connections::ConnectionSettings,
) -> Result<Security, StartupError> {
    let authenticator = settings
        .tokens_file
        .as_deref()
        .map(|path| Authenticator::load(path, settings.rate_limit))
        .transpose()?
        .map(Arc::new);
    let read = |path: &std::path::Path| {
        std::fs::read(path).map_err(|source| StartupError::TlsFile {
            path: path.to_owned(),
            source,
        })
    };
    let tls = match &settings.tls {
        Some(files) => Some(TlsMaterial {
            certificate: read(&files.certificate)?,
            private_key: read(&files.private_key)?,
            client_ca: files.client_ca.as_deref().map(read).transpose()?,
        }),
        None => None,
    };
    Ok(Security {
        authenticator,
        tls,
        max_concurrent_streams: settings.max_concurrent_streams,
        request_read_timeout: operation_timeout,
        connections,
    })
}
