use std::time::Duration;

use super::*;
use crate::store::{Pooler, StoreLocation};

const MIB: u64 = 1024 * 1024;

fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
    Cli::try_parse_from(
        [
            "idempotency-coordinator",
            "--database-url",
            "postgres://x/y",
        ]
        .iter()
        .chain(args),
    )
}

/// `serve`'s flags from a parsed command line: `serve` named, or run by default.
fn serve_of(cli: Cli) -> Box<ServeArgs> {
    let Command::Serve(serve) = cli.into_command() else {
        panic!("expected serve");
    };
    serve
}

/// The environment variable `serve`'s flag `id` is declared with (read by clap at parse time).
fn declared_env(id: &str) -> Option<String> {
    <ServeArgs as clap::Args>::augment_args(clap::Command::new("t"))
        .get_arguments()
        .find(|a| a.get_id() == id)
        .and_then(|a| a.get_env())
        .map(|v| v.to_string_lossy().into_owned())
}

#[test]
fn serve_is_the_default_and_defaults_match_the_contract() {
    let settings = serve_of(parse(&[]).expect("parses"))
        .settings()
        .expect("valid defaults");
    assert_eq!(settings.listen.to_string(), "127.0.0.1:50051");
    assert_eq!(
        settings.limits.default_lease_ttl.get(),
        Duration::from_secs(30)
    );
    assert_eq!(
        settings.limits.default_key_retention.get(),
        Duration::from_secs(24 * 3600)
    );
    assert_eq!(
        settings.limits.default_event_retention.get(),
        Duration::from_secs(7 * 24 * 3600)
    );
    assert_eq!(settings.limits.max_response_bytes, 1024 * 1024);
    assert_eq!(settings.shutdown_grace, Duration::from_secs(25));
    assert!(settings.readiness.migrate);
}

#[test]
fn flags_work_with_and_without_the_serve_subcommand() {
    for args in [
        vec![
            "x",
            "serve",
            "--database-url",
            "postgres://a/b",
            "--pool-size",
            "3",
        ],
        vec!["x", "--database-url", "postgres://a/b", "--pool-size", "3"],
    ] {
        let serve = serve_of(Cli::try_parse_from(args).expect("parses"));
        assert_eq!(serve.database.pool_size, 3);
    }
    let migrate = Cli::try_parse_from(["x", "migrate", "--database-url", "postgres://a/b"])
        .expect("parses")
        .into_command();
    assert!(matches!(migrate, Command::Migrate(_)));
}

#[test]
fn the_url_scheme_selects_the_store() {
    let settings = |args: &[&str]| serve_of(Cli::try_parse_from(args).expect("parses")).settings();
    let embedded = settings(&["x"]).expect("valid");
    assert_eq!(
        embedded.store.location,
        StoreLocation::Sqlite {
            path: "./data/coordinator.db".into()
        }
    );
    let custom = settings(&["x", "--sqlite-path", "/tmp/c.db"]).expect("valid");
    assert_eq!(
        custom.store.location,
        StoreLocation::Sqlite {
            path: "/tmp/c.db".into()
        }
    );
    let sqlite = settings(&["x", "--database-url", "sqlite:///var/lib/c.db"]).expect("valid");
    assert_eq!(
        sqlite.store.location,
        StoreLocation::Sqlite {
            path: "/var/lib/c.db".into()
        }
    );
    for url in ["postgres://u@h/d", "postgresql://u@h/d"] {
        let postgres = settings(&["x", "--database-url", url]).expect("valid");
        assert!(matches!(
            postgres.store.location,
            StoreLocation::Postgres { .. }
        ));
    }
    let error = settings(&["x", "--database-url", "mysql://u@h/d"]).expect_err("refused");
    assert_eq!(error.flag, "database-url");
    assert!(error.problem.contains("postgres://"), "{}", error.problem);
    for refused in ["sqlite://", "sqlite://:memory:", "sqlite://./c.db?mode=rwc"] {
        let error = settings(&["x", "--database-url", refused]).expect_err(refused);
        assert_eq!(error.flag, "database-url");
    }
}

