//! RFC 8785 (JCS) canonical JSON of a value or of a JSON text, the form a request is
//! fingerprinted in: object members sorted by the UTF-16 code units of their names, the fewest
//! escapes, numbers as ECMAScript writes doubles. Beyond RFC 8785, as I-JSON (RFC 7493) asks,
//! a duplicate member name, a lone surrogate and an integer beyond ±(2^53−1) are refused: rounding
//! such an integer to a double would let two different requests share a fingerprint. The
//! vectors in `clients/conformance/fingerprints.json` pin all of it, for every client.
//!
//! The text is read by a small parser of its own rather than `serde_json`'s: that one keeps the
//! last of two equal names, reads an integer literal too large for `u64` as the same `f64` as
//! its exponent form, and stops at 128 levels of nesting; changing that takes features
//! (`arbitrary_precision`, `unbounded_depth`) that would apply to every crate built with this one.

use std::fmt;

use serde::ser::{self, Serialize};

mod text;
mod value;

use value::ValueSerializer;

/// The largest integer every client's JSON reads exactly (JavaScript's
/// `Number.MAX_SAFE_INTEGER`); beyond it, in either direction, an integer is refused.
pub const MAX_SAFE_INTEGER: u64 = (1 << 53) - 1;

/// How deep a JSON text may nest (arrays and objects); deeper is `InvalidJson`.
const MAX_DEPTH: usize = 1000;

/// Why a value or a text has no canonical JSON form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CanonicalJsonErrorKind {
    /// The text is not JSON.
    InvalidJson,
    /// The value is not JSON: a map key that is not a string or an integer.
    NotJson,
    /// A member name occurs twice in one object.
    DuplicateKey,
    /// A string holds half of a surrogate pair (only possible in a text's `\u` escapes).
    LoneSurrogate,
    /// An integer beyond ±(2^53−1): a double would round it. Send it as a string.
    UnsafeInteger,
    /// NaN, an infinity, or a number literal beyond the largest double.
    NumberOutOfRange,
}

impl CanonicalJsonErrorKind {
    /// The name the conformance vectors give this kind (`duplicate_key`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InvalidJson => "invalid_json",
            Self::NotJson => "not_json",
            Self::DuplicateKey => "duplicate_key",
            Self::LoneSurrogate => "lone_surrogate",
            Self::UnsafeInteger => "unsafe_integer",
            Self::NumberOutOfRange => "number_out_of_range",
        }
    }
}

/// A request that cannot be written as canonical JSON, so that it has no fingerprint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CanonicalJsonError {
    kind: CanonicalJsonErrorKind,
    message: String,
}

impl CanonicalJsonError {
    fn new(kind: CanonicalJsonErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    /// What is wrong.
    pub fn kind(&self) -> CanonicalJsonErrorKind {
        self.kind
    }
}

impl fmt::Display for CanonicalJsonError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.message, self.kind.as_str())
    }
}

impl std::error::Error for CanonicalJsonError {}

impl ser::Error for CanonicalJsonError {
    fn custom<T: fmt::Display>(message: T) -> Self {
        Self::new(CanonicalJsonErrorKind::NotJson, message.to_string())
    }
}

/// The RFC 8785 canonical JSON of `value`, as serde serializes it (field names and
/// `#[serde(...)]` attributes apply; map keys must be strings or integers, which are written as
/// strings). Refuses an integer beyond ±(2^53−1) of any width (send it as a string), NaN and the
/// infinities, and a map with one key twice.
pub fn canonical_json<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, CanonicalJsonError> {
    let canon = value.serialize(ValueSerializer)?;
    let mut out = Vec::with_capacity(128);
    canon.write(&mut out);
    Ok(out)
}

/// The RFC 8785 canonical form of a JSON text (a request body as it arrived, say): the same
/// bytes as [`canonical_json`] of the value it holds. Refuses a text that is not JSON, a member
/// name twice in one object, an integer literal (no fraction, no exponent) beyond ±(2^53−1), a
/// number beyond the largest double and a lone surrogate; `1e21` and `9007199254740993.0` are
/// numbers like any other, written as their nearest double.
pub fn canonical_json_text(text: &str) -> Result<Vec<u8>, CanonicalJsonError> {
    let canon = text::parse(text)?;
    let mut out = Vec::with_capacity(text.len());
    canon.write(&mut out);
    Ok(out)
}

