//! How results are stored: a codec turns the work's value into the stored response and back.

use serde::Serialize;
use serde::de::DeserializeOwned;
use sha2::{Digest, Sha256};

use crate::canonical::{canonical_json, canonical_json_text};
use crate::error::{BoxError, Error};

/// Turns a work's result into the stored response bytes and back.
pub trait Codec<T> {
    fn encode(&self, value: &T) -> Result<Vec<u8>, BoxError>;
    fn decode(&self, bytes: &[u8]) -> Result<T, BoxError>;
}

/// Results as compact UTF-8 JSON (the default): readable by the clients in other languages,
/// whose JSON codecs store the same shape.
#[derive(Debug, Clone, Copy, Default)]
pub struct Json;

impl<T: Serialize + DeserializeOwned> Codec<T> for Json {
    fn encode(&self, value: &T) -> Result<Vec<u8>, BoxError> {
        Ok(serde_json::to_vec(value)?)
    }

    fn decode(&self, bytes: &[u8]) -> Result<T, BoxError> {
        Ok(serde_json::from_slice(bytes)?)
    }
}

/// Results that are already bytes, stored as they are.
#[derive(Debug, Clone, Copy, Default)]
pub struct Bytes;

impl Codec<Vec<u8>> for Bytes {
    fn encode(&self, value: &Vec<u8>) -> Result<Vec<u8>, BoxError> {
        Ok(value.clone())
    }

    fn decode(&self, bytes: &[u8]) -> Result<Vec<u8>, BoxError> {
        Ok(bytes.to_vec())
    }
}

/// SHA-256 of the request's RFC 8785 canonical JSON ([`crate::canonical_json`]): equal
/// requests hash alike whatever the order of their fields or the language that made them.
/// [`Error::Fingerprint`] for a request JSON cannot carry exactly (an integer beyond
/// ±(2^53−1): send it as a string; NaN).
pub fn fingerprint_of<R: Serialize + ?Sized>(request: &R) -> Result<Vec<u8>, Error> {
    let canonical = canonical_json(request).map_err(Error::Fingerprint)?;
    Ok(Sha256::digest(&canonical).to_vec())
}

/// SHA-256 of the canonical form of a JSON text ([`crate::canonical_json_text`]), e.g. a
/// request body as it arrived: the fingerprint [`fingerprint_of`] gives the value it holds,
/// whatever its spacing and member order. [`Error::Fingerprint`] for a text that is not JSON or
/// that JSON cannot carry exactly (a member twice, an integer literal beyond ±(2^53−1)).
pub fn fingerprint_of_json(text: &str) -> Result<Vec<u8>, Error> {
    let canonical = canonical_json_text(text).map_err(Error::Fingerprint)?;
    Ok(Sha256::digest(&canonical).to_vec())
}

/// SHA-256 of bytes as they are (the Python client's fingerprint of a `bytes` request).
pub fn fingerprint_of_bytes(request: &[u8]) -> Vec<u8> {
    Sha256::digest(request).to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The digests the Python client (`rfc8785` + SHA-256) computes for the same values: key
    /// order, UTF-8, ES6 number forms (`1e+21`, `-0` as `0`, `0.1`) all agree.
    #[test]
    fn fingerprints_match_the_python_client() {
        let request = serde_json::json!({
            "order": "o-42", "amount": 1250, "currency": "EUR",
            "items": [{"sku": "a", "qty": 2}], "note": "café €", "ratio": 0.1,
            "big": 1e21, "neg": -0.0, "t": true, "n": null
        });
        assert_eq!(
            hex(&fingerprint_of(&request).expect("canonical")),
            "ee063dbd1f6864b287ea99a4ff7c4e649a8cff61b2e001d8b382c6cdff18c337"
        );
        assert_eq!(
            hex(&fingerprint_of(&"hello").expect("canonical")),
            "5aa762ae383fbb727af3c7a36d4940a5b8c40a989452d2304fc958ff3f354e7a"
        );
        assert_eq!(
            hex(&fingerprint_of(&[3, 1, 2]).expect("canonical")),
            "51bda7ab4e44726cde71fcb6e4b515357059bb6b6dd5146d1fc50f73f11678c6"
        );
    }

    #[test]
    fn struct_field_order_does_not_change_the_fingerprint() {
        #[derive(Serialize)]
        struct Ab {
            a: u32,
            b: &'static str,
        }
        #[derive(Serialize)]
        struct Ba {
            b: &'static str,
            a: u32,
        }
        assert_eq!(
            fingerprint_of(&Ab { a: 1, b: "x" }).expect("canonical"),
            fingerprint_of(&Ba { b: "x", a: 1 }).expect("canonical")
        );
    }
}