#[test]
fn a_non_loopback_address_needs_tokens_mtls_or_a_deliberate_flag() {
    let settings = parsed_serve_settings;
    let error = settings(&["--listen", "0.0.0.0:50051"]).expect_err("refused");
    assert_eq!(error.flag, "allow-unauthenticated");
    assert!(error.to_string().contains("--allow-unauthenticated"));
    for allowed in [
        &["--listen", "0.0.0.0:50051", "--tokens-file", "t"][..],
        &["--listen", "0.0.0.0:50051", "--allow-unauthenticated"][..],
        &[
            "--listen",
            "[::]:50051",
            "--tls-cert",
            "c",
            "--tls-key",
            "k",
            "--tls-client-ca",
            "ca",
        ][..],
        &["--listen", "[::1]:50051"][..],
    ] {
        settings(allowed).unwrap_or_else(|e| panic!("{allowed:?}: {e}"));
    }
    // TLS without client certificates does not authenticate callers.
    let error = settings(&["--listen", "0.0.0.0:1", "--tls-cert", "c", "--tls-key", "k"])
        .expect_err("refused");
    assert_eq!(error.flag, "allow-unauthenticated");
}

#[test]
fn security_flags_come_in_sensible_combinations() {
    let settings = parsed_serve_settings;
    assert_eq!(
        settings(&["--tls-cert", "c"]).expect_err("no key").flag,
        "tls-cert"
    );
    assert_eq!(
        settings(&["--tls-client-ca", "ca"])
            .expect_err("no cert")
            .flag,
        "tls-client-ca"
    );
    assert_eq!(
        settings(&["--rate-limit", "10"])
            .expect_err("no tokens")
            .flag,
        "rate-limit"
    );
    let ok = settings(&["--tokens-file", "t", "--rate-limit", "10"]).expect("valid");
    assert_eq!(ok.security.rate_limit, Some(10));
    assert_eq!(ok.security.max_concurrent_streams, 256);
}

#[test]
fn defaults_outside_the_contract_bounds_are_refused() {
    let error = parsed_serve_settings(&["--default-lease-ttl", "25h"])
        .expect_err("25h is above the lease bound");
    assert_eq!(error.flag, "default-lease-ttl");
    assert!(parse(&["--max-response-bytes", "262143"]).is_err());
    assert!(parse(&["--max-response-bytes", "262144"]).is_ok());
    assert!(parse(&["--reaper-interval", "soon"]).is_err());
}

/// `serve`'s settings from `args`, which must parse.
fn parsed_serve_settings(args: &[&str]) -> Result<Settings, SettingError> {
    serve_of(parse(args).expect("parses")).settings()
}

fn serve_settings(args: &[&str]) -> Result<Settings, String> {
    let cli = parse(args).map_err(|e| e.to_string())?;
    serve_of(cli).settings().map_err(|e| e.to_string())
}

#[test]
fn connection_limits_have_defaults_and_bounds() {
    let defaults = serve_settings(&[]).expect("valid defaults").connections;
    assert_eq!(defaults.handshake_timeout, Duration::from_secs(10));
    assert_eq!(defaults.idle_timeout, Duration::from_secs(300));
    assert_eq!(defaults.max_connections, None);
    assert_eq!(defaults.response_send_timeout, Duration::from_secs(30));
    assert_eq!(defaults.max_pending_response_bytes, 256 * MIB);
    assert_eq!(defaults.max_connection_pending_response_bytes, 32 * MIB);
    assert_eq!(defaults.max_health_watchers, 1000);
    let audit = serve_settings(&[]).expect("valid defaults").audit_retention;
    assert_eq!(audit, Duration::from_secs(90 * 24 * 3600));

    let durations = [
        ("--audit-retention", "1h", "59m", "3650d", "3651d"),
        ("--health-check-interval", "100ms", "99ms", "1m", "61s"),
        ("--reaper-interval", "10ms", "9ms", "1h", "3601s"),
        ("--operation-timeout", "100ms", "99ms", "10m", "601s"),
        (
            "--connection-handshake-timeout",
            "100ms",
            "99ms",
            "5m",
            "301s",
        ),
        ("--connection-idle-timeout", "1s", "999ms", "24h", "86401s"),
        ("--response-send-timeout", "1s", "999ms", "1h", "3601s"),
    ];
    for (flag, low, below, high, above) in durations {
        assert_bounded(&[], flag, [low, high], [below, above]);
    }
    // The server-wide pending bytes at their floor take the per-connection ones down with
    // them (those may not exceed these), so that only the server-wide bound is tested; the
    // per-connection ones reach up to the server-wide default.
    let per_connection_floor = ["--max-connection-pending-response-bytes", "1048576"];
    let counts: [(&[&str], &str, u64, u64); 4] = [
        (&[], "--max-health-watchers", 1, 100_000),
        (&[], "--max-connections", 1, 1_000_000),
        (
            &per_connection_floor,
            "--max-pending-response-bytes",
            MIB,
            64 * 1024 * MIB,
        ),
        (
            &[],
            "--max-connection-pending-response-bytes",
            MIB,
            256 * MIB,
        ),
    ];
    for (with, flag, low, high) in counts {
        let [low, below, high, above] = [low, low - 1, high, high + 1].map(|n| n.to_string());
        assert_bounded(with, flag, [&low, &high], [&below, &above]);
    }
}

