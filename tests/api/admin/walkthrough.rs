//! docs/operations.md, "The admin API and its CLI", run as written from a fresh store: the
//! blocks the guide marks as run here are read from the guide itself and each command run by
//! `bash` in order, against a coordinator started with a tokens file that holds only a payment
//! worker's token, with `TOKENS_FILE` and `COORDINATOR` as the guide names them and a home
//! folder of the test's own. A worker's key goes stuck; the on-call operator's token is made,
//! the coordinator reloads its tokens (SIGHUP, as the guide says), the key is found, read,
//! released (and then listed and counted as released, not stuck) and seen in the trail and
//! the counts, and a tenant's namespace is erased after a
//! dry run, its namespace typed again on a terminal (a pseudo-terminal, `script`).

use std::path::Path;
use std::time::Duration;

use idempotency_coordinator::proto::idempotency::v1 as pb;

use super::*;
use crate::support::process::{ServerProcess, both_outputs, operator_bash};
use crate::support::security::*;
use crate::support::written::commands_marked;

const MARK: &str = "<!-- run as written by tests/api/admin/walkthrough.rs -->";
const TENANT: &str = "payments-tenant-42";

/// Output of a bash script: status, standard output and error together.
struct Shell {
    success: bool,
    output: String,
}

/// A shell as the operator's: the binary on the PATH, the guide's variables, `home` as HOME and
/// the working folder.
fn shell(home: &Path, tokens: &Path, server: &ServerProcess) -> impl Fn(&str) -> Shell {
    let (home, tokens, address) = (home.to_owned(), tokens.to_owned(), server.addr.to_string());
    move |script: &str| {
        let output = operator_bash(&home, script)
            .env("SHELL", "/bin/bash")
            .env("TOKENS_FILE", &tokens)
            .env("COORDINATOR", &address)
            .env_remove("IDEMPOTENCY_ADMIN_COORDINATOR")
            .env_remove("IDEMPOTENCY_ADMIN_TOKEN_FILE")
            .output()
            .expect("bash");
        Shell {
            success: output.status.success(),
            output: both_outputs(&output),
        }
    }
}

/// Runs `commands` in order in one shell (an `export` holds for the rest), each must succeed;
/// answers each command's output. `typed` is what the operator types at a terminal: a
/// command given it runs on a pseudo-terminal with it as input.
fn run_in_order(
    run: &impl Fn(&str) -> Shell,
    commands: &[String],
    typed: &[(usize, &str)],
) -> Vec<String> {
    let mut script = String::new();
    for (index, command) in commands.iter().enumerate() {
        script.push_str(&format!("printf '\\n=== %d\\n' {index}\n"));
        match typed.iter().find(|(at, _)| *at == index) {
            Some((_, input)) => script.push_str(&format!(
                "printf '%s\\n' {} | script -qec {} /dev/null\n",
                quoted(input),
                quoted(command)
            )),
            None => script.push_str(&format!("{command}\n")),
        }
    }
    let shell = run(&script);
    assert!(shell.success, "{script}\n{}", shell.output);
    let mut outputs: Vec<String> = shell
        .output
        .split("\n=== ")
        .skip(1)
        .map(|part| {
            part.split_once('\n')
                .map_or("", |(_, rest)| rest)
                .to_owned()
        })
        .collect();
    assert_eq!(outputs.len(), commands.len(), "{}", shell.output);
    outputs
        .iter_mut()
        .for_each(|output| *output = output.replace('\r', ""));
    outputs
}

fn quoted(text: &str) -> String {
    format!("'{}'", text.replace('\'', "'\\''"))
}

