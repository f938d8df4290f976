//! How a key is named apart from the command that carries it: for batches, which compare keys
//! across namespaces, and for change notifications, which must not reveal the key.

use super::{Key, Scope};

/// A key's identity as change notifications carry it: the SHA-256 of namespace, U+001F and key,
/// in lowercase hex (the PostgreSQL store computes the same in SQL). It names the key without
/// revealing it to whoever can read notifications.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KeyHash(String);

impl KeyHash {
    pub fn of(namespace: &Scope, key: &Key) -> Self {
        use sha2::{Digest, Sha256};
        let mut hasher = Sha256::new();
        hasher.update(namespace.as_str().as_bytes());
        hasher.update([0x1f]);
        hasher.update(key.as_str().as_bytes());
        Self(hex::encode(hasher.finalize()))
    }

    /// A hash received from elsewhere (a notification), if it is one.
    pub fn from_hex(text: &str) -> Option<Self> {
        let is_hash = text.len() == 64
            && text
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        is_hash.then(|| Self(text.to_owned()))
    }
}

/// A key's identity across namespaces, owned: what batches compare and look keys up by.
pub fn key_id(namespace: &Scope, key: &Key) -> (String, String) {
    (namespace.as_str().to_owned(), key.as_str().to_owned())
}