/// Each bound of `flag` (given after `with`): the values at them are taken, those just past
/// them refused, naming the flag.
fn assert_bounded(with: &[&str], flag: &str, at: [&str; 2], past: [&str; 2]) {
    for accepted in at {
        serve_settings(&[with, &[flag, accepted]].concat())
            .unwrap_or_else(|e| panic!("{flag} {accepted}: {e}"));
    }
    for refused in past {
        let error = serve_settings(&[with, &[flag, refused]].concat()).expect_err(refused);
        assert!(error.contains(flag), "{flag} {refused}: {error}");
    }
}

#[test]
fn pooler_transaction_needs_a_direct_notify_url_no_migrate_and_postgresql() {
    let direct = ["--notify-database-url", "postgres://direct/y"];
    let settings =
        serve_settings(&[&["--pooler", "transaction", "--no-migrate"][..], &direct].concat())
            .expect("transaction with a notify URL and --no-migrate");
    assert_eq!(settings.store.pooler, Pooler::Transaction);
    assert_eq!(
        serve_settings(&[]).expect("defaults").store.pooler,
        Pooler::None
    );

    let without_notify = serve_settings(&["--pooler", "transaction", "--no-migrate"])
        .expect_err("LISTEN needs a direct connection");
    assert!(
        without_notify.contains("--notify-database-url"),
        "{without_notify}"
    );
    let migrating = serve_settings(&[&["--pooler", "transaction"][..], &direct].concat())
        .expect_err("migrating through the pooler");
    assert!(migrating.contains("--no-migrate"), "{migrating}");
    assert!(
        parse(&["--pooler", "session"]).is_err(),
        "only none and transaction"
    );

    let Command::Migrate(migrate) = Cli::try_parse_from([
        "idempotency-coordinator",
        "migrate",
        "--database-url",
        "postgres://x/y",
        "--pooler",
        "transaction",
    ])
    .expect("parses")
    .into_command() else {
        panic!("expected migrate");
    };
    let refused = migrate
        .store_settings()
        .expect_err("migrate through the pooler");
    assert!(refused.to_string().contains("directly"), "{refused}");
}

#[test]
fn pooler_is_refused_for_the_embedded_store_and_read_from_its_variable() {
    let serve = serve_of(
        Cli::try_parse_from([
            "idempotency-coordinator",
            "--database-url",
            "sqlite://x.db",
            "--pooler",
            "transaction",
            "--no-migrate",
        ])
        .expect("parses"),
    );
    let error = serve.settings().expect_err("SQLite has no pooler");
    assert!(error.to_string().contains("pooler"), "{error}");
    // The variable is declared on the flag (read by clap at parse time).
    assert_eq!(
        declared_env("pooler").as_deref(),
        Some("IDEMPOTENCY_POOLER")
    );
}

#[test]
fn the_replay_cache_has_a_default_bounds_and_its_variable() {
    let default = serve_settings(&[]).expect("valid defaults");
    assert_eq!(default.replay_cache_bytes, 24 * MIB);
    // 0 turns it off; the largest bound is taken, one byte more refused naming the flag.
    let flag = "--replay-cache-bytes";
    for (accepted, bytes) in [("0", 0), ("68719476736", 64 * 1024 * MIB)] {
        let settings = serve_settings(&[flag, accepted]).expect(accepted);
        assert_eq!(settings.replay_cache_bytes, bytes);
    }
    for refused in ["68719476737", "-1", "lots"] {
        let error = serve_settings(&[&format!("{flag}={refused}")]).expect_err(refused);
        assert!(error.contains(flag), "{refused}: {error}");
    }
    assert_eq!(
        declared_env("replay_cache_bytes").as_deref(),
        Some("IDEMPOTENCY_REPLAY_CACHE_BYTES")
    );
}

