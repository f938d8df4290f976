//! The operator's model (the admin API): which keys a listing asks for and in what order, its
//! page cursor, the bounded values an operator sends (page size, reason, key prefix, erase
//! batch), and what the store answers (key summaries, namespace statistics, audit events). No
//! I/O happens here.

use std::time::Duration;

use super::values::{Invalid, Key, Scope};
use super::{Instant, LeaseToken};

/// A stored key's state as an operator sees it. Every state is judged by the database clock
/// when the row is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdminKeyState {
    /// In progress, its lease running.
    InProgress,
    /// In progress, its lease run out, nobody having taken it over.
    Stuck,
    Completed,
    /// In progress, released by an operator (ForceRelease) and not yet claimed again: nobody
    /// holds it, and the next claim takes it over. Not stuck: the operator has dealt with it.
    Released,
}

impl AdminKeyState {
    /// The code both stores compute in SQL (`state_code`): 1, 2, 3, 4.
    pub fn from_code(code: i64) -> Option<Self> {
        match code {
            1 => Some(Self::InProgress),
            2 => Some(Self::Stuck),
            3 => Some(Self::Completed),
            4 => Some(Self::Released),
            _ => None,
        }
    }

    pub fn code(self) -> i64 {
        match self {
            Self::InProgress => 1,
            Self::Stuck => 2,
            Self::Completed => 3,
            Self::Released => 4,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::InProgress => "in_progress",
            Self::Stuck => "stuck",
            Self::Completed => "completed",
            Self::Released => "released",
        }
    }

    /// Whether the key is in progress (live, stuck or released): not completed.
    pub fn in_progress(self) -> bool {
        self != Self::Completed
    }
}

/// How a listing is ordered, which decides the index it reads: by key (the primary key: with a
/// key prefix, or without a state), by lease expiry (in-progress and stuck keys: the longest
/// stuck first), or by completion time (completed keys).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListOrder {
    Key,
    Lease,
    Completion,
}

impl ListOrder {
    fn tag(self) -> char {
        match self {
            Self::Key => 'k',
            Self::Lease => 'l',
            Self::Completion => 'c',
        }
    }
}

/// The start of a key (at most as long as a key), for listing by prefix. Its range ends before
/// [`KeyPrefix::upper_bound`], so that a listing reads only the prefix's part of the index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyPrefix(String);

impl KeyPrefix {
    /// Empty is no prefix; otherwise the rules of a key.
    pub fn parse(raw: String) -> Result<Option<Self>, Invalid> {
        if raw.is_empty() {
            return Ok(None);
        }
        Key::parse(raw.clone())?;
        Ok(Some(Self(raw)))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The least string greater than every string that starts with this prefix, in byte order
    /// (which is code point order for UTF-8, the order of both stores' key columns): the prefix
    /// with its last character replaced by the next one. `None` when there is none (a prefix of
    /// U+10FFFF only).
    pub fn upper_bound(&self) -> Option<String> {
        let mut chars: Vec<char> = self.0.chars().collect();
        while let Some(last) = chars.pop() {
            let mut next = u32::from(last) + 1;
            // Surrogates are not characters: skip them.
            if (0xD800..=0xDFFF).contains(&next) {
                next = 0xE000;
            }
            if let Some(next) = char::from_u32(next) {
                chars.push(next);
                return Some(chars.into_iter().collect());
            }
        }
        None
    }
}

/// `raw`, a count of 1-`max`, or `default` when the caller says 0.
fn count_or_default(raw: u32, default: u32, max: u32) -> Result<u32, Invalid> {
    match raw {
        0 => Ok(default),
        1.. if raw <= max => Ok(raw),
        _ => Err(Invalid(format!(
            "must be 1-{max} (0 for {default}), got {raw}"
        ))),
    }
}

/// How many entries one page may hold: 1-1000, 100 when the caller says 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageSize(u32);

impl PageSize {
    pub const DEFAULT: u32 = 100;
    pub const MAX: u32 = 1000;

    pub fn parse(raw: u32) -> Result<Self, Invalid> {
        count_or_default(raw, Self::DEFAULT, Self::MAX).map(Self)
    }

    pub fn get(self) -> u32 {
        self.0
    }
}

/// Rows an erasure deletes per statement: 1-10000, 1000 when the caller says 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EraseBatch(u32);

impl EraseBatch {
    pub const DEFAULT: u32 = 1000;
    pub const MAX: u32 = 10_000;

