//! The binary's completion scripts and man pages (`completions`, `man`), made from its clap
//! definitions: docs/operations.md's commands run as written in bash (with a home of the
//! test's own), the completion then completing an admin flag as bash would ask it, the man
//! page of `admin keys list` naming its flags with their help; and the bad inputs, each with
//! its message and exit status.

use crate::support::process::{both_outputs, operator_bash};
use crate::support::written::commands_marked;

const MARK: &str = "<!-- run as written by tests/api/cli_docs.rs -->";

/// Runs `script` in bash with the binary on the PATH and `home` as HOME; its exit status and
/// its output (standard output and error).
fn bash(home: &std::path::Path, script: &str) -> (bool, String) {
    let output = operator_bash(home, script)
        .env("MANPAGER", "cat")
        .env("MANWIDTH", "100")
        .output()
        .expect("bash");
    (output.status.success(), both_outputs(&output))
}

#[test]
fn completions_and_man_pages_work_as_the_guide_shows() {
    let commands = commands_marked("docs/operations.md", MARK);
    assert_eq!(commands.len(), 3, "{commands:#?}");
    let home = tempfile::tempdir().expect("a home folder");
    // The guide's commands in one shell, then what bash asks of the completion when the
    // operator presses Tab after `admin keys list --w`.
    let script = format!(
        "{}\nprintf '\\n=== completion\\n'\n\
         COMP_WORDS=(idempotency-coordinator admin keys list --w); COMP_CWORD=4\n\
         COMP_LINE='idempotency-coordinator admin keys list --w'; COMP_POINT=${{#COMP_LINE}}\n\
         _idempotency__coordinator idempotency-coordinator --w list\n\
         printf '%s\\n' \"${{COMPREPLY[@]}}\"",
        commands.join("\n")
    );
    let (ok, output) = bash(home.path(), &script);
    assert!(ok, "{output}");
    let (page, completion) = output.split_once("\n=== completion\n").expect("both parts");
    assert_eq!(completion.trim(), "--wide", "{completion}");
    // The page of `admin keys list` names its flags with their help text.
    assert!(
        page.contains("idempotency-coordinator-admin-keys-list"),
        "{page}"
    );
    assert!(page.contains("--wide"), "{page}");
    // man justifies and wraps the text: read it with its spaces collapsed.
    let words = page.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        words.contains("--wide Every column in the table (token, each time to the millisecond"),
        "{page}"
    );
    let pages = std::fs::read_dir(home.path().join(".local/share/man/man1"))
        .expect("the pages' folder")
        .count();
    // One page for the binary and one for each command and subcommand.
    assert!(pages >= 17, "{pages} pages");
}

#[test]
fn completions_and_man_refuse_what_they_cannot_do() {
    let home = tempfile::tempdir().expect("a home folder");
    let (ok, output) = bash(
        home.path(),
        "idempotency-coordinator completions tcsh 2>&1 || echo \"exit $?\"",
    );
    assert!(ok, "{output}");
    assert!(
        output.starts_with("error: invalid value 'tcsh' for '<SHELL>'")
            && output.trim_end().ends_with("exit 2"),
        "{output}"
    );
    // A folder that cannot be made: under a file.
    std::fs::write(home.path().join("a-file"), "").expect("a file");
    let (ok, output) = bash(
        home.path(),
        "idempotency-coordinator man --out-dir a-file/man 2>&1 || echo \"exit $?\"",
    );
    assert!(ok, "{output}");
    assert_eq!(
        output.trim_end(),
        "error: cannot write the man pages into a-file/man: Not a directory (os error 20)\nexit 1"
    );
}