#[test]
fn several_postgres_hosts_are_checked_at_start_by_flag() {
    let many = "postgres://u@h1:5432,h2:5433/db?target_session_attrs=read-write";
    let settings = serve_settings(&["--database-url", many]).expect("a libpq multi-host URL");
    assert_eq!(
        settings.store.location,
        StoreLocation::Postgres { url: many.into() }
    );
    let no_attrs = serve_settings(&["--database-url", "postgres://h1,h2/db"])
        .expect_err("several hosts without a writable target");
    assert!(no_attrs.contains("--database-url"), "{no_attrs}");
    assert!(
        no_attrs.contains("target_session_attrs=read-write"),
        "{no_attrs}"
    );
    let bad_port = serve_settings(&[
        "--database-url",
        "postgres://h1:5432,h2:0/db?target_session_attrs=primary",
    ])
    .expect_err("port 0");
    assert!(bad_port.contains("host 2 of 2"), "{bad_port}");
    let notify = serve_settings(&[
        "--notify-database-url",
        "postgres://h1,h2/db?target_session_attrs=standby",
    ])
    .expect_err("a standby cannot LISTEN for changes");
    assert!(notify.contains("--notify-database-url"), "{notify}");
}

#[test]
fn require_synchronous_standby_is_for_postgresql_only() {
    let settings = serve_settings(&["--require-synchronous-standby"]).expect("PostgreSQL");
    assert!(settings.store.require_synchronous_standby);
    assert!(
        !serve_settings(&[])
            .expect("defaults")
            .store
            .require_synchronous_standby
    );
    let sqlite = Cli::try_parse_from([
        "idempotency-coordinator",
        "--database-url",
        "sqlite:///tmp/x.db",
        "--require-synchronous-standby",
    ])
    .expect("parses");
    let refused = serve_of(sqlite)
        .settings()
        .expect_err("no standby to require")
        .to_string();
    assert!(
        refused.contains("--require-synchronous-standby"),
        "{refused}"
    );
}

#[test]
fn postgresql_needs_room_for_held_keys_in_the_pool_and_behind_the_pooler() {
    let settings = serve_settings(&["--pool-size", "4"]).expect("the smallest pool");
    assert_eq!(settings.store.concurrent_statements, 4);
    for small in ["1", "3"] {
        let error = serve_settings(&["--pool-size", small]).expect_err(small);
        assert!(
            error.contains("--pool-size") && error.contains("at least 4"),
            "{small}: {error}"
        );
    }
    // SQLite's pool is its readers: one is enough.
    let sqlite = Cli::try_parse_from(["x", "--pool-size", "1"]).expect("parses");
    serve_of(sqlite).settings().expect("SQLite with one reader");

    let pooled = ["--pooler", "transaction", "--no-migrate"];
    let direct = ["--notify-database-url", "postgres://direct/y"];
    let by_default = serve_settings(&[&pooled[..], &direct].concat()).expect("pooled");
    assert_eq!(
        by_default.store.concurrent_statements, 16,
        "the pool (16), under PgBouncer's default_pool_size (20)"
    );
    let four =
        serve_settings(&[&pooled[..], &direct, &["--pooler-server-connections", "4"]].concat())
            .expect("four server connections");
    assert_eq!(four.store.concurrent_statements, 4);
    let three =
        serve_settings(&[&pooled[..], &direct, &["--pooler-server-connections", "3"]].concat())
            .expect_err("three server connections");
    assert!(
        three.contains("--pooler-server-connections") && three.contains("at least 4"),
        "{three}"
    );
    let without_pooler = serve_settings(&["--pooler-server-connections", "8"])
        .expect_err("without --pooler transaction");
    assert!(
        without_pooler.contains("--pooler-server-connections")
            && without_pooler.contains("--pooler transaction"),
        "{without_pooler}"
    );
    for out_of_range in ["0", "10001"] {
        assert!(
            parse(&["--pooler-server-connections", out_of_range]).is_err(),
            "{out_of_range}"
        );
    }
}

/// Every flag and argument of every command has help text, and every command that runs
/// something shows an example in its help: `--help`, the man pages and the completions are all
/// made from these definitions.
#[test]
fn every_flag_has_help_and_every_command_an_example() {
    use clap::CommandFactory;
    fn walk(command: &clap::Command, path: &str, missing: &mut Vec<String>) {
        for arg in command.get_arguments() {
            let id = arg.get_id().as_str();
            if matches!(id, "help" | "version") {
                continue;
            }
            if arg.get_help().is_none() && arg.get_long_help().is_none() {
                missing.push(format!("{path} --{id}: no help"));
            }
        }
        let runs = command.get_subcommands().next().is_none();
        if runs && command.get_name() != "help" {
            let example = command
                .get_after_help()
                .map(|text| text.to_string())
                .unwrap_or_default();
            if !example.contains("Example") {
                missing.push(format!("{path}: no example"));
            }
        }
        for sub in command.get_subcommands() {
            walk(sub, &format!("{path} {}", sub.get_name()), missing);
        }
    }
    let mut missing = Vec::new();
    walk(&Cli::command(), "idempotency-coordinator", &mut missing);
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}