    pub fn parse(raw: u32) -> Result<Self, Invalid> {
        count_or_default(raw, Self::DEFAULT, Self::MAX).map(Self)
    }

    pub fn get(self) -> u32 {
        self.0
    }
}

/// Why an operator changed something, for the audit trail: required, 1-1024 bytes of UTF-8
/// without control characters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reason(String);

impl Reason {
    pub const MAX_BYTES: usize = 1024;

    pub fn parse(raw: String) -> Result<Self, Invalid> {
        if raw.trim().is_empty() {
            return Err(Invalid::new("is required: say why, for the audit trail"));
        }
        super::values::at_most_bytes(raw.len(), Self::MAX_BYTES)?;
        if raw.chars().any(char::is_control) {
            return Err(Invalid::new("must not contain control characters"));
        }
        Ok(Self(raw))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Which keys of a namespace a listing asks for.
#[derive(Debug, Clone)]
pub struct KeyFilter {
    pub namespace: Scope,
    /// `None`: every state.
    pub state: Option<AdminKeyState>,
    pub key_prefix: Option<KeyPrefix>,
    /// Completed at or after this instant (only completed keys then match).
    pub completed_after: Option<Instant>,
    /// Completed before this instant (only completed keys then match).
    pub completed_before: Option<Instant>,
    /// Claimed at or after this instant (only keys in progress, live or stuck, then match).
    pub claimed_after: Option<Instant>,
    /// Claimed before this instant (only keys in progress then match).
    pub claimed_before: Option<Instant>,
}

impl KeyFilter {
    /// The order of the listing, which decides the index it reads (see [`ListOrder`]).
    pub fn order(&self) -> ListOrder {
        if self.key_prefix.is_some() {
            return ListOrder::Key;
        }
        match self.state {
            Some(state) if state.in_progress() => ListOrder::Lease,
            Some(_) => ListOrder::Completion,
            None if self.completed_after.is_some() || self.completed_before.is_some() => {
                ListOrder::Completion
            }
            None if self.in_progress_only() => ListOrder::Lease,
            None => ListOrder::Key,
        }
    }

    /// Whether the filter can match only completed keys.
    pub fn completed_only(&self) -> bool {
        self.state == Some(AdminKeyState::Completed)
            || self.completed_after.is_some()
            || self.completed_before.is_some()
    }

    /// Whether the filter can match only keys in progress (live or stuck): a state of them, or
    /// a claim time (the keys an operator asks "who holds it, since when" about; a completed
    /// key is found by its completion time).
    pub fn in_progress_only(&self) -> bool {
        self.state.is_some_and(AdminKeyState::in_progress)
            || self.claimed_after.is_some()
            || self.claimed_before.is_some()
    }
}

/// Where the next page starts: after the entry of this instant (by the listing's order: lease
/// expiry, completion; unused for key order) and key. Encoded for callers as an opaque
/// `page_token`, which names its order so that it is refused under another filter's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageCursor {
    pub order: ListOrder,
    pub at_micros: i64,
    pub key: String,
}

impl PageCursor {
    /// The cursor after `last`, a listing's last entry in `order`.
    pub fn after(order: ListOrder, last: &KeySummary) -> Self {
        let at = match order {
            ListOrder::Key => None,
            ListOrder::Lease => Some(last.lease_expires_at),
            ListOrder::Completion => last.completed_at,
        };
        Self {
            order,
            at_micros: at.map_or(0, |at| at.timestamp_micros()),
            key: last.key.clone(),
        }
    }

    pub fn encode(&self) -> String {
        format!(
            "{}{}.{}",
            self.order.tag(),
            self.at_micros,
            hex::encode(self.key.as_bytes())
        )
    }

