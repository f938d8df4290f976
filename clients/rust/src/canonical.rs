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
    let mut parser = Parser {
        text: text.as_bytes(),
        pos: 0,
    };
    parser.space();
    let canon = parser.value(0)?;
    parser.space();
    if parser.pos != parser.text.len() {
        return Err(parser.invalid("text after the JSON value"));
    }
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

// ---- Texts -----------------------------------------------------------------------------------

struct Parser<'t> {
    text: &'t [u8],
    pos: usize,
}

impl Parser<'_> {
    fn invalid(&self, what: &str) -> CanonicalJsonError {
        CanonicalJsonError::new(
            CanonicalJsonErrorKind::InvalidJson,
            format!("not a JSON text: {what} at byte {}", self.pos),
        )
    }

    fn peek(&self) -> Option<u8> {
        self.text.get(self.pos).copied()
    }

    fn space(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.pos += 1;
        }
    }

    fn eat(&mut self, literal: &[u8]) -> bool {
        let found = self.text[self.pos..].starts_with(literal);
        if found {
            self.pos += literal.len();
        }
        found
    }

    fn value(&mut self, depth: usize) -> Result<Canon, CanonicalJsonError> {
        if depth >= MAX_DEPTH {
            return Err(self.invalid("nesting deeper than 1000 levels"));
        }
        match self.peek() {
            Some(b'{') => self.object(depth + 1),
            Some(b'[') => self.array(depth + 1),
            Some(b'"') => self.string().map(Canon::String),
            _ if self.eat(b"true") => Ok(Canon::Bool(true)),
            _ if self.eat(b"false") => Ok(Canon::Bool(false)),
            _ if self.eat(b"null") => Ok(Canon::Null),
            _ => self.number(),
        }
    }

    fn object(&mut self, depth: usize) -> Result<Canon, CanonicalJsonError> {
        self.pos += 1;
        let mut members = Vec::new();
        self.space();
        if self.eat(b"}") {
            return Ok(Canon::Object(members));
        }
        loop {
            self.space();
            if self.peek() != Some(b'"') {
                return Err(self.invalid("expected a member name"));
            }
            let name = self.string()?;
            self.space();
            if !self.eat(b":") {
                return Err(self.invalid("expected ':'"));
            }
            self.space();
            members.push((name, self.value(depth)?));
            self.space();
            if self.eat(b"}") {
                return Canon::object(members);
            }
            if !self.eat(b",") {
                return Err(self.invalid("expected ',' or '}'"));
            }
        }
    }

    fn array(&mut self, depth: usize) -> Result<Canon, CanonicalJsonError> {
        self.pos += 1;
        let mut elements = Vec::new();
        self.space();
        if self.eat(b"]") {
            return Ok(Canon::Array(elements));
        }
        loop {
            self.space();
            elements.push(self.value(depth)?);
            self.space();
            if self.eat(b"]") {
                return Ok(Canon::Array(elements));
            }
            if !self.eat(b",") {
                return Err(self.invalid("expected ',' or ']'"));
            }
        }
    }

    fn string(&mut self) -> Result<String, CanonicalJsonError> {
        self.pos += 1;
        let mut value = String::new();
        loop {
            // Everything up to the next quote, backslash or control character is copied whole
            // (the text is a &str, so it is UTF-8 already).
            let run = self.text[self.pos..]
                .iter()
                .position(|&b| b == b'"' || b == b'\\' || b < 0x20)
                .ok_or_else(|| self.invalid("unterminated string"))?;
            value.push_str(
                std::str::from_utf8(&self.text[self.pos..self.pos + run])
                    .map_err(|_| self.invalid("a string that is not UTF-8"))?,
            );
            self.pos += run;
            match self.text[self.pos] {
                b'"' => {
                    self.pos += 1;
                    return Ok(value);
                }
                b'\\' => {
                    self.pos += 1;
                    let escape = self
                        .peek()
                        .ok_or_else(|| self.invalid("unterminated escape"))?;
                    self.pos += 1;
                    let c = match escape {
                        b'"' => '"',
                        b'\\' => '\\',
                        b'/' => '/',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'u' => self.unicode_escape()?,
                        _ => return Err(self.invalid("a bad escape")),
                    };
                    value.push(c);
                }
                _ => return Err(self.invalid("a control character in a string")),
            }
        }
    }

    /// The character of a `\u` escape (the `\u` read), with the low half of a surrogate pair.
    fn unicode_escape(&mut self) -> Result<char, CanonicalJsonError> {
        let unit = self.hex4()?;
        let lone = || {
            CanonicalJsonError::new(
                CanonicalJsonErrorKind::LoneSurrogate,
                "a string holds a lone surrogate",
            )
        };
        match unit {
            0xD800..=0xDBFF => {
                if !self.eat(b"\\u") {
                    return Err(lone());
                }
                let low = self.hex4()?;
                if !(0xDC00..=0xDFFF).contains(&low) {
                    return Err(lone());
                }
                let code = 0x10000 + ((u32::from(unit) - 0xD800) << 10) + (u32::from(low) - 0xDC00);
                char::from_u32(code).ok_or_else(lone)
            }
            0xDC00..=0xDFFF => Err(lone()),
            unit => char::from_u32(u32::from(unit)).ok_or_else(lone),
        }
    }

    fn hex4(&mut self) -> Result<u16, CanonicalJsonError> {
        let digits = self
            .text
            .get(self.pos..self.pos + 4)
            .and_then(|digits| std::str::from_utf8(digits).ok())
            .filter(|digits| digits.bytes().all(|b| b.is_ascii_hexdigit()))
            .ok_or_else(|| self.invalid("a bad \\u escape"))?;
        self.pos += 4;
        u16::from_str_radix(digits, 16).map_err(|_| self.invalid("a bad \\u escape"))
    }

    fn digits(&mut self) -> usize {
        let start = self.pos;
        while matches!(self.peek(), Some(b'0'..=b'9')) {
            self.pos += 1;
        }
        self.pos - start
    }

    fn number(&mut self) -> Result<Canon, CanonicalJsonError> {
        let start = self.pos;
        let negative = self.eat(b"-");
        let int_start = self.pos;
        match self.digits() {
            0 => return Err(self.invalid("expected a JSON value")),
            n if n > 1 && self.text[int_start] == b'0' => {
                return Err(self.invalid("a number with a leading zero"));
            }
            _ => {}
        }
        let int_end = self.pos;
        let mut integer_literal = true;
        if self.eat(b".") {
            integer_literal = false;
            if self.digits() == 0 {
                return Err(self.invalid("expected digits after '.'"));
            }
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            integer_literal = false;
            self.pos += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.pos += 1;
            }
            if self.digits() == 0 {
                return Err(self.invalid("expected digits in the exponent"));
            }
        }
        let literal = std::str::from_utf8(&self.text[start..self.pos])
            .map_err(|_| self.invalid("a bad number"))?;
        if integer_literal {
            let digits = &self.text[int_start..int_end];
            // More than 16 digits is beyond 2^53−1 (16 digits) for sure; parse the rest.
            let magnitude = if digits.len() > 16 {
                u128::MAX
            } else {
                literal
                    .trim_start_matches('-')
                    .parse::<u128>()
                    .unwrap_or(u128::MAX)
            };
            if magnitude > u128::from(MAX_SAFE_INTEGER) {
                return Err(unsafe_integer(literal));
            }
            return integer(magnitude, negative);
        }
        // Rust's parse is correctly rounded: the nearest double, as RFC 8785 asks.
        let value: f64 = literal.parse().map_err(|_| self.invalid("a bad number"))?;
        if !value.is_finite() {
            return Err(CanonicalJsonError::new(
                CanonicalJsonErrorKind::NumberOutOfRange,
                format!("the number {literal} is beyond the largest double"),
            ));
        }
        Ok(Canon::Number(value))
    }
}

