//! Where a namespace stands, by the clusters' placement gates: served by one cluster (its
//! rule's, or where that cluster's gates lead), or in a move begun from one to another. A move
//! reads it under its lock before each step (`moves.rs`); an operator reads it with
//! `admin placement show` ([`ClusteredStore::placement_of`]).

use futures::future::join_all;

use super::moves::MoveError;
use super::{ClusteredStore, in_cluster};
use crate::store::{GateRow, GateState};

/// Where a namespace stands, by the clusters' gates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Standing {
    /// Served by `home`; `left` the clusters whose gates led there (a move's source keeps its
    /// rows until its cleanup has run).
    Home { home: usize, left: Vec<usize> },
    /// A move from `from` to `to` has begun (fenced, perhaps switched).
    Moving { from: usize, to: usize },
}

/// Each cluster's gate of one scope, in the clusters' order: its state and the cluster it names.
pub(super) type Gates = [Option<(GateState, usize)>];

impl ClusteredStore {
    /// Where `scope` stands by `gates`: from its rule's cluster, where the gates lead; then,
    /// every gate being known, what points at the cluster found.
    pub(super) fn stand(&self, scope: &str, gates: &Gates) -> Result<Standing, MoveError> {
        let standing = self.walk(scope, gates)?;
        let Standing::Home { home, mut left } = standing else {
            return Ok(standing);
        };
        // A walk that ends where it began sees nothing of a move *to* the rule's cluster: a
        // source still `leaving` for `home`, whose gate is lifted, is a move switched and not
        // yet recorded (the fence sets the target's gate first, so no other state leaves the
        // two so); one that `left` for `home` may hold rows its cleanup has not deleted yet.
        for (at, gate) in gates.iter().enumerate() {
            match *gate {
                Some((GateState::Leaving, to)) if to == home => {
                    return Ok(Standing::Moving { from: at, to: home });
                }
                Some((GateState::Left, to)) if to == home && !left.contains(&at) => left.push(at),
                _ => {}
            }
        }
        Ok(Standing::Home { home, left })
    }

    /// Where `scope`'s gates lead from its rule's cluster.
    fn walk(&self, scope: &str, gates: &Gates) -> Result<Standing, MoveError> {
        let gate = |at: usize| gates.get(at).copied().flatten();
        let mut at = self.placement.cluster_for(scope);
        let mut left = Vec::new();
        for _ in 0..=self.clusters.len() {
            match gate(at) {
                None => return Ok(Standing::Home { home: at, left }),
                Some((GateState::Left, home)) => {
                    left.push(at);
                    at = home;
                }
                Some((GateState::Leaving, to)) => return Ok(Standing::Moving { from: at, to }),
                Some((GateState::Arriving, from)) => {
                    return match gate(from) {
                        Some((GateState::Leaving, to)) if to == at => {
                            Ok(Standing::Moving { from, to })
                        }
                        // The fence was begun on the target only: the source serves it still.
                        None => Ok(Standing::Home {
                            home: from,
                            left: Vec::new(),
                        }),
                        _ => Err(MoveError::Refused(format!(
                            "the placement gates of namespace {scope} disagree between clusters \
                             {} and {}",
                            self.name_of(at),
                            self.name_of(from)
                        ))),
                    };
                }
            }
        }
        Err(MoveError::Refused(format!(
            "the placement gates of namespace {scope} lead in a circle"
        )))
    }

    /// Where `scope` is served, as an operator asks: every cluster's gate of it, read on each
    /// (within the operation's time), and what they say together. Fails when a cluster cannot
    /// be read (naming it), or when the gates name a cluster this service was not given.
    ///
    /// The clusters are read at once, not in one snapshot, so a move's step between two
    /// clusters' reads could show a state no instant had (the target read before the fence,
    /// the source after it). The gates are read again until two rounds agree: a move's gates
    /// only go forward, so a gate read alike twice held that state between the rounds, and
    /// the clusters' states at that moment are what the second round read.
    pub async fn placement_of(&self, scope: &str) -> Result<PlacementView, MoveError> {
        const ROUNDS: usize = 5;
        let mut read = self.read_gates(scope).await?;
        for _ in 1..ROUNDS {
            let again = self.read_gates(scope).await?;
            let settled = again == read;
            read = again;
            if settled {
                break;
            }
        }
        self.view_of(scope, read)
    }

    /// Every cluster's gate of `scope`, read at once, in the clusters' order.
    async fn read_gates(&self, scope: &str) -> Result<Vec<Option<GateRow>>, MoveError> {
        let read = join_all(
            self.clusters
                .iter()
                .enumerate()
                .map(|(at, cluster)| async move {
                    let gate = match self.usable(at) {
                        Ok(store) => store.placement_gate(scope).await,
                        Err(error) => Err(error),
                    };
                    gate.map_err(|error| in_cluster(&cluster.name, &error))
                }),
        )
        .await;
        Ok(read.into_iter().collect::<Result<_, _>>()?)
    }

    /// What every cluster's gate of `scope` says together.
    fn view_of(&self, scope: &str, read: Vec<Option<GateRow>>) -> Result<PlacementView, MoveError> {
        let mut gates = Vec::with_capacity(read.len());
        let mut indexed = Vec::with_capacity(read.len());
        for (cluster, gate) in self.clusters.iter().zip(read) {
            indexed.push(match &gate {
                Some(gate) => Some((gate.state, self.peer_index(&gate.peer)?)),
                None => None,
            });
            gates.push(ClusterGate {
                cluster: cluster.name.to_string(),
                gate,
            });
        }
        let (served_by, moving) = match self.stand(scope, &indexed)? {
            Standing::Home { home, .. } => (Some(home), None),
            // Switched once the target's gate is lifted; in its cut-over until then.
            Standing::Moving { from, to } => (
                indexed.get(to).copied().flatten().is_none().then_some(to),
                Some((self.name_of(from), self.name_of(to))),
            ),
        };
        Ok(PlacementView {
            rule: self.name_of(self.placement.cluster_for(scope)),
            served_by: served_by.map(|at| self.name_of(at)),
            moving,
            gates,
        })
    }
}

/// One cluster's gate of a scope (none: nothing of a move there).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterGate {
    pub cluster: String,
    pub gate: Option<GateRow>,
}

/// Where a scope is served, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlacementView {
    /// The cluster the `--place` rules (or the default) name.
    pub rule: String,
    /// The cluster that serves it now; none while a move is between its fence and its switch.
    pub served_by: Option<String>,
    /// An unfinished move: the cluster it began from, and the one it goes to.
    pub moving: Option<(String, String)>,
    /// Every cluster's gate, in the clusters' order.
    pub gates: Vec<ClusterGate>,
}
