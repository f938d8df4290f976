//! The tokens file: its lines (a caller's name, the SHA-256 of its token, its scopes), read
//! only from a regular file of bounded size, and the generation of new tokens.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

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

/// What a token may do with the admin API (`idempotency.v1.AdminService`), within its scopes:
/// the optional fourth field of its line, `admin=read` or `admin=write`. A line without it
/// (every line written before the admin API existed) grants no admin right.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub enum AdminRight {
    #[default]
    None,
    /// List keys, read a key's record, a namespace's statistics, the audit trail.
    Read,
    /// Read, and release or erase keys and namespaces.
    Write,
}

impl AdminRight {
    /// The fourth field of a tokens file line.
    fn parse_field(field: &str) -> Result<Self, String> {
        match field {
            "admin=read" => Ok(Self::Read),
            "admin=write" => Ok(Self::Write),
            other => Err(format!(
                "the fourth field must be admin=read or admin=write, not {other:?}"
            )),
        }
    }

    /// The fourth field granting this right, if any.
    pub fn field(self) -> Option<&'static str> {
        match self {
            Self::None => None,
            Self::Read => Some("admin=read"),
            Self::Write => Some("admin=write"),
        }
    }
}

/// A caller the tokens file knows.
#[derive(Debug, Clone)]
pub struct Caller {
    pub name: String,
    /// `token:<name>`, shared by every call of this caller (a key's holder, an audit actor).
    pub identity: crate::domain::Holder,
    hash: [u8; 32],
    scopes: Vec<ScopePattern>,
    pub admin: AdminRight,
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
pub(super) const MAX_TOKENS_FILE_BYTES: u64 = 16 * 1024 * 1024;

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
            let (name, hash_field, scopes, admin) = match fields[..] {
                [name, hash, scopes] => (name, hash, scopes, AdminRight::None),
                [name, hash, scopes, admin] => (
                    name,
                    hash,
                    scopes,
                    AdminRight::parse_field(admin).map_err(invalid)?,
                ),
                _ => {
                    return Err(invalid(
                        "expected three fields (name, sha256:<hex>, scopes) and optionally a \
                         fourth (admin=read or admin=write)"
                            .into(),
                    ));
                }
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
                identity: crate::domain::Holder::token(name),
                hash,
                scopes,
                admin,
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

/// The bare names `scopes` leaves out although a pattern seems to mean them: for each prefix
/// pattern whose stem ends in a separator (`payments-*`), the name without it (`payments`),
/// when no other pattern covers it. `payments-*` matches `payments-eu` but not `payments`, and
/// an operator who grants it for the namespace `payments` is refused at every call.
pub fn bare_names_left_out(scopes: &str) -> Result<Vec<(String, String)>, String> {
    let patterns = parse_scopes(scopes)?;
    Ok(patterns
        .iter()
        .filter_map(|pattern| match pattern {
            ScopePattern::Prefix(stem) => {
                let bare = stem.strip_suffix(['-', '_', '.', ':', '/'])?;
                let covered = bare.is_empty() || patterns.iter().any(|other| other.matches(bare));
                (!covered).then(|| (format!("{stem}*"), bare.to_owned()))
            }
            _ => None,
        })
        .collect())
}

/// A new token and the line that grants it `scopes` under `name`, with `admin` over the admin
/// API within those scopes.
pub fn new_token(name: &str, scopes: &str, admin: AdminRight) -> Result<(String, String), String> {
    check_name(name)?;
    parse_scopes(scopes)?;
    let mut secret = [0u8; 32];
    getrandom::fill(&mut secret).map_err(|e| format!("no randomness: {e}"))?;
    let token = format!("{TOKEN_PREFIX}{}", hex::encode(secret));
    let mut line = format!("{name} sha256:{} {scopes}", hex::encode(hash(&token)));
    if let Some(field) = admin.field() {
        line.push(' ');
        line.push_str(field);
    }
    Ok((token, line))
}
