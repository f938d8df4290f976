//! Who may call, and for which scopes. No I/O beyond reading the tokens file, and no gRPC: the
//! tower layer in `grpc::auth_layer` asks these questions at the edge.
//!
//! The tokens file has one token per line:
//!
//! ```text
//! # name      hash of the token (64 hex digits, from `token new`)   scopes              admin
//! payments    sha256:<64 hex digits>                                 payments-*,billing
//! oncall      sha256:<64 hex digits>                                 payments-*          admin=write
//! ```
//!
//! The fourth field is optional: `admin=read` lets the token read the admin API
//! (`idempotency.v1.AdminService`) and `admin=write` also change keys through it, in both cases
//! only within the token's scopes. Without it a token has no admin right.
//!
//! Scopes are namespaces (for keys) and consumers (for events) alike: an exact name, a prefix
//! ending in `*` (`payments-*`), or `*` for every scope. Only the SHA-256 of a token is stored;
//! `idempotency-coordinator token new` makes a token and prints its line.

mod rate;
#[cfg(test)]
mod tests;
mod tokens;

use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rate::RateLimiter;
pub use tokens::{
    AdminRight, Caller, TOKEN_PREFIX, TokenSet, TokensFileError, bare_names_left_out, new_token,
};

/// Why a call was turned away at the door.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// No token, a malformed one, or one the file does not know.
    Unauthenticated,
    /// A known caller asking for what it was not given: why, in `denial`.
    PermissionDenied { caller: String, denial: Denial },
    /// A known caller over its request rate, who may call again after `retry_after`.
    RateLimited {
        caller: String,
        retry_after: Duration,
    },
}

/// What a known caller lacks for the call it made: each a reason of its own, so that an operator
/// knows which of the token's grants to change. None names anything but the caller's own token
/// and the scope it asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Denial {
    /// The token's scopes do not cover this namespace or consumer.
    Scope { scope: String },
    /// An admin call from a token without an admin right.
    NoAdminRight,
    /// A change through the admin API (`method`) from a token whose admin right is `read`.
    ReadOnly { method: String },
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

    /// Whether `caller` may make an admin call that needs `needed` in `scope`: it must have
    /// been given the scope and at least that admin right.
    /// `method` names the call in a refusal for want of `write`. Judged in this order: an admin
    /// right at all, the scope, then `write` for a change, so that the first refusal names the
    /// first thing to fix.
    pub fn authorize_admin(
        &self,
        caller: &Caller,
        scope: &str,
        needed: AdminRight,
        method: &str,
    ) -> Result<(), Refusal> {
        let denied = |denial| {
            Err(Refusal::PermissionDenied {
                caller: caller.name.clone(),
                denial,
            })
        };
        if caller.admin == AdminRight::None || needed == AdminRight::None {
            return denied(Denial::NoAdminRight);
        }
        self.authorize(caller, scope)?;
        if caller.admin < needed {
            return denied(Denial::ReadOnly {
                method: method.to_owned(),
            });
        }
        Ok(())
    }

    /// Whether `caller` was given `scope`.
    pub fn authorize(&self, caller: &Caller, scope: &str) -> Result<(), Refusal> {
        if caller.may_use(scope) {
            Ok(())
        } else {
            Err(Refusal::PermissionDenied {
                caller: caller.name.clone(),
                denial: Denial::Scope {
                    scope: scope.to_owned(),
                },
            })
        }
    }
}
