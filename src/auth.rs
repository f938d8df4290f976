//! Who may call, and for which scopes. No I/O beyond reading the tokens file, and no gRPC: the
//! tower layer in `grpc::auth_layer` asks these questions at the edge.
//!
//! The tokens file has one token per line:
//!
//! ```text
//! # name      hash of the token (64 hex digits, from `token new`)   scopes
//! payments    sha256:<64 hex digits>                                 payments-*,billing
//! ```
//!
//! Scopes are namespaces (for keys) and consumers (for events) alike: an exact name, a prefix
//! ending in `*` (`payments-*`), or `*` for every scope. Only the SHA-256 of a token is stored;
//! `idempotency-coordinator token new` makes a token and prints its line.

use std::collections::HashSet;
use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::domain::Scope;

/// What every generated token starts with, so that leaked tokens are easy to search for.
pub const TOKEN_PREFIX: &str = "idc_";

#[derive(Debug, Clone, PartialEq, Eq)]
enum ScopePattern {
    Any,
    Exact(String),
    Prefix(String),
}

impl ScopePattern {
    fn parse(text: &str) -> Result<Self, String> {
        if text == "*" {
            return Ok(Self::Any);
        }
        let (name, prefix) = match text.strip_suffix('*') {
            Some(stem) => (stem, true),
            None => (text, false),
        };
        // A pattern's fixed part must itself be (the start of) a valid scope.
        Scope::parse(name.to_owned())
            .map_err(|_| format!("scope pattern {text:?} is not a scope name or prefix*"))?;
        Ok(if prefix {
            Self::Prefix(name.to_owned())
        } else {
            Self::Exact(name.to_owned())
        })
    }

    fn matches(&self, scope: &str) -> bool {
        match self {
            Self::Any => true,
            Self::Exact(name) => scope == name,
            Self::Prefix(stem) => scope.starts_with(stem.as_str()),
        }
    }
}

/// A caller the tokens file knows.
#[derive(Debug, Clone)]
pub struct Caller {
    pub name: String,
    hash: [u8; 32],
    scopes: Vec<ScopePattern>,
}

impl Caller {
    /// Whether this caller may use `scope` (a namespace or a consumer).
    pub fn may_use(&self, scope: &str) -> bool {
        self.scopes.iter().any(|pattern| pattern.matches(scope))
    }
}

/// A problem in the tokens file, with its line.
#[derive(Debug, thiserror::Error)]
pub enum TokensFileError {
    #[error("reading {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A FIFO, a device or a folder where the tokens file should be: opening or reading it
    /// could block for ever or never end, so it is refused without reading.
    #[error("{path} is not a regular file (it is {kind}); the tokens file must be one")]
    NotAFile { path: PathBuf, kind: &'static str },
    #[error("{path} is larger than {limit} bytes; it cannot be a tokens file")]
    TooLarge { path: PathBuf, limit: u64 },
    #[error("line {line}: {problem}")]
    Invalid { line: usize, problem: String },
    /// A file without a single token would lock every caller out; it is taken for a file
    /// caught half-written, or a mistake.
    #[error("{path} lists no tokens (write the new file aside, then rename it into place)")]
    Empty { path: PathBuf },
}

/// The callers of one version of the tokens file.
#[derive(Debug, Clone, Default)]
pub struct TokenSet {
    callers: Vec<Caller>,
}

/// Far more than any tokens file needs (a line is about 100 bytes), so that a huge file is
/// refused instead of read into memory.
const MAX_TOKENS_FILE_BYTES: u64 = 16 * 1024 * 1024;

/// Reads `path` (following symlinks) only if it is a regular file. It is opened without
/// blocking (`O_NONBLOCK`, which regular files ignore), so that a FIFO renamed into its place
/// does not wedge the reader until some writer opens it, and the kind is checked on the opened
/// file, so that nothing can be swapped in between the check and the read.
fn read_regular_file(path: &Path) -> Result<String, TokensFileError> {
    use std::io::Read;
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};

