//! Where each scope is served, once a move has taken it off the cluster its rule names: what the
//! clusters' gates said (`migrations/postgres/20261207000001_placement_gates.sql`), learned
//! from their refusals, laid over the placement of the flags. A call refused by a
//! gate is asked again where the gate points; while its scope is in a move's cut-over (served by
//! neither cluster) it waits, up to half the operation's timeout, and is then answered
//! UNAVAILABLE, nothing written.
//!
//! The gates are the truth, checked by each cluster at each statement: what is learned here only
//! saves a refusal, and a replica that learned nothing (restarted, or paused for any time) is
//! refused and asks again.

use std::collections::HashMap;
use std::sync::RwLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::{ClusteredStore, PgStore};
use crate::domain::batch::{Batchable, Round};
use crate::store::{Gate, GateState, StoreError};

/// How long a call refused by a scope in cut-over waits before asking again.
const CUT_OVER_POLL: Duration = Duration::from_millis(20);

/// The scopes whose cluster is not the one their rule names.
#[derive(Debug, Default)]
pub(super) struct Routes {
    moved: RwLock<HashMap<String, usize>>,
    /// Whether `moved` has ever had an entry: until then, no call takes its lock.
    any: AtomicBool,
}

impl Routes {
    fn get(&self, scope: &str) -> Option<usize> {
        if !self.any.load(Ordering::Acquire) {
            return None;
        }
        self.moved
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(scope)
            .copied()
    }

    fn set(&self, scope: &str, cluster: Option<usize>) {
        let mut moved = self
            .moved
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match cluster {
            Some(cluster) => {
                moved.insert(scope.to_owned(), cluster);
                self.any.store(true, Ordering::Release);
            }
            None => {
                moved.remove(scope);
            }
        }
    }
}

/// A call's progress through gates' refusals: how many `left` records it followed for each
/// scope, and until when it may wait for a cut-over to end.
#[derive(Debug, Default)]
pub(super) struct Detour {
    hops: Vec<(String, usize)>,
    cut_over_ends: Option<tokio::time::Instant>,
}

/// `$store.$method($args)` on the cluster that serves `$scope`, asked again where a gate points
/// (a macro, not a method taking a closure: the trait's futures must be `Send`, which an async
/// closure's borrow of its arguments cannot yet promise).
macro_rules! on_home {
    ($store:ident, $scope:expr, $method:ident($($arg:expr),*)) => {{
        let scope: &str = $scope;
        let mut detour = $crate::store::clusters::routes::Detour::default();
        loop {
            let at = $store.cluster_of(scope);
            let error = match $store.usable(at)?.$method($($arg),*).await {
                Err(error) => error,
                answer => break answer,
            };
            match error.placed() {
                Some(gate) => $store.follow(&gate.clone(), &mut detour).await?,
                None => break Err(error),
            }
        }
    }};
}
pub(super) use on_home;

impl ClusteredStore {
    /// The index of the cluster that serves `scope`, as far as this replica knows.
    pub fn cluster_of(&self, scope: &str) -> usize {
        self.routes
            .get(scope)
            .unwrap_or_else(|| self.placement.cluster_for(scope))
    }

    /// The index of the cluster named `name`.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.clusters.iter().position(|c| c.name.as_str() == name)
    }

    /// Records that `scope` is served by cluster `at`.
    pub(super) fn settle(&self, scope: &str, at: usize) {
        let by_rule = self.placement.cluster_for(scope);
        self.routes.set(scope, (at != by_rule).then_some(at));
    }

    /// Takes in `gate`'s refusal: the route it points to is learned. A scope in a move's
    /// cut-over is asked of the other cluster in turn (the source says `leaving` and points to
    /// the target, the target `arriving` and points back), pausing a moment at each `arriving`,
    /// until one serves it (the switch, or a rollback) or the call may wait no longer: its
    /// refusal then (UNAVAILABLE, nothing written). Refused too when `left` records lead in a
    /// circle.
    pub(super) async fn follow(&self, gate: &Gate, detour: &mut Detour) -> Result<(), StoreError> {
        let Some(peer) = self.index_of(&gate.peer) else {
            return Err(StoreError::Unready(format!(
                "{gate}, which this service was not given (--cluster): give every replica \
                 every cluster"
            )));
        };
        self.settle(&gate.scope, peer);
        if gate.state == GateState::Left {
            let at = match detour
                .hops
                .iter()
                .position(|(scope, _)| *scope == gate.scope)
            {
                Some(at) => at,
                None => {
                    detour.hops.push((gate.scope.clone(), 0));
                    detour.hops.len() - 1
                }
            };
            detour.hops[at].1 += 1;
            if detour.hops[at].1 > self.clusters.len() + 1 {
                return Err(StoreError::Inconsistent(
                    "the clusters' placement gates lead in a circle",
                ));
            }
            return Ok(());
        }
        let ends = *detour
            .cut_over_ends
            .get_or_insert_with(|| tokio::time::Instant::now() + self.cut_over_wait);
        let now = tokio::time::Instant::now();
        if now >= ends {
            return Err(StoreError::Placed(gate.clone()));
        }
        if gate.state == GateState::Arriving {
            tokio::time::sleep(CUT_OVER_POLL.min(ends - now)).await;
        }
        Ok(())
    }

    /// The answers of a round whose parts ran (`answers`), with the commands a gate refused
    /// run again where it points, until none is refused that a gate sends elsewhere. A command
    /// whose namespace is in a move's cut-over keeps its refusal: the coordinator runs it on its
    /// own, where it waits (`on_home!`), so that the round's other calls are not held with it.
    pub(super) async fn rerouted<C, T, F, Fut>(
        &self,
        round: &Round<C>,
        scope: impl Fn(&C) -> &str + Copy,
        mut answers: Vec<Result<T, StoreError>>,
        run: F,
    ) -> Vec<Result<T, StoreError>>
    where
        C: Batchable + Clone,
        F: Fn(PgStore, Round<C>) -> Fut + Copy,
        Fut: Future<Output = Vec<Result<T, StoreError>>>,
    {
        let mut detour = Detour::default();
        loop {
            let mut refused = Vec::new();
            let mut redirects: Vec<Gate> = Vec::new();
            for (position, answer) in answers.iter().enumerate() {
                let Err(error) = answer else { continue };
                let Some(gate) = error.placed() else { continue };
                refused.push(position);
                if gate.state != GateState::Arriving && !redirects.contains(gate) {
                    redirects.push(gate.clone());
                }
            }
            if redirects.is_empty() {
                return answers;
            }
            for gate in &redirects {
                if let Err(error) = self.follow(gate, &mut detour).await {
                    let shared = error.for_each_of(refused.len());
                    for (position, error) in refused.into_iter().zip(shared) {
                        answers[position] = Err(error);
                    }
                    return answers;
                }
            }
            let commands = round.as_slice();
            let again = Round::new(refused.iter().map(|&p| commands[p].clone()).collect());
            let Ok(again) = again else {
                return answers;
            };
            let retried = self.split(&again, scope, run).await;
            for (position, answer) in refused.into_iter().zip(retried) {
                answers[position] = answer;
            }
        }
    }
}