// ---- Values ----------------------------------------------------------------------------------

/// Serializes a value into a [`Canon`], refusing what JSON cannot carry exactly.
struct ValueSerializer;

type Result<T, E = CanonicalJsonError> = std::result::Result<T, E>;

impl ser::Serializer for ValueSerializer {
    type Ok = Canon;
    type Error = CanonicalJsonError;
    type SerializeSeq = SeqSerializer;
    type SerializeTuple = SeqSerializer;
    type SerializeTupleStruct = SeqSerializer;
    type SerializeTupleVariant = SeqSerializer;
    type SerializeMap = MapSerializer;
    type SerializeStruct = MapSerializer;
    type SerializeStructVariant = MapSerializer;

    fn serialize_bool(self, v: bool) -> Result<Canon> {
        Ok(Canon::Bool(v))
    }
    fn serialize_i8(self, v: i8) -> Result<Canon> {
        self.serialize_i128(i128::from(v))
    }
    fn serialize_i16(self, v: i16) -> Result<Canon> {
        self.serialize_i128(i128::from(v))
    }
    fn serialize_i32(self, v: i32) -> Result<Canon> {
        self.serialize_i128(i128::from(v))
    }
    fn serialize_i64(self, v: i64) -> Result<Canon> {
        self.serialize_i128(i128::from(v))
    }
    fn serialize_i128(self, v: i128) -> Result<Canon> {
        integer(v.unsigned_abs(), v < 0)
    }
    fn serialize_u8(self, v: u8) -> Result<Canon> {
        self.serialize_u128(u128::from(v))
    }
    fn serialize_u16(self, v: u16) -> Result<Canon> {
        self.serialize_u128(u128::from(v))
    }
    fn serialize_u32(self, v: u32) -> Result<Canon> {
        self.serialize_u128(u128::from(v))
    }
    fn serialize_u64(self, v: u64) -> Result<Canon> {
        self.serialize_u128(u128::from(v))
    }
    fn serialize_u128(self, v: u128) -> Result<Canon> {
        integer(v, false)
    }
    fn serialize_f32(self, v: f32) -> Result<Canon> {
        // As JSON writes it (the shortest digits that read back as this f32), then as a double,
        // so that 0.1f32 is 0.1 as in the other languages.
        if !v.is_finite() {
            return number(f64::from(v));
        }
        number(v.to_string().parse().unwrap_or(f64::from(v)))
    }
    fn serialize_f64(self, v: f64) -> Result<Canon> {
        number(v)
    }
    fn serialize_char(self, v: char) -> Result<Canon> {
        Ok(Canon::String(v.to_string()))
    }
    fn serialize_str(self, v: &str) -> Result<Canon> {
        Ok(Canon::String(v.to_owned()))
    }
    fn serialize_bytes(self, v: &[u8]) -> Result<Canon> {
        Ok(Canon::Array(
            v.iter().map(|b| Canon::Number(f64::from(*b))).collect(),
        ))
    }
    fn serialize_none(self) -> Result<Canon> {
        Ok(Canon::Null)
    }
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<Canon> {
        value.serialize(self)
    }
    fn serialize_unit(self) -> Result<Canon> {
        Ok(Canon::Null)
    }
    fn serialize_unit_struct(self, _name: &'static str) -> Result<Canon> {
        Ok(Canon::Null)
    }
    fn serialize_unit_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
    ) -> Result<Canon> {
        Ok(Canon::String(variant.to_owned()))
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        value: &T,
    ) -> Result<Canon> {
        value.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<Canon> {
        Ok(Canon::Object(vec![(
            variant.to_owned(),
            value.serialize(self)?,
        )]))
    }
    fn serialize_seq(self, len: Option<usize>) -> Result<SeqSerializer> {
        Ok(SeqSerializer {
            variant: None,
            elements: Vec::with_capacity(len.unwrap_or(0)),
        })
    }
    fn serialize_tuple(self, len: usize) -> Result<SeqSerializer> {
        self.serialize_seq(Some(len))
    }
    fn serialize_tuple_struct(self, _name: &'static str, len: usize) -> Result<SeqSerializer> {
        self.serialize_seq(Some(len))
    }
    fn serialize_tuple_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        len: usize,
    ) -> Result<SeqSerializer> {
        Ok(SeqSerializer {
            variant: Some(variant),
            elements: Vec::with_capacity(len),
        })
    }
    fn serialize_map(self, len: Option<usize>) -> Result<MapSerializer> {
        Ok(MapSerializer {
            variant: None,
            members: Vec::with_capacity(len.unwrap_or(0)),
            key: None,
        })
    }
    fn serialize_struct(self, _name: &'static str, len: usize) -> Result<MapSerializer> {
        self.serialize_map(Some(len))
    }
    fn serialize_struct_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        len: usize,
    ) -> Result<MapSerializer> {
        Ok(MapSerializer {
            variant: Some(variant),
            members: Vec::with_capacity(len),
            key: None,
        })
    }
}