    /// A token from [`PageCursor::encode`] for a listing in `order`.
    pub fn decode(token: &str, order: ListOrder) -> Result<Self, Invalid> {
        let bad = || {
            Invalid::new(
                "is not a page token of this listing (pass next_page_token back with the same filters)",
            )
        };
        let rest = token.strip_prefix(order.tag()).ok_or_else(bad)?;
        let (at, key) = rest.split_once('.').ok_or_else(bad)?;
        let at_micros: i64 = at.parse().map_err(|_| bad())?;
        let key = hex::decode(key).map_err(|_| bad())?;
        let key = String::from_utf8(key).map_err(|_| bad())?;
        Key::parse(key.clone()).map_err(|_| bad())?;
        Ok(Self {
            order,
            at_micros,
            key,
        })
    }
}

/// The cursor of the audit trail: the id of the last event of the previous page (newest first).
pub fn decode_audit_token(token: &str) -> Result<Option<i64>, Invalid> {
    if token.is_empty() {
        return Ok(None);
    }
    token
        .strip_prefix('a')
        .and_then(|id| id.parse::<i64>().ok())
        .filter(|id| *id > 0)
        .map(Some)
        .ok_or_else(|| Invalid::new("is not a page token of the audit trail"))
}

pub fn encode_audit_token(last_id: i64) -> String {
    format!("a{last_id}")
}

/// A stored key without its response and checkpoint bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeySummary {
    pub key: String,
    pub state: AdminKeyState,
    pub attempt: u32,
    pub lease_token: LeaseToken,
    pub attempt_id: Option<String>,
    pub lease_expires_at: Instant,
    pub completed_at: Option<Instant>,
    pub expires_at: Instant,
    pub retention: Duration,
    pub fingerprint: Vec<u8>,
    pub response_bytes: u64,
    pub checkpoint_bytes: Option<u64>,
    /// When the current (or last) claim took the key; `None` for a key claimed before the
    /// store recorded it.
    pub claimed_at: Option<Instant>,
    /// Who made that claim ([`super::Holder`]); `None` when callers are anonymous.
    pub holder: Option<String>,
    /// While the key is [`AdminKeyState::Released`]: who released it (as the audit trail names
    /// them) and when.
    pub released: Option<(String, Instant)>,
}

impl KeySummary {
    /// The record as the audit trail keeps it ("the record before").
    pub fn to_json(&self) -> String {
        serde_json::json!({
            "key": self.key,
            "state": self.state.name(),
            "attempt": self.attempt,
            "lease_token": self.lease_token.get(),
            "attempt_id": self.attempt_id,
            "lease_expires_at": instant_text(self.lease_expires_at),
            "completed_at": self.completed_at.map(instant_text),
            "expires_at": instant_text(self.expires_at),
            "retention_seconds": self.retention.as_secs(),
            "fingerprint_hex": hex::encode(&self.fingerprint),
            "response_bytes": self.response_bytes,
            "checkpoint_bytes": self.checkpoint_bytes,
            "claimed_at": self.claimed_at.map(instant_text),
            "holder": self.holder,
            "released_by": self.released.as_ref().map(|(by, _)| by),
            "released_at": self.released.as_ref().map(|(_, at)| instant_text(*at)),
        })
        .to_string()
    }
}

/// An instant as every JSON of the admin API and its CLI writes it: RFC 3339 in UTC with `Z`,
/// to the millisecond (the audit trail's records read like the listings).
pub fn instant_text(at: Instant) -> String {
    at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// A key's whole record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FullKey {
    pub summary: KeySummary,
    pub response: Option<Vec<u8>>,
    pub checkpoint: Option<Vec<u8>>,
}

/// One namespace's numbers, read at `read_at` by the database clock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamespaceStats {
    pub in_progress: u64,
    /// Stuck keys, the released ones not among them.
    pub stuck: u64,
    /// Keys released by an operator that no claim has taken since.
    pub released: u64,
    pub completed: u64,
    pub processed_events: u64,
    /// The stuck key whose lease ran out first, and when.
    pub oldest_stuck: Option<(String, Instant)>,
    pub stored_bytes: u64,
    pub read_at: Instant,
}

/// Stuck keys across all namespaces, for the gauges: how many (counted up to a cap, so that the
/// count reads a bounded part of the index) and how long ago the oldest one's lease ran out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StuckSummary {
    pub count: u64,
    pub oldest: Duration,
}

/// The admin actions the audit trail records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdminAction {
    ForceRelease,
    EraseKey,
    EraseNamespace,
    /// The end of a namespace's erasure, with what it erased.
    EraseNamespaceDone,
    /// A namespace moved to another cluster, or its move rolled back.
    MovePlacement,
}

