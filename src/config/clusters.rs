//! The flags of a store on several PostgreSQL clusters (`--cluster`, `--place`,
//! `--default-cluster`), checked into a [`StoreLocation::Clusters`]. What a single URL's flags
//! add to it (a notify URL, a pooler in transaction mode, a password file) is refused with
//! them: each would need one value per cluster (docs/scaling.md).

use clap::Args;
use idempotency_settings::SettingError;

use crate::store::StoreLocation;
use crate::store::clusters::placement::{ClusterName, Placement, PlacementRule};

#[derive(Debug, Clone, Args)]
pub struct ClusterArgs {
    /// PostgreSQL clusters that share the namespaces, each NAME=URL: a name of 1-32 characters
    /// of a-z 0-9 _ -, and a URL as --database-url takes it (several hosts, TLS). Repeat the
    /// flag (or separate them with ; in the environment variable), at most 64. Instead of
    /// --database-url; see docs/scaling.md.
    #[arg(
        long = "cluster",
        env = "IDEMPOTENCY_CLUSTERS",
        value_delimiter = ';',
        hide_env_values = true,
        conflicts_with_all = ["database_url", "database_url_file"]
    )]
    pub clusters: Vec<String>,

    /// With --cluster: where a namespace (and the consumer of the same name) is served,
    /// PATTERN=CLUSTER, the pattern a namespace or a prefix followed by * (orders-*=eu). A
    /// namespace's own rule wins over a prefix, a longer prefix over a shorter one. Repeat the
    /// flag (or separate rules with , in the environment variable), at most 1000.
    #[arg(long = "place", env = "IDEMPOTENCY_PLACE", value_delimiter = ',')]
    pub place: Vec<PlacementRule>,

    /// With --cluster: the cluster of every namespace no --place rule names (by default the
    /// first --cluster).
    #[arg(long, env = "IDEMPOTENCY_DEFAULT_CLUSTER")]
    pub default_cluster: Option<ClusterName>,
}

/// A single URL's flags that the clusters refuse, each named, with the words of its refusal.
pub struct SingleUrlFlags {
    pub notify_url: bool,
    pub transaction_pooler: bool,
    pub password_file: bool,
}

impl ClusterArgs {
    /// The clusters and their placement, when `--cluster` is given; `None` otherwise (and then
    /// neither `--place` nor `--default-cluster` may be).
    pub fn location(&self, single: &SingleUrlFlags) -> Result<Option<StoreLocation>, SettingError> {
        if self.clusters.is_empty() {
            let stray = [
                ("place", !self.place.is_empty()),
                ("default-cluster", self.default_cluster.is_some()),
            ];
            if let Some((flag, _)) = stray.into_iter().find(|(_, given)| *given) {
                return Err(SettingError::new(flag, "applies with --cluster only"));
            }
            return Ok(None);
        }
        let refusals = [
            (
                "notify-database-url",
                single.notify_url,
                "applies with --database-url only: with --cluster, the service listens on each \
                 cluster's own URL",
            ),
            (
                "pooler",
                single.transaction_pooler,
                "transaction is not supported with --cluster yet: each cluster would need a \
                 direct URL of its own to listen on; give each cluster's direct URL",
            ),
            (
                "database-password-file",
                single.password_file,
                "applies with --database-url only: with --cluster, give each cluster's password \
                 in its URL, or in a passfile (passfile= in the URL, or PGPASSFILE)",
            ),
        ];
        if let Some((flag, _, problem)) = refusals.into_iter().find(|(_, given, _)| *given) {
            return Err(SettingError::new(flag, problem));
        }
        let urls = self
            .clusters
            .iter()
            .map(|given| cluster_url(given))
            .collect::<Result<Vec<_>, _>>()?;
        let names = urls.iter().map(|(name, _)| name.clone()).collect();
        let placement = Placement::new(names, self.place.clone(), self.default_cluster.clone())
            .map_err(|(flag, problem)| SettingError::new(flag, problem))?;
        Ok(Some(StoreLocation::Clusters { urls, placement }))
    }
}