/// `{"Variant": inner}`, serde's external tagging, or `inner` itself.
fn tagged(variant: Option<&'static str>, inner: Canon) -> Canon {
    match variant {
        Some(variant) => Canon::Object(vec![(variant.to_owned(), inner)]),
        None => inner,
    }
}

struct SeqSerializer {
    variant: Option<&'static str>,
    elements: Vec<Canon>,
}

impl SeqSerializer {
    fn push<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<()> {
        self.elements.push(value.serialize(ValueSerializer)?);
        Ok(())
    }
    fn finish(self) -> Result<Canon> {
        Ok(tagged(self.variant, Canon::Array(self.elements)))
    }
}

impl ser::SerializeSeq for SeqSerializer {
    type Ok = Canon;
    type Error = CanonicalJsonError;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<()> {
        self.push(value)
    }
    fn end(self) -> Result<Canon> {
        self.finish()
    }
}

impl ser::SerializeTuple for SeqSerializer {
    type Ok = Canon;
    type Error = CanonicalJsonError;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<()> {
        self.push(value)
    }
    fn end(self) -> Result<Canon> {
        self.finish()
    }
}

impl ser::SerializeTupleStruct for SeqSerializer {
    type Ok = Canon;
    type Error = CanonicalJsonError;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<()> {
        self.push(value)
    }
    fn end(self) -> Result<Canon> {
        self.finish()
    }
}