impl AdminAction {
    pub fn name(self) -> &'static str {
        match self {
            Self::ForceRelease => "force_release",
            Self::EraseKey => "erase_key",
            Self::EraseNamespace => "erase_namespace",
            Self::EraseNamespaceDone => "erase_namespace_done",
            Self::MovePlacement => "move_placement",
        }
    }
}

/// Which audit events a page lists: those of a namespace, optionally of one key and of one
/// operator (as the trail names them).
#[derive(Debug, Clone)]
pub struct AuditFilter {
    pub namespace: Scope,
    pub key: Option<Key>,
    pub actor: Option<String>,
}

/// The longest operator name an audit filter takes (a certificate's subject can be long).
const ACTOR_MAX_BYTES: usize = 1024;

/// An operator to filter the audit trail by: empty for any, else as the trail names them.
pub fn parse_actor_filter(raw: String) -> Result<Option<String>, Invalid> {
    if raw.is_empty() {
        return Ok(None);
    }
    super::values::at_most_bytes(raw.len(), ACTOR_MAX_BYTES)?;
    Ok(Some(raw))
}

/// An audit event to record. The store stamps it with its clock and keeps it for `retention`.
#[derive(Debug, Clone)]
pub struct AuditEntry {
    pub actor: String,
    pub action: AdminAction,
    pub namespace: Scope,
    pub key: Option<Key>,
    pub reason: Reason,
    pub outcome_json: Option<String>,
    pub retention: Duration,
}

/// A recorded audit event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditEvent {
    pub id: i64,
    pub at: Instant,
    pub actor: String,
    pub action: String,
    pub namespace: String,
    pub key: Option<String>,
    pub reason: String,
    pub record_before_json: Option<String>,
    pub outcome_json: Option<String>,
}

/// What a ForceRelease found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ForceReleased {
    /// The key was in progress (live or stuck); its lease is revoked (a token nobody holds, the
    /// lease ended), so that the next claim takes it over. Recorded as audit event `audit_id`.
    /// (Boxed: a summary is large beside the other answers.)
    Released {
        before: Box<KeySummary>,
        audit_id: i64,
    },
    /// The key is completed: nothing changed, nothing recorded.
    Completed,
    /// The key is absent: nothing changed, nothing recorded.
    Absent,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_range_ends_at_the_next_character() {
        let prefix = |raw: &str| {
            KeyPrefix::parse(raw.to_owned())
                .expect("valid")
                .expect("non-empty")
        };
        assert_eq!(prefix("order-").upper_bound().as_deref(), Some("order."));
        assert_eq!(
            prefix("a\u{D7FF}").upper_bound().as_deref(),
            Some("a\u{E000}")
        );
        assert_eq!(prefix("a\u{10FFFF}").upper_bound().as_deref(), Some("b"));
        assert_eq!(prefix("\u{10FFFF}").upper_bound(), None);
        assert_eq!(KeyPrefix::parse(String::new()).expect("empty"), None);
    }

    #[test]
    fn bounded_values_refuse_what_is_out_of_bounds() {
        assert_eq!(PageSize::parse(0).expect("default").get(), 100);
        assert_eq!(PageSize::parse(1000).expect("max").get(), 1000);
        assert!(PageSize::parse(1001).is_err());
        assert_eq!(EraseBatch::parse(0).expect("default").get(), 1000);
        assert!(EraseBatch::parse(10_001).is_err());
        assert!(Reason::parse(String::new()).is_err());
        assert!(Reason::parse("  ".into()).is_err());
        assert!(Reason::parse("a\nb".into()).is_err());
        assert!(Reason::parse("x".repeat(1025)).is_err());
        assert!(Reason::parse("x".repeat(1024)).is_ok());
    }

    #[test]
    fn a_page_token_is_refused_under_another_order() {
        let cursor = PageCursor {
            order: ListOrder::Lease,
            at_micros: -5,
            key: "k/ü".into(),
        };
        let token = cursor.encode();
        assert_eq!(
            PageCursor::decode(&token, ListOrder::Lease).expect("round trip"),
            cursor
        );
        assert!(PageCursor::decode(&token, ListOrder::Key).is_err());
        assert!(PageCursor::decode("l1.zz", ListOrder::Lease).is_err());
        assert_eq!(decode_audit_token("a42").expect("ok"), Some(42));
        assert!(decode_audit_token("a0").is_err());
        assert!(decode_audit_token("42").is_err());
    }
}
