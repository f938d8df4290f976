//! No root certificates: the same interface as crates.io's `webpki-roots`, with an empty list
//! (see this crate's README.md for why the workspace patches it in).

/// The public roots this build trusts without being told: none.
pub const TLS_SERVER_ROOTS: &[pki_types::TrustAnchor<'static>] = &[];

#[cfg(test)]
mod tests {
    #[test]
    fn no_root_is_trusted_unless_named() {
        assert!(super::TLS_SERVER_ROOTS.is_empty());
    }
}
