//! The placement gate's refusal (`migrations/postgres/20261207000001_placement_gates.sql`): a
//! cluster that does not serve a namespace any more, or not yet, says so in place of running a
//! statement on its rows, and names the cluster to ask instead; and a gate as stored, for an
//! operator's look.

use crate::domain::Instant;

/// Where a refused scope stands on the cluster that refused it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateState {
    /// A move here from `peer` has begun and has not switched: not served here yet.
    Arriving,
    /// A move from here to `peer` has begun and has not switched: not served here any more.
    Leaving,
    /// The scope lives on `peer`.
    Left,
}

impl GateState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Arriving => "arriving",
            Self::Leaving => "leaving",
            Self::Left => "left",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "arriving" => Some(Self::Arriving),
            "leaving" => Some(Self::Leaving),
            "left" => Some(Self::Left),
            _ => None,
        }
    }
}

/// A cluster's refusal of a statement on `scope`: nothing was read or written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gate {
    pub scope: String,
    pub state: GateState,
    /// The cluster the refusing one names (its name in `--cluster`).
    pub peer: String,
}

impl Gate {
    /// The refusal's DETAIL as the gate function writes it: state, peer and scope, separated by
    /// U+001F.
    pub fn from_detail(detail: &str) -> Option<Self> {
        let mut fields = detail.splitn(3, '\u{1f}');
        let state = GateState::parse(fields.next()?)?;
        let peer = fields.next()?.to_owned();
        let scope = fields.next()?.to_owned();
        Some(Self { scope, state, peer })
    }
}

impl std::fmt::Display for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let relation = match self.state {
            GateState::Arriving => "is arriving from",
            GateState::Leaving => "is leaving for",
            GateState::Left => "lives on",
        };
        write!(
            f,
            "namespace {} {relation} cluster {}",
            self.scope, self.peer
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_detail_names_state_peer_and_scope() {
        let gate = Gate::from_detail("leaving\u{1f}b\u{1f}pay\u{1f}ments").expect("parsed");
        assert_eq!(gate.state, GateState::Leaving);
        assert_eq!(gate.peer, "b");
        assert_eq!(gate.scope, "pay\u{1f}ments");
        assert!(Gate::from_detail("gone\u{1f}b\u{1f}x").is_none());
        assert!(Gate::from_detail("left").is_none());
    }
}

/// A scope's gate on one cluster, as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GateRow {
    pub state: GateState,
    /// The other cluster of the move, by its name in `--cluster`.
    pub peer: String,
    /// When the gate took its state, by that cluster's clock.
    pub since: Instant,
}
