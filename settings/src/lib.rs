//! What a setting is, for every binary of the workspace: the coordinator (`src/config`) and its
//! HTTP gateway (`gateway/src/config`), which must never depend on the coordinator's crate.
//!
//! A setting is a flag with an environment variable. clap parses it (durations with
//! [`parse_duration`]); the binary's config module then checks it once, against [`Bounds`],
//! and refuses a value out of them with a [`SettingError`] that names the flag. The bounds that
//! the contract sets on the API's durations ([`WAIT`], [`LEASE_TTL`], [`KEY_RETENTION`],
//! [`EVENT_RETENTION`]) live here too, so that the service's validation of every call and both
//! binaries' flags cannot disagree about them. So does the reading of the files flags name (a
//! CA, a token file: [`read_file`], [`read_token_file`]), so that a client of the coordinator
//! refuses the same file in the same words whichever binary it is.

use std::fmt;
use std::path::Path;
use std::time::Duration;

/// A duration's inclusive bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Bounds {
    pub min: Duration,
    pub max: Duration,
}

const SECOND: Duration = Duration::from_secs(1);
const HOUR_SECS: u64 = 3600;
const DAY_SECS: u64 = 24 * HOUR_SECS;

/// How long a TryStart may wait for the key's holder: 0 (answer at once) to 60 s.
pub const WAIT: Bounds = Bounds::new(Duration::ZERO, Duration::from_secs(60));
/// How long a claim holds a key: 100 ms to 24 h.
pub const LEASE_TTL: Bounds =
    Bounds::new(Duration::from_millis(100), Duration::from_secs(DAY_SECS));
/// How long a key is kept: 1 s to 30 d.
pub const KEY_RETENTION: Bounds = Bounds::new(SECOND, Duration::from_secs(30 * DAY_SECS));
/// How long a processed event is remembered: 1 s to 30 d.
pub const EVENT_RETENTION: Bounds = Bounds::new(SECOND, Duration::from_secs(30 * DAY_SECS));

impl Bounds {
    pub const fn new(min: Duration, max: Duration) -> Self {
        Self { min, max }
    }

    pub fn contains(self, value: Duration) -> bool {
        (self.min..=self.max).contains(&value)
    }

    /// `value`, or the problem with it: "must be between 100ms and 24h (got 50ms)".
    pub fn check(self, value: Duration) -> Result<Duration, String> {
        if self.contains(value) {
            Ok(value)
        } else {
            Err(format!("{} (got {})", self.range(), human_duration(value)))
        }
    }

    /// The setting `flag` set to `value`, or the error that names it.
    pub fn check_setting(
        self,
        flag: &'static str,
        value: Duration,
    ) -> Result<Duration, SettingError> {
        self.check(value)
            .map_err(|problem| SettingError::new(flag, problem))
    }

    /// "must be between 100ms and 24h": the problem with a value that is not even a duration.
    pub fn range(self) -> String {
        format!(
            "must be between {} and {}",
            human_duration(self.min),
            human_duration(self.max)
        )
    }
}

/// A duration as people write it in flags and docs: `100ms`, `30s`, `24h`, `30d`.
pub fn human_duration(value: Duration) -> String {
    let secs = value.as_secs();
    if value.subsec_nanos() != 0 || secs == 0 {
        return humantime::format_duration(value).to_string();
    }
    if secs.is_multiple_of(DAY_SECS) && secs >= 2 * DAY_SECS {
        format!("{}d", secs / DAY_SECS)
    } else if secs.is_multiple_of(HOUR_SECS) {
        format!("{}h", secs / HOUR_SECS)
    } else if secs.is_multiple_of(60) {
        format!("{}m", secs / 60)
    } else {
        format!("{secs}s")
    }
}

/// clap's parser for a duration flag: `500ms`, `30s`, `24h`, `7d`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text).map_err(|e| format!("{e} (examples: 100ms, 30s, 24h, 7d)"))
}

/// A setting that is out of bounds or does not make sense with the others, named by its flag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SettingError {
    /// The flag, without its dashes (`lease-ttl`).
    pub flag: &'static str,
    pub problem: String,
}

