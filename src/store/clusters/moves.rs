//! Moving a namespace (and the consumer of the same name) from one cluster to another while it
//! is served (`admin placement move`, docs/scaling.md, "Moving a namespace"). The steps, each
//! committed before the next, so that a move interrupted anywhere leaves the namespace served
//! by exactly one cluster (or, between fence and switch, by none for a moment) and can be
//! resumed or rolled back:
//!
//! 1. **Fence.** The target's gate says `arriving` (nobody may write it there yet), then the
//!    source's says `leaving`: from that commit on, every statement on the namespace's rows on
//!    the source fails before it reads or writes (`routes.rs` sends its call to the target,
//!    where it waits for the switch).
//! 2. **Drain.** The source's transactions that began before the fence are waited for: a
//!    statement that began earlier did not see it.
//! 3. **Copy and switch**, in one transaction on the target: the rows, the target's sequences
//!    raised to what the source's last handed out (so a key's tokens keep increasing across the
//!    move, and a copied event's batch is never a later MarkProcessed's), and the target's gate
//!    lifted. The namespace is served by the target from that
//!    commit.
//! 4. **Record** the source's gate as `left` (announced as the namespace's erasure, so that
//!    every replica's replay cache forgets it and fills again through the target), and delete
//!    the namespace's rows there.
//!
//! A rollback before the switch deletes the target's copy and points its gate home, then lifts
//! the source's gate; after the switch it is refused: a move back is a move.

use std::time::Duration;

use super::ClusteredStore;
use super::standing::Standing;
use crate::store::postgres::MoveSession;
use crate::store::{GateState, StoreError};

/// What a move or its rollback did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoveReport {
    pub from: String,
    pub to: String,
    pub outcome: MoveOutcome,
    /// Rows copied: keys, processed events, audit events.
    pub copied: [u64; 3],
    /// Rows deleted from the cluster the namespace left (or from the target, rolled back).
    pub deleted: u64,
    /// How long the namespace was served by neither cluster (fence to switch).
    pub frozen: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoveOutcome {
    Moved,
    /// It lived on the target already: nothing was done.
    AlreadyThere,
    RolledBack,
}

impl MoveOutcome {
    pub fn name(self) -> &'static str {
        match self {
            Self::Moved => "moved",
            Self::AlreadyThere => "already_there",
            Self::RolledBack => "rolled_back",
        }
    }
}

/// Why a move was refused: the request does not fit where the namespace stands (an operator's
/// error, FAILED_PRECONDITION), or a cluster failed (UNAVAILABLE; the move can be resumed).
#[derive(Debug, thiserror::Error)]
pub enum MoveError {
    #[error("{0}")]
    Refused(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The move's sessions, one per cluster, opened as they are needed.
struct Sessions<'s> {
    store: &'s ClusteredStore,
    open: Vec<Option<MoveSession>>,
}

impl<'s> Sessions<'s> {
    fn new(store: &'s ClusteredStore) -> Self {
        let open = (0..store.clusters.len()).map(|_| None).collect();
        Self { store, open }
    }

    async fn at(&mut self, cluster: usize) -> Result<&mut MoveSession, StoreError> {
        if self.open[cluster].is_none() {
            let session = self.store.usable(cluster)?.move_session().await?;
            self.open[cluster] = Some(session);
        }
        self.open[cluster]
            .as_mut()
            .ok_or(StoreError::Inconsistent("a move's session vanished"))
    }

    async fn gate(
        &mut self,
        cluster: usize,
        scope: &str,
    ) -> Result<Option<(GateState, usize)>, MoveError> {
        let gate = self.at(cluster).await?.gate(scope).await?;
        gate.map(|gate| Ok((gate.state, self.store.peer_index(&gate.peer)?)))
            .transpose()
    }

    async fn close(self) {
        for session in self.open.into_iter().flatten() {
            session.close().await;
        }
    }
}

impl ClusteredStore {
    pub(super) fn peer_index(&self, name: &str) -> Result<usize, MoveError> {
        self.index_of(name).ok_or_else(|| {
            MoveError::Refused(format!(
                "a placement gate names cluster {name}, which this service was not given \
                 (--cluster)"
            ))
        })
    }

    /// Takes the lock that lets one move of `scope` run at a time, on every cluster, in their
    /// order: whichever cluster a move starts from or goes to, two moves of one namespace never
    /// run together. Refused while another holds it, or when a cluster cannot be reached.
    async fn lock_moves(&self, sessions: &mut Sessions<'_>, scope: &str) -> Result<(), MoveError> {
        for at in 0..self.clusters.len() {
            let session = sessions.at(at).await.map_err(|error| {
                MoveError::Refused(format!(
                    "a move needs every cluster, and cluster {} cannot be reached: {}",
                    self.name_of(at),
                    crate::telemetry::error_chain(&error)
                ))
            })?;
            if !session.lock_moves_of(scope).await? {
                return Err(MoveError::Refused(format!(
                    "another move of namespace {scope} is running"
                )));
            }
        }
        Ok(())
    }

    pub(super) fn name_of(&self, at: usize) -> String {
        self.clusters[at].name.to_string()
    }

    /// Where `scope` stands, and every cluster's gate of it it stands by, read in the move's
    /// sessions (under the move's lock, so they stay as read while the move decides).
    async fn standing(
        &self,
        sessions: &mut Sessions<'_>,
        scope: &str,
    ) -> Result<(Standing, Vec<Option<(GateState, usize)>>), MoveError> {
        let mut gates = Vec::with_capacity(self.clusters.len());
        for at in 0..self.clusters.len() {
            gates.push(sessions.gate(at, scope).await?);
        }
        Ok((self.stand(scope, &gates)?, gates))
    }