    let read_error = |source| TokensFileError::Read {
        path: path.to_owned(),
        source,
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(read_error)?;
    let metadata = file.metadata().map_err(read_error)?;
    let file_type = metadata.file_type();
    if !file_type.is_file() {
        let kind = if file_type.is_fifo() {
            "a FIFO"
        } else if file_type.is_dir() {
            "a folder"
        } else if file_type.is_char_device() || file_type.is_block_device() {
            "a device"
        } else if file_type.is_socket() {
            "a socket"
        } else {
            "not a regular file"
        };
        return Err(TokensFileError::NotAFile {
            path: path.to_owned(),
            kind,
        });
    }
    if metadata.len() > MAX_TOKENS_FILE_BYTES {
        return Err(TokensFileError::TooLarge {
            path: path.to_owned(),
            limit: MAX_TOKENS_FILE_BYTES,
        });
    }
    let mut text = String::new();
    // The file may grow after the check; the limit holds for what is read, too.
    file.take(MAX_TOKENS_FILE_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(read_error)?;
    if text.len() as u64 > MAX_TOKENS_FILE_BYTES {
        return Err(TokensFileError::TooLarge {
            path: path.to_owned(),
            limit: MAX_TOKENS_FILE_BYTES,
        });
    }
    Ok(text)
}

fn hash(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// A SHA-256 hash written as 64 hex digits (either case).
fn from_hex(text: &str) -> Option<[u8; 32]> {
    let mut out = [0u8; 32];
    hex::decode_to_slice(text, &mut out).ok()?;
    Some(out)
}

impl TokenSet {
    pub fn parse(text: &str) -> Result<Self, TokensFileError> {
        let mut callers = Vec::new();
        let mut names = HashSet::new();
        let mut hashes = HashSet::new();
        for (index, raw) in text.lines().enumerate() {
            let line = index + 1;
            let invalid = |problem: String| TokensFileError::Invalid { line, problem };
            let content = raw.split('#').next().unwrap_or("").trim();
            if content.is_empty() {
                continue;
            }
            let fields: Vec<&str> = content.split_whitespace().collect();
            let [name, hash_field, scopes] = fields[..] else {
                return Err(invalid(
                    "expected three fields: name, sha256:<hex>, scopes".into(),
                ));
            };
            if !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
            {
                return Err(invalid(format!(
                    "token name {name:?} is not [A-Za-z0-9._-]+"
                )));
            }
            let hash = hash_field
                .strip_prefix("sha256:")
                .and_then(from_hex)
                .ok_or_else(|| invalid("the hash must be sha256:<64 hex digits>".into()))?;
            let scopes = scopes
                .split(',')
                .map(ScopePattern::parse)
                .collect::<Result<Vec<_>, _>>()
                .map_err(invalid)?;
            if !names.insert(name.to_owned()) {
                return Err(invalid(format!("token name {name:?} appears twice")));
            }
            if !hashes.insert(hash) {
                return Err(invalid("the same token appears twice".into()));
            }
            callers.push(Caller {
                name: name.to_owned(),
                hash,
                scopes,
            });
        }
        Ok(Self { callers })
    }

    /// Reads a tokens file, which must list at least one token. This blocks (it reads a
    /// file): in the service it runs off the async workers, under a timeout (`shutdown`).
    pub fn load(path: &Path) -> Result<Self, TokensFileError> {
        let text = read_regular_file(path)?;
        let tokens = Self::parse(&text)?;
        if tokens.is_empty() {
            return Err(TokensFileError::Empty {
                path: path.to_owned(),
            });
        }
        Ok(tokens)
    }

    pub fn len(&self) -> usize {
        self.callers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.callers.is_empty()
    }

    /// The caller that `presented` belongs to. Every known hash is compared, in constant time,
    /// whatever matches, so that timing tells nothing about which tokens exist.
    pub fn authenticate(&self, presented: &str) -> Option<&Caller> {
        let presented = hash(presented);
        let mut found = None;
        for caller in &self.callers {
            if bool::from(caller.hash.ct_eq(&presented)) {
                found = Some(caller);
            }
        }
        found
    }
}

fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
    {
        return Err(format!("token name {name:?} is not [A-Za-z0-9._-]+"));
    }
    Ok(())
}

fn parse_scopes(scopes: &str) -> Result<Vec<ScopePattern>, String> {
    scopes.split(',').map(ScopePattern::parse).collect()
}

/// A new token and the line that grants it `scopes` under `name`.
pub fn new_token(name: &str, scopes: &str) -> Result<(String, String), String> {
    check_name(name)?;
    parse_scopes(scopes)?;
    let mut secret = [0u8; 32];
    getrandom::fill(&mut secret).map_err(|e| format!("no randomness: {e}"))?;
    let token = format!("{TOKEN_PREFIX}{}", hex::encode(secret));
    let line = format!("{name} sha256:{} {scopes}", hex::encode(hash(&token)));
    Ok((token, line))
}

/// A rate per caller: `rate` requests a second, in bursts of up to `rate`. `governor`'s keyed
/// limiter (GCRA, lock-free) keeps one small state per caller name and says how long a refused
/// caller must wait; states of callers not seen for a while are dropped on each reload.
struct RateLimiter {
    limiter: governor::DefaultKeyedRateLimiter<String>,
}

impl std::fmt::Debug for RateLimiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimiter").finish_non_exhaustive()
    }
}

