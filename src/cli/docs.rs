//! The binary's own documentation, made from the same clap definitions as its `--help`, so that
//! it cannot drift from the flags: `completions <shell>` (a completion script, by
//! `clap_complete`) and `man` (man pages, by `clap_mangen`). Both crates are clap's own
//! companions, maintained with it in the clap repository: they read the `Command` that clap
//! builds from the derive definitions, every flag, subcommand, value list and help text
//! included, where a hand-written script or page would need changing with every flag.

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;

use clap::CommandFactory;

use crate::config::Cli;

/// Prints the completion script for `shell` on standard output (exit 1, saying why, when it
/// cannot be written).
pub fn completions(shell: clap_complete::Shell) -> ExitCode {
    let mut command = Cli::command();
    let name = command.get_name().to_owned();
    // Made in memory first: clap_complete panics on a failed write (a closed pipe), and a
    // failure here is to be said, not a crash.
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut command, name.clone(), &mut script);
    if shell == clap_complete::Shell::Bash {
        script = bash_cases_named_alike(&script, &name);
    }
    match std::io::stdout().write_all(&script) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: cannot write the completion script: {error}");
            ExitCode::FAILURE
        }
    }
}

/// clap_complete 4.6's bash script, for a binary whose name has a hyphen, selects a
/// subcommand's case by the name's hyphen as `__` (`idempotency__coordinator__subcmd__admin`)
/// but labels the case with it as `__subcmd__` (`idempotency__subcmd__coordinator__…`): no
/// subcommand's flags would complete. The labels are renamed to what selects them (the
/// root's own case, named without `__subcmd__`, is right already).
fn bash_cases_named_alike(script: &[u8], name: &str) -> Vec<u8> {
    String::from_utf8_lossy(script)
        .replace(&name.replace('-', "__subcmd__"), &name.replace('-', "__"))
        .into_bytes()
}

/// Prints the top man page on standard output or, given `out_dir`, writes one page for the
/// binary and one for each of its commands into it (made if missing). Exit 1, saying why, when
/// a page cannot be written.
pub fn man(out_dir: Option<&Path>) -> ExitCode {
    let command = Cli::command();
    let written = match out_dir {
        None => clap_mangen::Man::new(command).render(&mut std::io::stdout()),
        Some(folder) => {
            std::fs::create_dir_all(folder).and_then(|()| clap_mangen::generate_to(command, folder))
        }
    };
    match (written, out_dir) {
        (Ok(()), _) => ExitCode::SUCCESS,
        (Err(error), Some(folder)) => {
            eprintln!(
                "error: cannot write the man pages into {}: {error}",
                folder.display()
            );
            ExitCode::FAILURE
        }
        (Err(error), None) => {
            eprintln!("error: cannot write the man page: {error}");
            ExitCode::FAILURE
        }
    }
}