impl SettingError {
    pub fn new(flag: &'static str, problem: impl Into<String>) -> Self {
        Self {
            flag,
            problem: problem.into(),
        }
    }
}

impl fmt::Display for SettingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "--{}: {}", self.flag, self.problem)
    }
}

impl std::error::Error for SettingError {}

/// The content of the file that the setting `flag` names, read at start, or the error that
/// names the flag and the file: "--coordinator-ca: cannot read ca.pem: …".
pub fn read_file(flag: &'static str, path: &Path) -> Result<Vec<u8>, SettingError> {
    std::fs::read(path).map_err(|error| cannot_read(flag, path, &error))
}

/// The bearer token in the file that the setting `flag` names (`--token-file`): its one line,
/// surrounding whitespace aside (a file written by `echo` ends in a line break), refused
/// when there is no token or it is not printable ASCII, which no header could carry.
pub fn read_token_file(flag: &'static str, path: &Path) -> Result<String, SettingError> {
    let text = std::fs::read_to_string(path).map_err(|error| cannot_read(flag, path, &error))?;
    let token = text.trim();
    if token.is_empty() || !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(SettingError::new(
            flag,
            format!("{} must hold one token of printable ASCII", path.display()),
        ));
    }
    Ok(token.to_owned())
}

fn cannot_read(flag: &'static str, path: &Path, error: &std::io::Error) -> SettingError {
    SettingError::new(flag, format!("cannot read {}: {error}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_people_write_them() {
        assert_eq!(human_duration(Duration::from_millis(100)), "100ms");
        assert_eq!(human_duration(SECOND), "1s");
        assert_eq!(human_duration(Duration::from_secs(90)), "90s");
        assert_eq!(human_duration(Duration::from_secs(DAY_SECS)), "24h");
        assert_eq!(human_duration(Duration::from_secs(30 * DAY_SECS)), "30d");
        assert_eq!(human_duration(Duration::ZERO), "0s");
    }

    #[test]
    fn bounds_are_inclusive_and_name_the_value_refused() {
        assert_eq!(
            LEASE_TTL.check(Duration::from_millis(100)),
            Ok(Duration::from_millis(100))
        );
        assert_eq!(
            LEASE_TTL.check(Duration::from_secs(DAY_SECS)),
            Ok(Duration::from_secs(DAY_SECS))
        );
        assert_eq!(
            LEASE_TTL.check(Duration::from_millis(99)),
            Err("must be between 100ms and 24h (got 99ms)".to_owned())
        );
        let error = WAIT
            .check_setting("wait", Duration::from_secs(61))
            .expect_err("past the bound");
        assert_eq!(
            error.to_string(),
            "--wait: must be between 0s and 1m (got 61s)"
        );
    }

    #[test]
    fn a_token_file_holds_one_printable_token_and_a_file_not_read_is_named() {
        let path = std::env::temp_dir().join(format!("settings-token-{}", std::process::id()));
        std::fs::write(&path, "  s3cret-token\n").expect("written");
        assert_eq!(
            read_token_file("token-file", &path),
            Ok("s3cret-token".to_owned())
        );
        for bad in ["\n", "two words"] {
            std::fs::write(&path, bad).expect("written");
            let error = read_token_file("token-file", &path).expect_err(bad);
            assert_eq!(
                error.to_string(),
                format!(
                    "--token-file: {} must hold one token of printable ASCII",
                    path.display()
                )
            );
        }
        std::fs::remove_file(&path).expect("removed");
        let error = read_file("coordinator-ca", &path).expect_err("no such file");
        assert_eq!(error.flag, "coordinator-ca");
        assert!(
            error
                .problem
                .starts_with(&format!("cannot read {}: ", path.display())),
            "{error}"
        );
    }

    #[test]
    fn a_duration_flag_that_is_not_one_says_how_to_write_one() {
        assert_eq!(parse_duration("1500ms"), Ok(Duration::from_millis(1500)));
        let problem = parse_duration("soon").expect_err("not a duration");
        assert!(problem.contains("examples: 100ms"), "{problem}");
    }
}
