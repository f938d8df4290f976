//! The real binary as a child process (the test kit's [`idempotency_testkit::ServerProcess`]),
//! with the test binary's own build of the coordinator, and panics where the kit answers errors.

use std::time::Duration;

use idempotency_testkit::Binary;

/// The coordinator binary that cargo built for these tests.
pub fn coordinator() -> Binary {
    Binary::at(env!("CARGO_BIN_EXE_idempotency-coordinator"))
}

pub struct ServerProcess(idempotency_testkit::ServerProcess);

impl std::ops::Deref for ServerProcess {
    type Target = idempotency_testkit::ServerProcess;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl From<idempotency_testkit::ServerProcess> for ServerProcess {
    fn from(process: idempotency_testkit::ServerProcess) -> Self {
        Self(process)
    }
}

impl ServerProcess {
    /// The process the kit started, or a panic with the kit's reason why it could not.
    fn started(process: anyhow::Result<idempotency_testkit::ServerProcess>) -> Self {
        Self(process.unwrap_or_else(|error| panic!("start the server binary: {error:#}")))
    }

    /// Starts `idempotency-coordinator serve` on a free port and waits for its address.
    pub async fn start(database_url: &str, flags: &[&str]) -> Self {
        Self::start_with_log_level(database_url, flags, "info").await
    }

    /// Like [`Self::start`], logging at `level` (`RUST_LOG`).
    pub async fn start_with_log_level(database_url: &str, flags: &[&str], level: &str) -> Self {
        Self::started(
            coordinator()
                .serve_logging(database_url, flags, level)
                .await,
        )
    }

    /// Like [`Self::start`], with the process's wall clock skewed by `skew` (libfaketime's
    /// syntax: "-2h").
    pub async fn start_with_clock_skew(database_url: &str, flags: &[&str], skew: &str) -> Self {
        Self::started(
            coordinator()
                .serve_with_clock_skew(database_url, flags, skew)
                .await,
        )
    }

    /// Runs `command` (the coordinator binary with its arguments and environment) as
    /// [`idempotency_testkit::ServerProcess::spawn`] does.
    pub async fn spawn(command: tokio::process::Command, flags: &[&str]) -> Self {
        Self::started(idempotency_testkit::ServerProcess::spawn(command, flags).await)
    }

    /// Starts the binary with no store settings at all, in `directory`, as a newcomer would.
    pub async fn start_embedded_in(directory: &std::path::Path) -> Self {
        Self::start_embedded_in_with(directory, &[]).await
    }

    /// Like [`Self::start_embedded_in`], with extra flags.
    pub async fn start_embedded_in_with(directory: &std::path::Path, flags: &[&str]) -> Self {
        Self::started(coordinator().serve_embedded_in(directory, flags).await)
    }

    /// The process's peak resident memory so far (VmHWM), in KiB.
    pub fn peak_rss_kib(&self) -> u64 {
        self.0.memory_kib("VmHWM").expect("VmHWM")
    }

    /// A client, once the process reports SERVING.
    pub async fn client_when_serving(&self) -> super::Client {
        self.0
            .wait_until_serving()
            .await
            .expect("the binary serves");
        super::Client::connect(self.endpoint())
            .await
            .expect("connect")
    }

    pub fn signal(&self, signal: &str) {
        self.0.signal(signal).expect("signal the process");
    }

    /// Waits for the process to exit and answers its exit code.
    pub async fn wait(&mut self, limit: Duration) -> Option<i32> {
        self.0.wait(limit).await.expect("the process exits")
    }
}

/// The PATH with the folder of this build's binary first, so that a shell finds it as
/// `idempotency-coordinator`.
fn path_with_this_build() -> String {
    let binary = coordinator();
    let folder = binary.path().parent().expect("the binary's folder");
    format!(
        "{}:{}",
        folder.display(),
        std::env::var("PATH").unwrap_or_default()
    )
}

/// `script` in bash as an operator would run it (`set -euo pipefail`), with this build's binary
/// first on the PATH and `home` as HOME and the working folder; the caller adds what else its
/// guide's shell has.
pub fn operator_bash(home: &std::path::Path, script: &str) -> std::process::Command {
    let mut command = std::process::Command::new("bash");
    command
        .args(["-c", &format!("set -euo pipefail\n{script}")])
        .current_dir(home)
        .env("HOME", home)
        .env("PATH", path_with_this_build());
    command
}

/// A guide's command in bash, as an operator pastes it, with this build's binary first on the
/// PATH and `environment` (the variables the guide names) set; arguments added to the command
/// reach it as `"$@"`.
pub fn guide_shell(script: &str, environment: &[(&str, String)]) -> tokio::process::Command {
    let mut command = tokio::process::Command::new("bash");
    command
        .args(["-c", script, "bash"])
        .env("PATH", path_with_this_build())
        .envs(environment.iter().map(|(name, value)| (*name, value)));
    command
}

/// Runs each of a guide's `commands` as [`guide_shell`] does, under `set -euo pipefail`, in
/// order; each must succeed.
pub async fn run_as_written(commands: &[String], environment: &[(&str, String)]) {
    for command in commands {
        let output = guide_shell(&format!("set -euo pipefail\n{command}"), environment)
            .output()
            .await
            .expect("bash");
        assert_succeeded(&output, command);
    }
}

/// The serve command of a guide, started as written with the tests' plumbing after it (a free
/// port, the address file).
pub async fn serve_as_written(serve: &str, environment: &[(&str, String)]) -> ServerProcess {
    assert!(
        serve.starts_with("idempotency-coordinator serve"),
        "{serve}"
    );
    ServerProcess::spawn(
        guide_shell(&format!("exec {serve} \"$@\""), environment),
        &[],
    )
    .await
}

/// Asserts that a command (`what` names it) succeeded, telling all it printed if not.
pub fn assert_succeeded(output: &std::process::Output, what: &str) {
    assert!(output.status.success(), "{what}\n{}", both_outputs(output));
}

/// Asserts that a command that ran to its end failed, and said each of `texts` on its
/// standard output or error (`why`: what saying them shows).
pub fn assert_refused_saying(output: &std::process::Output, texts: &[&str], why: &str) {
    assert!(!output.status.success(), "{output:?}");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    for text in texts {
        assert!(
            stdout.contains(text) || stderr.contains(text),
            "{why}: {text:?} is not in {stdout}{stderr}"
        );
    }
}

/// A command's standard output and error, one after the other.
pub fn both_outputs(output: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}
