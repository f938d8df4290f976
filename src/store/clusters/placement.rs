//! Which cluster serves a scope: a namespace's keys and the events of the consumer of the same
//! name live together, so that everything a name owns (and an erasure of it) is on one cluster.
//! Rules name a scope exactly, or a prefix of it (`orders-*`); an exact rule wins over any
//! prefix, and a longer prefix over a shorter one; a scope no rule names goes to the default
//! cluster. Pure: no I/O, decided once per call.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

use crate::domain::Scope;

/// At most this many clusters: each is a pool, a listener, a heartbeat and a probe per replica.
pub const MAX_CLUSTERS: usize = 64;

/// At most this many rules: a prefix rule is tried in turn for each call.
pub const MAX_RULES: usize = 1000;

/// A cluster's name, as flags, logs and the `cluster` label of metrics give it: 1-32 characters
/// of `a-z 0-9 _ -`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ClusterName(String);

impl ClusterName {
    pub const MAX_CHARS: usize = 32;

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for ClusterName {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let allowed =
            |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '_' | '-');
        if text.is_empty() || text.len() > Self::MAX_CHARS || !text.chars().all(allowed) {
            return Err(format!(
                "cluster name {text:?}: must be 1-32 characters of a-z 0-9 _ -"
            ));
        }
        Ok(Self(text.to_owned()))
    }
}

impl fmt::Display for ClusterName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The scopes a rule names.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Pattern {
    /// This scope only.
    Exact(String),
    /// Every scope that starts with this (which may be empty: every scope).
    Prefix(String),
}

/// `PATTERN=CLUSTER` (`--place`): a scope, or a prefix followed by `*`, and the cluster that
/// serves it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlacementRule {
    pub pattern: Pattern,
    pub cluster: ClusterName,
}

impl FromStr for PlacementRule {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let (pattern, cluster) = text.rsplit_once('=').ok_or_else(|| {
            format!("{text:?}: a rule is PATTERN=CLUSTER (a namespace, or a prefix followed by *)")
        })?;
        let pattern = match pattern.strip_suffix('*') {
            Some("") => Pattern::Prefix(String::new()),
            Some(prefix) => Pattern::Prefix(scope_text(prefix, text)?),
            None => Pattern::Exact(scope_text(pattern, text)?),
        };
        Ok(Self {
            pattern,
            cluster: cluster.parse()?,
        })
    }
}

/// `text` as a scope (or the start of one), else why not, naming the rule.
fn scope_text(text: &str, rule: &str) -> Result<String, String> {
    Scope::parse(text.to_owned())
        .map(|scope| scope.as_str().to_owned())
        .map_err(|invalid| format!("{rule:?}: the namespace {text:?} {}", invalid.0))
}

/// The clusters, and which one serves each scope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    names: Vec<ClusterName>,
    exact: HashMap<String, usize>,
    /// Longest first: the first that matches wins.
    prefixes: Vec<(String, usize)>,
    default: usize,
}