async fn the_admin_walkthrough_works_as_written_from_a_fresh_store(backend: Backend) {
    let commands = commands_marked("docs/operations.md", MARK);
    assert_eq!(commands.len(), 3 + 8 + 2, "{commands:#?}");
    // The token's block, then the rest in one shell, as pasted into one terminal (the
    // incident's `export` holds for the erasure).
    let (token_block, rest) = commands.split_at(3);

    let (worker, worker_line) = token("payments", "payments,payments-*");
    let tokens = TokensFile::new(&[&worker_line]);
    let database = TestDatabase::create(backend).await;
    let server = tokens.serve_binary(&database).await;
    let home = tempfile::tempdir().expect("a home folder");
    let run = shell(home.path(), &tokens.path, &server);

    // The worker claims a key and dies; a tenant has keys and processed events.
    let mut client = authed_client(server.endpoint(), Bearer::token(&worker)).await;
    client
        .try_start(
            try_start("order-1042")
                .in_namespace("payments".into())
                .with_lease(millis(SHORT_LEASE_MS)),
        )
        .await
        .expect("the worker claims");
    for key in ["a", "b", "c"] {
        let started = client
            .try_start(try_start(key).in_namespace(TENANT.into()))
            .await
            .expect("claimed");
        let token = expect_started(started.into_inner()).lease_token;
        client
            .complete(pb::CompleteRequest {
                namespace: TENANT.into(),
                ..complete(key, token, b"r")
            })
            .await
            .expect("completed");
    }
    client
        .mark_processed(mark(TENANT, &["e1", "e2"]))
        .await
        .expect("events marked");

    // The on-call token, as the guide makes it; then SIGHUP.
    let made = run_in_order(&run, token_block, &[]);
    assert!(!made[0].contains("note:"), "{}", made[0]);
    let token_file = home.path().join(".oncall-token");
    let oncall = std::fs::read_to_string(&token_file).expect("the token file");
    assert!(oncall.starts_with("idc_"), "{oncall}");
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&token_file)
            .expect("stat")
            .permissions()
            .mode();
        assert_eq!(
            mode & 0o077,
            0,
            "only its owner may read the token: {mode:o}"
        );
    }
    assert!(!home.path().join("oncall.txt").exists());
    server.signal("HUP");
    let admin = authed_admin(server.endpoint(), Bearer::token(oncall.trim())).await;
    eventually(
        Duration::from_secs(10),
        "the reload admits the token",
        || {
            let mut admin = admin.clone();
            async move {
                admin
                    .list_keys(pb::ListKeysRequest {
                        namespace: "payments".into(),
                        state: pb::AdminKeyState::Stuck.into(),
                        ..Default::default()
                    })
                    .await
                    .is_ok_and(|answer| answer.into_inner().keys.len() == 1)
            }
        },
    )
    .await;

    let seen = run_in_order(&run, rest, &[(9, TENANT)]);
    let [
        _,
        stuck,
        claimed_before,
        story,
        released,
        listed_released,
        trail,
        stats,
        dry_run,
        erased,
    ] = &seen[..]
    else {
        panic!("{seen:#?}");
    };
    assert!(stuck.starts_with("KEY"), "{stuck}");
    assert!(
        stuck.contains("order-1042")
            && stuck.contains("token:payments")
            && stuck.contains("1 keys"),
        "{stuck}"
    );
    // Claimed now, after the guide's 03:00 of 2026-12-04: not held since before it.
    assert!(claimed_before.contains("0 keys"), "{claimed_before}");
    assert!(story.contains("order-1042"), "{story}");
    assert!(released.starts_with("released order-1042"), "{released}");
    assert!(
        released.contains("the next claim takes it over"),
        "{released}"
    );
    // Released, and so no longer stuck: listed as released, counted as released.
    assert!(
        listed_released
            .lines()
            .any(|line| line.starts_with("order-1042") && line.contains(" released ")),
        "{listed_released}"
    );
    assert!(
        trail.contains("force_release")
            && trail.contains("token:oncall")
            && trail.contains("worker pod crashed, INC-4711"),
        "{trail}"
    );
    assert!(
        stats.contains("NAMESPACE")
            && stats.contains("payments")
            && stats.contains("\nstuck             0\n")
            && stats.contains("\nreleased          1\n"),
        "{stats}"
    );

    assert!(
        dry_run.contains(&format!(
            "would erase namespace {TENANT}: 3 keys, 2 processed events; nothing erased"
        )),
        "{dry_run}"
    );
    assert!(
        erased.contains(&format!(
            "This erases namespace {TENANT} for good: 3 keys, 2 processed events."
        )) && erased.contains("Type the namespace to erase it: ")
            && erased.contains(&format!(
                "erased namespace {TENANT}: 3 keys, 2 processed events; audit event"
            )),
        "{erased}"
    );
    let left = admin
        .clone()
        .namespace_stats(pb::NamespaceStatsRequest {
            namespace: TENANT.into(),
        })
        .await
        .expect("stats")
        .into_inner();
    assert_eq!(
        (left.completed_keys, left.processed_events),
        (0, 0),
        "{left:?}"
    );
}

/// The walkthrough's first trap: `payments-*` alone does not cover `payments`. `token new`
/// makes the token anyway (it may be what was meant) and says so on standard error.
#[tokio::test]
async fn token_new_says_when_a_prefix_leaves_out_its_bare_name() {
    let token_new = |scopes: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_idempotency-coordinator"))
            .args(["token", "new", "--name", "oncall", "--scopes", scopes])
            .args(["--admin", "write"])
            .output()
            .expect("run the binary")
    };
    let narrow = token_new("payments-*");
    assert!(narrow.status.success());
    assert_eq!(
        String::from_utf8_lossy(&narrow.stderr),
        "note: --scopes payments-* does not cover \"payments\" itself, only names that start \
         with \"payments-\"; to cover both: --scopes 'payments,payments-*'\n"
    );
    let stdout = String::from_utf8_lossy(&narrow.stdout);
    assert!(
        stdout
            .lines()
            .nth(1)
            .is_some_and(|token| token.starts_with("idc_"))
    );
    let both = token_new("payments,payments-*");
    assert!(both.status.success() && both.stderr.is_empty());
    let bad = token_new("pay ments-*");
    assert_eq!(bad.status.code(), Some(1));
    // The binary's error line (its log, on standard output or error as the log goes).
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&bad.stdout),
        String::from_utf8_lossy(&bad.stderr)
    );
    assert!(
        said.contains("pay ments-*") && said.contains("is not a scope name or prefix*"),
        "{said}"
    );
}

for_each_backend!(the_admin_walkthrough_works_as_written_from_a_fresh_store,);
