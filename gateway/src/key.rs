//! The idempotency key of a request: read from its header, scoped to the caller's identity, and
//! the request's fingerprint.

use hyper::HeaderMap;
use hyper::header::{CONTENT_TYPE, HeaderName};
use sha2::{Digest, Sha256};

/// Why a request's key header cannot be used (each is a 400).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyError {
    /// No key header at all.
    Missing,
    /// The header appears more than once.
    Repeated,
    /// Empty, longer than allowed, or neither an sf-string nor a bare token.
    Malformed(String),
}

/// Reads the key from `header`: an RFC 8941 sf-string (`"abc"`, parameters ignored), an
/// sf-token, or, for the many clients that send one, a bare value of token characters plus `:`
/// `/` `=` (a UUID, base64). At most `max_length` bytes, never empty.
pub fn read_key(
    headers: &HeaderMap,
    header: &HeaderName,
    max_length: usize,
) -> Result<String, KeyError> {
    let mut values = headers.get_all(header).iter();
    let Some(value) = values.next() else {
        return Err(KeyError::Missing);
    };
    if values.next().is_some() {
        return Err(KeyError::Repeated);
    }
    let raw = value.as_bytes();
    let key = match sfv::Parser::new(raw).parse_item::<sfv::Item>() {
        Ok(item) => match &item.bare_item {
            sfv::BareItem::String(text) => Some(text.as_str().to_owned()),
            sfv::BareItem::Token(token) => Some(token.as_str().to_owned()),
            _ => None,
        },
        Err(_) => None,
    };
    let key = match key {
        Some(key) => key,
        None => bare_key(raw).ok_or_else(|| {
            KeyError::Malformed(
                "the key must be a quoted string (\"...\") or a bare token".to_owned(),
            )
        })?,
    };
    if key.is_empty() {
        return Err(KeyError::Malformed("the key is empty".into()));
    }
    if key.len() > max_length {
        return Err(KeyError::Malformed(format!(
            "the key is longer than {max_length} bytes"
        )));
    }
    Ok(key)
}

/// A bare (unquoted) key: RFC 9110 token characters, plus `:` `/` `=`, surrounding spaces
/// ignored.
fn bare_key(raw: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(raw).ok()?.trim_matches([' ', '\t']);
    let is_bare = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~:/=".contains(&b);
    (!text.is_empty() && text.bytes().all(is_bare)).then(|| text.to_owned())
}

/// The key as stored in the coordinator: with an identity, the hex SHA-256 of the identity, a
/// colon and the key, so that two callers' keys never meet and the identity is never stored in
/// clear; without one, the key itself. The scope has a fixed length, so two (identity, key)
/// pairs never give the same stored key.
pub fn scoped_key(identity: Option<&[u8]>, key: &str) -> String {
    match identity {
        Some(identity) => format!("{}:{key}", hex::encode(Sha256::digest(identity))),
        None => key.to_owned(),
    }
}

/// SHA-256 over the method, the path and query, the Content-Type and the body, each
/// length-prefixed so that no two different requests give the same input.
pub fn fingerprint(
    method: &str,
    path_and_query: &str,
    headers: &HeaderMap,
    body: &[u8],
) -> Vec<u8> {
    let content_type = headers
        .get(CONTENT_TYPE)
        .map(|value| value.as_bytes())
        .unwrap_or_default();
    let mut hash = Sha256::new();
    for part in [
        method.as_bytes(),
        path_and_query.as_bytes(),
        content_type,
        body,
    ] {
        hash.update(u64::try_from(part.len()).unwrap_or(u64::MAX).to_be_bytes());
        hash.update(part);
    }
    hash.finalize().to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::header::HeaderValue;

    const KEY: HeaderName = HeaderName::from_static("idempotency-key");

    fn headers(values: &[&'static str]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for value in values {
            headers.append(KEY, HeaderValue::from_static(value));
        }
        headers
    }

    fn read(values: &[&'static str]) -> Result<String, KeyError> {
        read_key(&headers(values), &KEY, 16)
    }

    #[test]
    fn strings_tokens_and_bare_values_are_keys() {
        assert_eq!(read(&["\"abc\""]), Ok("abc".into()));
        assert_eq!(read(&["\"a \\\"b\\\"\""]), Ok("a \"b\"".into()));
        assert_eq!(read(&["\"abc\";v=1"]), Ok("abc".into()));
        assert_eq!(read(&["abc-1"]), Ok("abc-1".into()));
        assert_eq!(read(&["8e03978e-40d5"]), Ok("8e03978e-40d5".into()));
        assert_eq!(read(&["123"]), Ok("123".into()));
        assert_eq!(read(&["  ab+/= "]), Ok("ab+/=".into()));
    }

    #[test]
    fn missing_repeated_empty_long_and_malformed_keys_are_refused() {
        assert_eq!(read(&[]), Err(KeyError::Missing));
        assert_eq!(read(&["\"a\"", "\"b\""]), Err(KeyError::Repeated));
        assert!(matches!(read(&["\"\""]), Err(KeyError::Malformed(_))));
        assert!(matches!(read(&[""]), Err(KeyError::Malformed(_))));
        assert!(matches!(read(&["\"abc"]), Err(KeyError::Malformed(_))));
        assert!(matches!(
            read(&["\"a\", \"b\""]),
            Err(KeyError::Malformed(_))
        ));
        assert!(matches!(read(&["a b"]), Err(KeyError::Malformed(_))));
        assert_eq!(
            read(&["\"0123456789abcdef\""]),
            Ok("0123456789abcdef".into())
        );
        assert!(matches!(
            read(&["\"0123456789abcdefg\""]),
            Err(KeyError::Malformed(_))
        ));
    }

    #[test]
    fn identities_scope_keys_without_showing_the_identity() {
        let alice = scoped_key(Some(b"alice"), "k");
        let bob = scoped_key(Some(b"bob"), "k");
        assert_ne!(alice, bob);
        assert!(!alice.contains("alice"));
        assert_eq!(alice.len(), 64 + 1 + 1);
        assert_eq!(scoped_key(None, "k"), "k");
        // The scope has a fixed length: a key containing a colon cannot imitate another scope.
        assert_ne!(scoped_key(Some(b"a"), "b:c"), scoped_key(Some(b"a:b"), "c"));
    }

    #[test]
    fn every_part_of_the_request_changes_the_fingerprint() {
        let json = {
            let mut headers = HeaderMap::new();
            headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            headers
        };
        let base = fingerprint("POST", "/orders?x=1", &json, b"{}");
        assert_eq!(base.len(), 32);
        assert_eq!(base, fingerprint("POST", "/orders?x=1", &json, b"{}"));
        assert_ne!(base, fingerprint("PATCH", "/orders?x=1", &json, b"{}"));
        assert_ne!(base, fingerprint("POST", "/orders?x=2", &json, b"{}"));
        assert_ne!(
            base,
            fingerprint("POST", "/orders?x=1", &HeaderMap::new(), b"{}")
        );
        assert_ne!(base, fingerprint("POST", "/orders?x=1", &json, b"{ }"));
        // Length prefixes: moving bytes from the path to the body changes the fingerprint.
        assert_ne!(
            fingerprint("POST", "/ab", &HeaderMap::new(), b"c"),
            fingerprint("POST", "/a", &HeaderMap::new(), b"bc")
        );
    }
}