impl Placement {
    /// `names` in the order the flags gave them; `default` (else the first cluster) serves what
    /// no rule names. Refuses a repeated cluster or pattern, a rule or default naming no
    /// cluster, and more clusters or rules than the bounds, naming the flag at fault
    /// (`cluster`, `place`, `default-cluster`) and why.
    pub fn new(
        names: Vec<ClusterName>,
        rules: Vec<PlacementRule>,
        default: Option<ClusterName>,
    ) -> Result<Self, (&'static str, String)> {
        if names.is_empty() {
            return Err(("cluster", "no cluster is named".into()));
        }
        if names.len() > MAX_CLUSTERS {
            let problem = format!("{} clusters: at most {MAX_CLUSTERS}", names.len());
            return Err(("cluster", problem));
        }
        if rules.len() > MAX_RULES {
            return Err((
                "place",
                format!("{} rules: at most {MAX_RULES}", rules.len()),
            ));
        }
        let mut index = HashMap::new();
        for (at, name) in names.iter().enumerate() {
            if index.insert(name.clone(), at).is_some() {
                return Err(("cluster", format!("the cluster {name} is named twice")));
            }
        }
        let find = |name: &ClusterName, flag: &'static str| {
            index.get(name).copied().ok_or_else(|| {
                let problem = format!("names the cluster {name}, which no --cluster gives");
                (flag, problem)
            })
        };
        let default = match &default {
            Some(name) => find(name, "default-cluster")?,
            None => 0,
        };
        let mut exact = HashMap::new();
        let mut prefixes: Vec<(String, usize)> = Vec::new();
        for rule in &rules {
            let cluster = find(&rule.cluster, "place")?;
            let repeated = match &rule.pattern {
                Pattern::Exact(scope) => exact.insert(scope.clone(), cluster).is_some(),
                Pattern::Prefix(prefix) => {
                    let seen = prefixes.iter().any(|(known, _)| known == prefix);
                    prefixes.push((prefix.clone(), cluster));
                    seen
                }
            };
            if repeated {
                return Err(("place", format!("two rules name {:?}", rule.pattern)));
            }
        }
        prefixes.sort_by_key(|(prefix, _)| std::cmp::Reverse(prefix.len()));
        Ok(Self {
            names,
            exact,
            prefixes,
            default,
        })
    }

    /// The index (in [`Placement::names`]) of the cluster that serves `scope`.
    pub fn cluster_for(&self, scope: &str) -> usize {
        if let Some(&cluster) = self.exact.get(scope) {
            return cluster;
        }
        self.prefixes
            .iter()
            .find(|(prefix, _)| scope.starts_with(prefix.as_str()))
            .map_or(self.default, |&(_, cluster)| cluster)
    }

    pub fn names(&self) -> &[ClusterName] {
        &self.names
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(list: &[&str]) -> Vec<ClusterName> {
        list.iter()
            .map(|name| name.parse().expect("a name"))
            .collect()
    }

    fn rules(list: &[&str]) -> Vec<PlacementRule> {
        list.iter()
            .map(|rule| rule.parse().expect("a rule"))
            .collect()
    }

    #[test]
    fn exact_beats_prefix_and_longer_prefix_beats_shorter() {
        let placement = Placement::new(
            names(&["a", "b", "c"]),
            rules(&["orders-*=b", "orders-eu-*=c", "orders-eu-1=a"]),
            None,
        )
        .expect("a placement");
        let served = |scope| {
            placement.names()[placement.cluster_for(scope)]
                .as_str()
                .to_owned()
        };
        assert_eq!(served("orders-us"), "b");
        assert_eq!(served("orders-eu-2"), "c");
        assert_eq!(served("orders-eu-1"), "a");
        assert_eq!(served("payments"), "a");
    }

    #[test]
    fn the_default_serves_what_no_rule_names() {
        let placement = Placement::new(
            names(&["a", "b"]),
            rules(&["x=a"]),
            Some("b".parse().expect("b")),
        )
        .expect("a placement");
        assert_eq!(placement.cluster_for("anything"), 1);
        assert_eq!(placement.cluster_for("x"), 0);
    }

    #[test]
    fn an_empty_prefix_takes_every_scope_no_exact_rule_names() {
        let placement =
            Placement::new(names(&["a", "b"]), rules(&["*=b", "x=a"]), None).expect("a placement");
        assert_eq!(placement.cluster_for("y"), 1);
        assert_eq!(placement.cluster_for("x"), 0);
    }

    #[test]
    fn bad_rules_and_names_are_refused_with_their_cause() {
        let refused =
            |names: Vec<ClusterName>, rules: Vec<PlacementRule>, default: Option<&str>| {
                let (flag, problem) =
                    Placement::new(names, rules, default.map(|d| d.parse().expect("a name")))
                        .expect_err("refused");
                format!("--{flag}: {problem}")
            };
        assert!(refused(names(&["a", "a"]), vec![], None).contains("--cluster: the cluster a"));
        assert!(
            refused(names(&["a"]), rules(&["x=b"]), None).contains("--place: names the cluster b")
        );
        assert!(refused(names(&["a"]), vec![], Some("z")).contains("--default-cluster: names"));
        assert!(
            refused(names(&["a"]), rules(&["x=a", "x=a"]), None).contains("--place: two rules")
        );
        assert!(
            refused(names(&["a"]), rules(&["p*=a", "p*=a"]), None).contains("--place: two rules")
        );
        assert!(refused(vec![], vec![], None).contains("--cluster: no cluster"));
        let many: Vec<ClusterName> = (0..=MAX_CLUSTERS)
            .map(|i| format!("c{i}").parse().expect("a name"))
            .collect();
        assert!(refused(many, vec![], None).contains("--cluster: 65 clusters: at most 64"));
        let many: Vec<PlacementRule> = (0..=MAX_RULES)
            .map(|i| format!("n{i}=a").parse().expect("a rule"))
            .collect();
        assert!(refused(names(&["a"]), many, None).contains("--place: 1001 rules: at most 1000"));
    }

    #[test]
    fn rule_and_name_syntax() {
        for bad in ["x", "=a", "x=", "a b=c", "x=A", "x*y=a", "x=a*"] {
            assert!(bad.parse::<PlacementRule>().is_err(), "{bad} was taken");
        }
        let long = "c".repeat(ClusterName::MAX_CHARS + 1);
        assert!(long.parse::<ClusterName>().is_err());
        assert!(
            "c".repeat(ClusterName::MAX_CHARS)
                .parse::<ClusterName>()
                .is_ok()
        );
        assert_eq!(
            "a:b.c-*=x_1"
                .parse::<PlacementRule>()
                .expect("a rule")
                .pattern,
            Pattern::Prefix("a:b.c-".into())
        );
    }
}
