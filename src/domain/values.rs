//! Validated values. Each constructor checks one field against the contract's bounds, so code
//! past the gRPC edge never handles a raw string, byte buffer or duration.

use std::time::Duration;

/// Why a field was refused, phrased for the caller. The edge attaches the field's name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid(pub String);

impl Invalid {
    pub(crate) fn new(description: impl Into<String>) -> Self {
        Self(description.into())
    }
}

/// A `namespace` (for keys) or `consumer` (for events): 1-64 characters of `A-Z a-z 0-9 . _ - :`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Scope(String);

impl Scope {
    pub const MAX_CHARS: usize = 64;

    pub fn parse(raw: String) -> Result<Self, Invalid> {
        let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ':');
        if raw.is_empty() || raw.len() > Self::MAX_CHARS || !raw.chars().all(allowed) {
            return Err(Invalid::new(
                "must be 1-64 characters of A-Z a-z 0-9 . _ - :",
            ));
        }
        Ok(Self(raw))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Control characters are Unicode category Cc: U+0000-U+001F and U+007F-U+009F.
fn has_control_character(text: &str) -> bool {
    text.chars().any(char::is_control)
}

/// Checks the rule shared by keys, event ids and attempt ids: UTF-8 (guaranteed by the protobuf
/// decoder for `string` fields), `min..=max` bytes, no control characters.
fn check_identifier(raw: &str, min_bytes: usize, max_bytes: usize) -> Result<(), Invalid> {
    if raw.len() < min_bytes || raw.len() > max_bytes {
        return Err(Invalid(format!(
            "must be {min_bytes}-{max_bytes} bytes of UTF-8 (got {} bytes)",
            raw.len()
        )));
    }
    if has_control_character(raw) {
        return Err(Invalid::new("must not contain control characters"));
    }
    Ok(())
}

/// A string that names something a caller chose: 1 to `MAX_BYTES` bytes of UTF-8 without
/// control characters ([`check_identifier`]).
macro_rules! identifier {
    ($(#[$doc:meta])* $name:ident, $max_bytes:expr) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash)]
        pub struct $name(String);

        impl $name {
            pub const MAX_BYTES: usize = $max_bytes;

            pub fn parse(raw: String) -> Result<Self, Invalid> {
                check_identifier(&raw, 1, Self::MAX_BYTES)?;
                Ok(Self(raw))
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }

            pub fn into_string(self) -> String {
                self.0
            }
        }
    };
}

identifier!(
    /// An idempotency key: 1-255 bytes of UTF-8 without control characters.
    Key,
    255
);
identifier!(
    /// An event id: the same rule as a key.
    EventId,
    255
);

/// The caller's id for one attempt, which makes TryStart itself safe to retry. At most 128
/// bytes without control characters; the empty string means "none" and never matches.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AttemptId(String);

impl AttemptId {
    pub const MAX_BYTES: usize = 128;

    /// `Ok(None)` for the empty string.
    pub fn parse(raw: String) -> Result<Option<Self>, Invalid> {
        if raw.is_empty() {
            return Ok(None);
        }
        check_identifier(&raw, 1, Self::MAX_BYTES)?;
        Ok(Some(Self(raw)))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Refuses a value of more than `max_bytes` bytes, saying how many it has (every field bounded
/// in bytes is refused in the same words).
pub(crate) fn at_most_bytes(bytes: usize, max_bytes: usize) -> Result<(), Invalid> {
    if bytes > max_bytes {
        return Err(Invalid(format!(
            "must be at most {max_bytes} bytes (got {bytes})"
        )));
    }
    Ok(())
}

/// The caller's hash of its request, at most 64 bytes. Empty is a value like any other: it
/// matches only empty.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint(Vec<u8>);

impl Fingerprint {
    pub const MAX_BYTES: usize = 64;

    pub fn parse(raw: Vec<u8>) -> Result<Self, Invalid> {
        at_most_bytes(raw.len(), Self::MAX_BYTES)?;
        Ok(Self(raw))
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

/// A fencing token: positive and at most `i64::MAX`, the range of the database sequence that
/// issues them. Zero is how protobuf spells a missing field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LeaseToken(i64);

impl LeaseToken {
    pub fn parse(raw: u64) -> Result<Self, Invalid> {
        if raw == 0 {
            return Err(Invalid::new("is required (0 is not a lease token)"));
        }
        i64::try_from(raw)
            .map(Self)
            .map_err(|_| Invalid(format!("must be at most {} (got {raw})", i64::MAX)))
    }

    /// A token as the database stores it; the store's sequence only issues positive values.
    pub fn from_stored(value: i64) -> Self {
        Self(value)
    }

    pub fn get(self) -> i64 {
        self.0
    }

    pub fn as_u64(self) -> u64 {
        self.0.unsigned_abs()
    }
}

pub use idempotency_settings::{Bounds, human_duration};

/// The problem with a duration out of `bounds` (or not a duration at all), as a field violation.
pub fn out_of_range(bounds: Bounds) -> Invalid {
    Invalid(bounds.range())
}

macro_rules! bounded_duration {
    ($(#[$doc:meta])* $name:ident, $bounds:expr) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
        pub struct $name(Duration);

        impl $name {
            pub const BOUNDS: Bounds = $bounds;

            /// Checks the bounds, then keeps whole microseconds: both stores count time in
            /// microseconds, so that what a call answers is exactly what is stored.
            pub fn parse(value: Duration) -> Result<Self, Invalid> {
                let checked = Self::BOUNDS.check(value).map_err(Invalid)?;
                let micros = u64::try_from(checked.as_micros()).unwrap_or(u64::MAX);
                Ok(Self(Duration::from_micros(micros)))
            }

            pub fn get(self) -> Duration {
                self.0
            }

            /// Microseconds, the database's resolution. The bounds keep this far below
            /// `i64::MAX`.
            pub fn as_micros(self) -> i64 {
                i64::try_from(self.0.as_micros()).unwrap_or(i64::MAX)
            }
        }
    };
}

bounded_duration!(
    /// How long a TryStart may wait for the key's holder: 0 (answer at once) to 60 s.
    WaitTime,
    idempotency_settings::WAIT
);
bounded_duration!(
    /// How long a claim holds a key: 100 ms to 24 h.
    LeaseTtl,
    idempotency_settings::LEASE_TTL
);
bounded_duration!(
    /// How long a key is kept: 1 s to 30 d.
    KeyRetention,
    idempotency_settings::KEY_RETENTION
);
bounded_duration!(
    /// How long a processed event is remembered: 1 s to 30 d.
    EventRetention,
    idempotency_settings::EVENT_RETENTION
);

/// A stored response, at most the server's configured limit (1 MiB by default).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseBody(Vec<u8>);

impl ResponseBody {
    pub fn parse(raw: Vec<u8>, max_bytes: usize) -> Result<Self, Invalid> {
        at_most_bytes(raw.len(), max_bytes)?;
        Ok(Self(raw))
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

/// A holder's saved progress, at most 64 KiB.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint(Vec<u8>);

impl Checkpoint {
    pub const MAX_BYTES: usize = 64 * 1024;

    pub fn parse(raw: Vec<u8>) -> Result<Self, Invalid> {
        at_most_bytes(raw.len(), Self::MAX_BYTES)?;
        Ok(Self(raw))
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

/// How many event ids one MarkProcessed call may carry.
pub const MAX_EVENT_IDS: usize = 1000;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scope_accepts_its_alphabet_and_refuses_everything_else() {
        assert!(Scope::parse("payments-v2:eu_west.1".into()).is_ok());
        assert!(Scope::parse("a".repeat(64)).is_ok());
        assert!(Scope::parse(String::new()).is_err());
        assert!(Scope::parse("a".repeat(65)).is_err());
        for bad in ["a b", "a/b", "é", "a\n", "a*"] {
            assert!(Scope::parse(bad.into()).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn identifiers_count_bytes_not_characters() {
        // "é" is two bytes: 127 of them are 254 bytes, 128 are 256.
        assert!(Key::parse("é".repeat(127)).is_ok());
        assert!(Key::parse("é".repeat(128)).is_err());
        assert!(AttemptId::parse("é".repeat(64)).is_ok());
        assert!(AttemptId::parse("é".repeat(65)).is_err());
    }

    #[test]
    fn control_characters_are_category_cc_only() {
        for bad in ["a\u{0}", "a\u{1f}", "a\u{7f}", "a\u{85}", "a\u{9f}"] {
            assert!(Key::parse(bad.into()).is_err(), "{bad:?} was accepted");
        }
        // U+00A0 (no-break space) and U+200B (zero-width space) are not Cc.
        assert!(Key::parse("a\u{a0}\u{200b}".into()).is_ok());
    }

    #[test]
    fn empty_attempt_id_means_none() {
        assert_eq!(AttemptId::parse(String::new()), Ok(None));
    }

    #[test]
    fn lease_token_zero_is_missing_and_above_i64_max_is_out_of_range() {
        assert!(LeaseToken::parse(0).is_err());
        assert!(LeaseToken::parse(u64::MAX).is_err());
        assert_eq!(LeaseToken::parse(7).map(LeaseToken::get), Ok(7));
        assert_eq!(
            LeaseToken::parse(i64::MAX.unsigned_abs()).map(LeaseToken::get),
            Ok(i64::MAX)
        );
    }

    #[test]
    fn durations_keep_whole_microseconds() {
        let parsed = KeyRetention::parse(Duration::new(86_400, 1_500)).expect("in bounds");
        assert_eq!(parsed.get(), Duration::new(86_400, 1_000));
    }

    #[test]
    fn durations_are_checked_against_inclusive_bounds() {
        assert!(LeaseTtl::parse(Duration::from_millis(100)).is_ok());
        assert!(LeaseTtl::parse(Duration::from_millis(99)).is_err());
        let day = Duration::from_secs(24 * 3600);
        assert!(LeaseTtl::parse(day).is_ok());
        assert!(LeaseTtl::parse(day + Duration::from_nanos(1)).is_err());
        assert!(KeyRetention::parse(30 * day).is_ok());
        assert!(EventRetention::parse(Duration::from_secs(1) - Duration::from_nanos(1)).is_err());
    }
}