    /// Moves `scope` to cluster `to`, or resumes its unfinished move there. `drain_bound`: how
    /// long the source's older transactions may take to end.
    pub async fn move_scope(
        &self,
        scope: &str,
        to: usize,
        drain_bound: Duration,
    ) -> Result<MoveReport, MoveError> {
        let mut sessions = Sessions::new(self);
        let report = self.move_with(&mut sessions, scope, to, drain_bound).await;
        sessions.close().await;
        report
    }

    async fn move_with(
        &self,
        sessions: &mut Sessions<'_>,
        scope: &str,
        to: usize,
        drain_bound: Duration,
    ) -> Result<MoveReport, MoveError> {
        self.lock_moves(sessions, scope).await?;
        let (standing, gates) = self.standing(sessions, scope).await?;
        let from = match standing {
            Standing::Home { home, left } if home == to => {
                // A cleanup an interrupted move did not finish is finished now.
                let mut deleted = 0;
                for gone in left {
                    deleted += sessions.at(gone).await?.delete_rows(scope).await?;
                }
                self.settle(scope, to);
                return Ok(MoveReport {
                    from: self.name_of(home),
                    to: self.name_of(to),
                    outcome: MoveOutcome::AlreadyThere,
                    copied: [0; 3],
                    deleted,
                    frozen: Duration::ZERO,
                });
            }
            Standing::Home { home, .. } => home,
            Standing::Moving { from, to: target } if target == to => from,
            Standing::Moving { to: target, .. } => {
                return Err(MoveError::Refused(format!(
                    "namespace {scope} is being moved to cluster {}: resume that move (--to {}) \
                     or roll it back (--rollback) first",
                    self.name_of(target),
                    self.name_of(target)
                )));
            }
        };
        let (source_name, target_name) = (self.name_of(from), self.name_of(to));
        let gate = |at: usize| gates.get(at).copied().flatten();
        let (target_gate, source_gate) = (gate(to), gate(from));
        let switched =
            matches!(source_gate, Some((GateState::Leaving, _))) && target_gate.is_none();
        let mut copied = [0; 3];
        let mut frozen = Duration::ZERO;
        if !switched {
            // 1. The fence: the target first, so that the namespace is written nowhere else
            // from the moment the source stops.
            if !matches!(target_gate, Some((GateState::Arriving, _))) {
                sessions
                    .at(to)
                    .await?
                    .set_gate(scope, GateState::Arriving, &source_name)
                    .await?;
            }
            let fenced_at = std::time::Instant::now();
            let source = sessions.at(from).await?;
            source
                .set_gate(scope, GateState::Leaving, &target_name)
                .await?;
            tracing::info!(namespace = scope, from = %source_name, to = %target_name, "move fenced");
            // 2. The drain.
            source.drain(drain_bound).await?;
            let drawn = source.last_drawn().await?;
            // 3. Copy and switch. Both sessions at once: take the source's out of the vector.
            let mut source = sessions.open[from]
                .take()
                .ok_or(StoreError::Inconsistent("a move's session vanished"))?;
            let copy = match sessions.at(to).await {
                Ok(target) => source.copy_to(target, scope, drawn).await,
                Err(error) => Err(error),
            };
            sessions.open[from] = Some(source);
            copied = copy?;
            frozen = fenced_at.elapsed();
            tracing::info!(namespace = scope, to = %target_name, ?frozen, "move switched");
        }
        self.settle(scope, to);
        // 4. Record and clean up.
        let source = sessions.at(from).await?;
        source.record_departure(scope, &target_name).await?;
        let deleted = source.delete_rows(scope).await?;
        Ok(MoveReport {
            from: source_name,
            to: target_name,
            outcome: MoveOutcome::Moved,
            copied,
            deleted,
            frozen,
        })
    }

    /// Rolls back `scope`'s unfinished move: refused once it has switched.
    pub async fn roll_back_move(&self, scope: &str) -> Result<MoveReport, MoveError> {
        let mut sessions = Sessions::new(self);
        let report = self.roll_back_with(&mut sessions, scope).await;
        sessions.close().await;
        report
    }

    async fn roll_back_with(
        &self,
        sessions: &mut Sessions<'_>,
        scope: &str,
    ) -> Result<MoveReport, MoveError> {
        self.lock_moves(sessions, scope).await?;
        let (standing, gates) = self.standing(sessions, scope).await?;
        let Standing::Moving { from, to } = standing else {
            return Err(MoveError::Refused(format!(
                "namespace {scope} has no unfinished move to roll back"
            )));
        };
        let (source_name, target_name) = (self.name_of(from), self.name_of(to));
        if gates.get(to).copied().flatten().is_none() {
            return Err(MoveError::Refused(format!(
                "the move of namespace {scope} to cluster {target_name} has switched: the \
                 target serves it; resume the move to finish it, then move it back \
                 (--to {source_name})"
            )));
        }
        // The target's copy goes while its gate still says "arriving" (a call there is sent
        // back to the source, which serves once its gate is lifted); then the target records
        // where the namespace lives. Gates pointing at each other as "left" and "leaving" would
        // send a call round in a circle meanwhile.
        sessions
            .at(to)
            .await?
            .give_back(scope, &source_name)
            .await?;
        sessions.at(from).await?.lift_gate(scope).await?;
        sessions
            .at(to)
            .await?
            .set_gate(scope, GateState::Left, &source_name)
            .await?;
        self.settle(scope, from);
        Ok(MoveReport {
            from: source_name,
            to: target_name,
            outcome: MoveOutcome::RolledBack,
            copied: [0; 3],
            deleted: 0,
            frozen: Duration::ZERO,
        })
    }
}
