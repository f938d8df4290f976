//! Reading a JSON text into its canonical form, with the refusals RFC 8785 and I-JSON ask for.

use super::{
    Canon, CanonicalJsonError, CanonicalJsonErrorKind, MAX_DEPTH, MAX_SAFE_INTEGER, integer,
    unsafe_integer,
};

/// The value a whole JSON text holds (white space around it allowed, nothing else).
pub(super) fn parse(text: &str) -> Result<Canon, CanonicalJsonError> {
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
    Ok(canon)
}

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
        let mut members = Vec::new();
        self.items(b'}', |parser| {
            if parser.peek() != Some(b'"') {
                return Err(parser.invalid("expected a member name"));
            }
            let name = parser.string()?;
            parser.space();
            if !parser.eat(b":") {
                return Err(parser.invalid("expected ':'"));
            }
            parser.space();
            members.push((name, parser.value(depth)?));
            Ok(())
        })?;
        Canon::object(members)
    }

    fn array(&mut self, depth: usize) -> Result<Canon, CanonicalJsonError> {
        let mut elements = Vec::new();
        self.items(b']', |parser| {
            elements.push(parser.value(depth)?);
            Ok(())
        })?;
        Ok(Canon::Array(elements))
    }

    /// The members of an object or the elements of an array, from its opening bracket to
    /// `close`: `item` reads each, from its first character.
    fn items(
        &mut self,
        close: u8,
        mut item: impl FnMut(&mut Self) -> Result<(), CanonicalJsonError>,
    ) -> Result<(), CanonicalJsonError> {
        self.pos += 1;
        self.space();
        if self.eat(&[close]) {
            return Ok(());
        }
        loop {
            self.space();
            item(self)?;
            self.space();
            if self.eat(&[close]) {
                return Ok(());
            }
            if !self.eat(b",") {
                return Err(self.invalid(&format!("expected ',' or '{}'", char::from(close))));
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