impl RateLimiter {
    fn new(rate: NonZeroU32) -> Self {
        Self {
            limiter: governor::RateLimiter::keyed(governor::Quota::per_second(rate)),
        }
    }

    /// `Ok` when `caller` may make a call now, else how long until it may.
    fn admit(&self, caller: &str) -> Result<(), Duration> {
        use governor::clock::{Clock, DefaultClock};
        self.limiter
            .check_key(&caller.to_owned())
            .map_err(|not_until| not_until.wait_time_from(DefaultClock::default().now()))
    }

    /// Forgets callers whose state is back to a full burst.
    fn forget_idle(&self) {
        self.limiter.retain_recent();
        self.limiter.shrink_to_fit();
    }
}

/// Why a call was turned away at the door.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// No token, a malformed one, or one the file does not know.
    Unauthenticated,
    /// A known caller asking for a scope it was not given.
    PermissionDenied { caller: String },
    /// A known caller over its request rate, who may call again after `retry_after`.
    RateLimited {
        caller: String,
        retry_after: Duration,
    },
}

/// Why a reload left the tokens in force.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error(transparent)]
    File(#[from] TokensFileError),
    #[error("reading the tokens file did not finish within {timeout:?}")]
    TimedOut { timeout: std::time::Duration },
    #[error("reading the tokens file crashed")]
    Crashed,
}

/// The tokens in force (reloaded on SIGHUP) and the rate limit.
#[derive(Debug)]
pub struct Authenticator {
    path: PathBuf,
    tokens: RwLock<Arc<TokenSet>>,
    rate_limit: Option<RateLimiter>,
}

impl Authenticator {
    pub fn load(path: &Path, rate_limit: Option<u32>) -> Result<Self, TokensFileError> {
        let tokens = TokenSet::load(path)?;
        Ok(Self {
            path: path.to_owned(),
            tokens: RwLock::new(Arc::new(tokens)),
            rate_limit: rate_limit.and_then(NonZeroU32::new).map(RateLimiter::new),
        })
    }

    /// Reads the tokens file again. On any problem the tokens in force stay as they were.
    /// Calls in flight are not affected either way: each was admitted by the set it met.
    /// Blocking: the service calls [`Self::reload_off_workers`].
    pub fn reload(&self) -> Result<usize, TokensFileError> {
        let tokens = TokenSet::load(&self.path)?;
        Ok(self.replace(tokens))
    }

    /// [`Self::reload`] on a blocking thread, within `timeout`. A read that does not finish in
    /// time (a file system that stopped answering) leaves the tokens in force, and its result,
    /// should it come later, is thrown away: an operator told "not reloaded" is not surprised
    /// by a reload minutes after.
    pub async fn reload_off_workers(
        self: &Arc<Self>,
        timeout: std::time::Duration,
    ) -> Result<usize, ReloadError> {
        let path = self.path.clone();
        let reading = tokio::task::spawn_blocking(move || TokenSet::load(&path));
        match tokio::time::timeout(timeout, reading).await {
            Ok(Ok(Ok(tokens))) => Ok(self.replace(tokens)),
            Ok(Ok(Err(error))) => Err(ReloadError::File(error)),
            Ok(Err(_)) => Err(ReloadError::Crashed),
            Err(_) => Err(ReloadError::TimedOut { timeout }),
        }
    }

