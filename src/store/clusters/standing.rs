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
    /// Where `scope` stands by `gates`, from its rule's cluster.
    pub(super) fn stand(&self, scope: &str, gates: &Gates) -> Result<Standing, MoveError> {
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
    pub async fn placement_of(&self, scope: &str) -> Result<PlacementView, MoveError> {
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
        let mut gates = Vec::with_capacity(read.len());
        let mut indexed = Vec::with_capacity(read.len());
        for (cluster, gate) in self.clusters.iter().zip(read) {
            let gate = gate?;
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