/// `NAME=URL` into its name and its PostgreSQL URL, checked as --database-url is.
fn cluster_url(given: &str) -> Result<(ClusterName, String), SettingError> {
    let refused = |problem: String| SettingError::new("cluster", problem);
    let (name, url) = given
        .split_once('=')
        .ok_or_else(|| refused("each cluster is NAME=URL (eu=postgres://…)".into()))?;
    let name: ClusterName = name.parse().map_err(refused)?;
    match StoreLocation::from_url(url) {
        Ok(StoreLocation::Postgres { url }) => {
            crate::store::postgres::hosts::HostList::parse(&url)
                .map_err(|problem| refused(format!("cluster {name}: {problem}")))?;
            Ok((name, url))
        }
        _ => Err(refused(format!(
            "cluster {name}: its URL must start with postgres:// (the embedded store cannot \
             be a cluster)"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use crate::config::{Cli, Command};
    use crate::store::StoreLocation;

    /// `serve`'s store settings from `args`: the parse's or the check's refusal, in words.
    fn store(args: &[&str]) -> Result<StoreLocation, String> {
        let cli = Cli::try_parse_from(
            std::iter::once("idempotency-coordinator").chain(args.iter().copied()),
        )
        .map_err(|error| error.to_string())?;
        let Command::Serve(serve) = cli.into_command() else {
            panic!("expected serve");
        };
        serve
            .database
            .store_settings()
            .map(|settings| settings.location)
            .map_err(|error| error.to_string())
    }

    const TWO: &[&str] = &[
        "--cluster",
        "a=postgres://h1/db",
        "--cluster",
        "b=postgres://h2/db?sslmode=require",
    ];

    fn with<'a>(extra: &[&'a str]) -> Vec<&'a str> {
        TWO.iter().copied().chain(extra.iter().copied()).collect()
    }

    #[test]
    fn clusters_and_their_placement_are_read() {
        let Ok(StoreLocation::Clusters { urls, placement }) = store(&with(&[
            "--place",
            "orders-*=b",
            "--place",
            "x=a",
            "--default-cluster",
            "b",
        ])) else {
            panic!("clusters expected");
        };
        assert_eq!(urls.len(), 2);
        assert_eq!(urls[1].1, "postgres://h2/db?sslmode=require");
        assert_eq!(placement.cluster_for("orders-1"), 1);
        assert_eq!(placement.cluster_for("x"), 0);
        assert_eq!(placement.cluster_for("other"), 1);
    }

    #[test]
    fn clusters_from_the_environment_variables_separators() {
        // The separators the environment variables use are clap's value delimiters, the same
        // on the command line: one flag may carry several.
        let Ok(StoreLocation::Clusters { urls, placement }) = store(&[
            "--cluster",
            "a=postgres://h1,h2/db?target_session_attrs=read-write;b=postgres://h3/db",
            "--place",
            "p-*=b,q=b",
        ]) else {
            panic!("clusters expected");
        };
        assert_eq!(
            urls[0].1,
            "postgres://h1,h2/db?target_session_attrs=read-write"
        );
        assert_eq!(placement.cluster_for("q"), 1);
        assert_eq!(placement.cluster_for("p-x"), 1);
    }

    #[test]
    fn each_refusal_names_its_flag_and_cause() {
        let refused = |args: Vec<&str>, words: &[&str]| {
            let refusal = store(&args).expect_err("refused");
            for word in words {
                assert!(refusal.contains(word), "{refusal:?} lacks {word:?}");
            }
        };
        refused(vec!["--place", "x=a"], &["--place", "--cluster only"]);
        refused(
            vec!["--default-cluster", "a"],
            &["--default-cluster", "--cluster only"],
        );
        refused(
            with(&["--database-url", "postgres://h/db"]),
            &["--database-url"],
        );
        refused(
            with(&["--notify-database-url", "postgres://h/db"]),
            &["--notify-database-url", "each cluster"],
        );
        refused(
            with(&["--pooler", "transaction"]),
            &["--pooler", "not supported with --cluster"],
        );
        refused(
            with(&["--database-password-file", "/run/pw"]),
            &["--database-password-file", "passfile"],
        );
        refused(vec!["--cluster", "a"], &["--cluster", "NAME=URL"]);
        refused(
            vec!["--cluster", "A=postgres://h/db"],
            &["--cluster", "a-z 0-9"],
        );
        refused(
            vec!["--cluster", "a=sqlite://x.db"],
            &["--cluster", "cluster a", "postgres://"],
        );
        refused(
            vec!["--cluster", "a=postgres://h:99999/db"],
            &["--cluster", "cluster a"],
        );
        refused(
            with(&["--cluster", "a=postgres://h3/db"]),
            &["--cluster", "named twice"],
        );
        refused(with(&["--place", "x=z"]), &["--place", "cluster z"]);
        refused(
            with(&["--default-cluster", "z"]),
            &["--default-cluster", "cluster z"],
        );
        refused(with(&["--place", "x*y=a"]), &["--place", "x*y"]);
        let many: Vec<String> = (0..=crate::store::clusters::placement::MAX_CLUSTERS)
            .flat_map(|i| ["--cluster".to_owned(), format!("c{i}=postgres://h/db")])
            .collect();
        refused(
            many.iter().map(String::as_str).collect(),
            &["--cluster", "at most 64"],
        );
    }
}