    fn replace(&self, tokens: TokenSet) -> usize {
        let count = tokens.len();
        if let Some(limiter) = &self.rate_limit {
            limiter.forget_idle();
        }
        *self
            .tokens
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(tokens);
        count
    }

    /// How many tokens are in force now.
    pub fn tokens_loaded(&self) -> usize {
        self.current().len()
    }

    fn current(&self) -> Arc<TokenSet> {
        Arc::clone(
            &self
                .tokens
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    /// Who is calling, from the `authorization` header's value (`Bearer <token>`; the scheme
    /// is case-insensitive, as HTTP has it).
    pub fn authenticate(&self, authorization: Option<&str>) -> Result<Caller, Refusal> {
        let presented = authorization
            .and_then(|value| value.trim().split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim())
            .filter(|token| !token.is_empty())
            .ok_or(Refusal::Unauthenticated)?;
        self.current()
            .authenticate(presented)
            .cloned()
            .ok_or(Refusal::Unauthenticated)
    }

    /// Whether `caller` may make one more call now. Counted before the request is read, so
    /// that every call, refused scopes included, spends the caller's budget.
    pub fn within_rate(&self, caller: &Caller) -> Result<(), Refusal> {
        match &self.rate_limit {
            Some(limiter) => {
                limiter
                    .admit(&caller.name)
                    .map_err(|retry_after| Refusal::RateLimited {
                        caller: caller.name.clone(),
                        retry_after,
                    })
            }
            None => Ok(()),
        }
    }

    /// Whether `caller` was given `scope`.
    pub fn authorize(&self, caller: &Caller, scope: &str) -> Result<(), Refusal> {
        if caller.may_use(scope) {
            Ok(())
        } else {
            Err(Refusal::PermissionDenied {
                caller: caller.name.clone(),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(text: &str) -> TokenSet {
        TokenSet::parse(text).expect("valid tokens file")
    }

    #[test]
    fn generated_tokens_authenticate_through_their_line() {
        let (token, line) = new_token("payments", "payments-*,billing").expect("a token");
        assert!(token.starts_with(TOKEN_PREFIX));
        assert!(
            !line.contains(&token),
            "the line never holds the token itself"
        );
        let tokens = set(&format!("# comment\n\n{line}\n"));
        let caller = tokens.authenticate(&token).expect("known");
        assert_eq!(caller.name, "payments");
        assert!(caller.may_use("payments-eu"));
        assert!(caller.may_use("billing"));
        assert!(!caller.may_use("billing-2"));
        assert!(!caller.may_use("shipping"));
        assert!(tokens.authenticate("idc_wrong").is_none());
    }

    #[test]
    fn a_star_allows_every_scope() {
        let (token, line) = new_token("admin", "*").expect("a token");
        assert!(
            set(&line)
                .authenticate(&token)
                .expect("known")
                .may_use("anything")
        );
    }

    #[test]
    fn malformed_lines_are_refused_with_their_number() {
        for (text, line) in [
            ("a sha256:00 b", 1),
            ("\nname md5:abc scope", 2),
            (
                "only-two sha256:0000000000000000000000000000000000000000000000000000000000000000",
                1,
            ),
            (
                "bad/name sha256:0000000000000000000000000000000000000000000000000000000000000000 s",
                1,
            ),
            (
                "n sha256:0000000000000000000000000000000000000000000000000000000000000000 has*star*",
                1,
            ),
            (
                "n sha256:0000000000000000000000000000000000000000000000000000000000000000 sp ace",
                1,
            ),
        ] {
            match TokenSet::parse(text) {
                Err(TokensFileError::Invalid { line: got, .. }) => assert_eq!(got, line, "{text}"),
                other => panic!("{text:?} gave {other:?}"),
            }
        }
        let twice = "a sha256:0000000000000000000000000000000000000000000000000000000000000000 s\n\
                     a sha256:1111111111111111111111111111111111111111111111111111111111111111 s";
        assert!(TokenSet::parse(twice).is_err(), "a name twice");
    }

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        let (token, line) = new_token("payments", "*").expect("a token");
        let dir = std::env::temp_dir().join(format!("auth-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a folder");
        let path = dir.join("tokens");
        std::fs::write(&path, &line).expect("write");
        let authenticator = Authenticator::load(&path, None).expect("loads");
        for header in [
            format!("Bearer {token}"),
            format!("bearer  {token} "),
            format!("BEARER {token}"),
        ] {
            assert!(
                authenticator.authenticate(Some(&header)).is_ok(),
                "{header}"
            );
        }
        for header in [format!("Basic {token}"), token.clone(), "Bearer".into()] {
            assert!(
                authenticator.authenticate(Some(&header)).is_err(),
                "{header}"
            );
        }
        // An emptied file is refused, and the tokens in force stay.
        std::fs::write(&path, "# nothing here\n").expect("write");
        assert!(matches!(
            authenticator.reload(),
            Err(TokensFileError::Empty { .. })
        ));
        assert!(
            authenticator
                .authenticate(Some(&format!("Bearer {token}")))
                .is_ok()
        );
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn only_a_regular_file_of_at_most_16_mib_is_read_as_a_tokens_file() {
        let (token, line) = new_token("payments", "*").expect("a token");
        let dir = std::env::temp_dir().join(format!("auth-kinds-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a folder");
        let path = dir.join("tokens");
        std::fs::write(&path, &line).expect("write");
        let authenticator = Authenticator::load(&path, None).expect("loads");

        // A folder in its place is refused by kind, without reading.
        std::fs::remove_file(&path).expect("remove");
        std::fs::create_dir(&path).expect("a folder in its place");
        let refused = authenticator.reload().expect_err("a folder");
        assert!(
            matches!(
                refused,
                TokensFileError::NotAFile {
                    kind: "a folder",
                    ..
                }
            ),
            "{refused:?}"
        );
        std::fs::remove_dir(&path).expect("remove the folder");

        // A symlink to a regular file is followed.
        let target = dir.join("tokens.real");
        std::fs::write(&target, &line).expect("write");
        std::os::unix::fs::symlink(&target, &path).expect("symlink");
        assert_eq!(authenticator.reload().expect("through the symlink"), 1);
        std::fs::remove_file(&path).expect("remove the symlink");

        // The size bound: 16 MiB is read, one byte more is refused.
        let file = std::fs::File::create(&path).expect("create");
        std::io::Write::write_all(&mut &file, line.as_bytes()).expect("write");
        file.set_len(MAX_TOKENS_FILE_BYTES).expect("grow");
        // The rest of the file is NUL bytes, which no line parses: refused for its content.
        assert!(matches!(
            authenticator.reload(),
            Err(TokensFileError::Invalid { .. })
        ));
        file.set_len(MAX_TOKENS_FILE_BYTES + 1).expect("grow");
        assert!(matches!(
            authenticator.reload(),
            Err(TokensFileError::TooLarge { .. })
        ));
        // Through every refusal, the tokens in force stayed.
        assert!(
            authenticator
                .authenticate(Some(&format!("Bearer {token}")))
                .is_ok()
        );
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn the_rate_limit_admits_bursts_of_its_rate_then_refuses() {
        let limiter = RateLimiter::new(NonZeroU32::new(3).expect("non-zero"));
        let admitted = (0..10).filter(|_| limiter.admit("a").is_ok()).count();
        assert_eq!(admitted, 3);
        let wait = limiter.admit("a").expect_err("over the rate");
        assert!(
            wait > Duration::ZERO && wait <= Duration::from_millis(334),
            "the real wait for one more call at 3/s: {wait:?}"
        );
        assert!(
            limiter.admit("b").is_ok(),
            "each caller has a budget of its own"
        );
    }
}