impl ser::SerializeTupleVariant for SeqSerializer {
    type Ok = Canon;
    type Error = CanonicalJsonError;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<()> {
        self.push(value)
    }
    fn end(self) -> Result<Canon> {
        self.finish()
    }
}

struct MapSerializer {
    variant: Option<&'static str>,
    members: Vec<(String, Canon)>,
    key: Option<String>,
}

impl MapSerializer {
    fn finish(self) -> Result<Canon> {
        Ok(tagged(self.variant, Canon::object(self.members)?))
    }
}

impl ser::SerializeMap for MapSerializer {
    type Ok = Canon;
    type Error = CanonicalJsonError;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<()> {
        self.key = Some(match key.serialize(ValueSerializer)? {
            Canon::String(name) => name,
            // Integer keys are written as strings, as serde_json writes them.
            Canon::Number(number) => ryu_js::Buffer::new().format_finite(number).to_owned(),
            _ => {
                return Err(CanonicalJsonError::new(
                    CanonicalJsonErrorKind::NotJson,
                    "a map key must be a string or an integer",
                ));
            }
        });
        Ok(())
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<()> {
        let key = self
            .key
            .take()
            .ok_or_else(|| ser::Error::custom("a map value without its key"))?;
        self.members.push((key, value.serialize(ValueSerializer)?));
        Ok(())
    }
    fn end(self) -> Result<Canon> {
        self.finish()
    }
}

impl ser::SerializeStruct for MapSerializer {
    type Ok = Canon;
    type Error = CanonicalJsonError;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<()> {
        self.members
            .push((key.to_owned(), value.serialize(ValueSerializer)?));
        Ok(())
    }
    fn end(self) -> Result<Canon> {
        self.finish()
    }
}

impl ser::SerializeStructVariant for MapSerializer {
    type Ok = Canon;
    type Error = CanonicalJsonError;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<()> {
        self.members
            .push((key.to_owned(), value.serialize(ValueSerializer)?));
        Ok(())
    }
    fn end(self) -> Result<Canon> {
        self.finish()
    }
}
