//! `idempotency-coordinator token new`: a new caller's token, printed once for the caller, and
//! the line for the tokens file (the token's SHA-256, never the token).

use crate::auth;
use crate::config::AdminArg;

/// Prints a new token named `name` for `scopes` with the admin right `admin`, and its line.
pub fn new(name: &str, scopes: &str, admin: Option<AdminArg>) -> Result<(), String> {
    let admin = match admin {
        None => auth::AdminRight::None,
        Some(AdminArg::Read) => auth::AdminRight::Read,
        Some(AdminArg::Write) => auth::AdminRight::Write,
    };
    let (token, line) = auth::new_token(name, scopes, admin)?;
    // Said, not refused: a token for `payments-*` alone may be what was meant.
    for (pattern, bare) in auth::bare_names_left_out(scopes)? {
        eprintln!(
            "note: --scopes {pattern} does not cover {bare:?} itself, only names that start \
             with {:?}; to cover both: --scopes '{bare},{pattern}'",
            pattern.trim_end_matches('*')
        );
    }
    println!("# The token, for the caller only (it is not stored anywhere):");
    println!("{token}");
    println!("# The line to add to the tokens file:");
    println!("{line}");
    Ok(())
}