/// A JSON value on its way to its canonical form: numbers are the doubles they will be written as.
enum Canon {
    Null,
    Bool(bool),
    Number(f64),
    String(String),
    Array(Vec<Canon>),
    Object(Vec<(String, Canon)>),
}

impl Canon {
    fn object(mut members: Vec<(String, Canon)>) -> Result<Self, CanonicalJsonError> {
        members.sort_by(|(a, _), (b, _)| a.encode_utf16().cmp(b.encode_utf16()));
        if let Some(pair) = members.windows(2).find(|pair| pair[0].0 == pair[1].0) {
            return Err(CanonicalJsonError::new(
                CanonicalJsonErrorKind::DuplicateKey,
                format!("the member name {:?} occurs twice in an object", pair[0].0),
            ));
        }
        Ok(Self::Object(members))
    }

    fn write(&self, out: &mut Vec<u8>) {
        match self {
            Self::Null => out.extend_from_slice(b"null"),
            Self::Bool(true) => out.extend_from_slice(b"true"),
            Self::Bool(false) => out.extend_from_slice(b"false"),
            Self::Number(number) => {
                // ECMAScript's Number-to-String, which writes -0 as 0.
                let number = if *number == 0.0 { 0.0 } else { *number };
                out.extend_from_slice(ryu_js::Buffer::new().format_finite(number).as_bytes());
            }
            Self::String(string) => write_string(string, out),
            Self::Array(elements) => {
                out.push(b'[');
                for (index, element) in elements.iter().enumerate() {
                    if index > 0 {
                        out.push(b',');
                    }
                    element.write(out);
                }
                out.push(b']');
            }
            Self::Object(members) => {
                out.push(b'{');
                for (index, (name, value)) in members.iter().enumerate() {
                    if index > 0 {
                        out.push(b',');
                    }
                    write_string(name, out);
                    out.push(b':');
                    value.write(out);
                }
                out.push(b'}');
            }
        }
    }
}

/// A string with RFC 8785's escapes: the two-character ones, `\u00xx` (lower case) for the other
/// control characters, and nothing else escaped.
fn write_string(string: &str, out: &mut Vec<u8>) {
    out.push(b'"');
    for c in string.chars() {
        match c {
            '"' => out.extend_from_slice(b"\\\""),
            '\\' => out.extend_from_slice(b"\\\\"),
            '\u{8}' => out.extend_from_slice(b"\\b"),
            '\u{c}' => out.extend_from_slice(b"\\f"),
            '\n' => out.extend_from_slice(b"\\n"),
            '\r' => out.extend_from_slice(b"\\r"),
            '\t' => out.extend_from_slice(b"\\t"),
            c if c < ' ' => out.extend_from_slice(format!("\\u{:04x}", u32::from(c)).as_bytes()),
            c => {
                let mut buffer = [0; 4];
                out.extend_from_slice(c.encode_utf8(&mut buffer).as_bytes());
            }
        }
    }
    out.push(b'"');
}

fn number(value: f64) -> Result<Canon, CanonicalJsonError> {
    if value.is_finite() {
        Ok(Canon::Number(value))
    } else {
        Err(CanonicalJsonError::new(
            CanonicalJsonErrorKind::NumberOutOfRange,
            format!("{value} is not a JSON number"),
        ))
    }
}

fn integer(magnitude: u128, negative: bool) -> Result<Canon, CanonicalJsonError> {
    if magnitude > u128::from(MAX_SAFE_INTEGER) {
        let sign = if negative { "-" } else { "" };
        return Err(unsafe_integer(&format!("{sign}{magnitude}")));
    }
    // At most 2^53−1: exact as a double.
    #[allow(clippy::cast_precision_loss)]
    let value = magnitude as f64;
    Ok(Canon::Number(if negative { -value } else { value }))
}

fn unsafe_integer(literal: &str) -> CanonicalJsonError {
    CanonicalJsonError::new(
        CanonicalJsonErrorKind::UnsafeInteger,
        format!(
            "the integer {literal} is beyond ±(2^53−1) and would be rounded: send it as a string"
        ),
    )
}
