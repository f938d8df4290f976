//! The commands the service runs, built at the gRPC edge from validated values, and who calls:
//! past the edge, each RPC is one of these and nothing raw.

use super::{
    AttemptId, Checkpoint, EventId, EventRetention, Fingerprint, Key, KeyRetention, LeaseToken,
    LeaseTtl, ResponseBody, Scope,
};

/// The server's defaults for fields a caller may leave out, and its response limit.
#[derive(Debug, Clone)]
pub struct Limits {
    pub default_lease_ttl: LeaseTtl,
    pub default_key_retention: KeyRetention,
    pub default_event_retention: EventRetention,
    pub max_response_bytes: usize,
}

#[derive(Debug, Clone)]
pub struct TryStartCommand {
    pub namespace: Scope,
    pub key: Key,
    pub fingerprint: Fingerprint,
    pub lease_ttl: LeaseTtl,
    pub retention: KeyRetention,
    pub attempt_id: Option<AttemptId>,
    /// Who calls, recorded with a claim for the admin API; `None` for an anonymous caller.
    pub holder: Option<Holder>,
}

/// Who made a claim or an admin change, as the admin API and the audit trail show it:
/// `token:<name>` for a caller with a token, `cert:<subject>` for one known by its client
/// certificate, `loopback` for an anonymous admin caller on loopback. At most
/// [`Holder::MAX_BYTES`] (a longer name is cut at a character boundary): a certificate's
/// subject is the client's to choose. Cheap to clone: every call of a caller shares one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder(std::sync::Arc<str>);

impl Holder {
    pub const MAX_BYTES: usize = 512;

    pub fn token(name: &str) -> Self {
        Self::named("token:", name)
    }

    pub fn certificate(subject: &str) -> Self {
        Self::named("cert:", subject)
    }

    pub fn loopback() -> Self {
        Self::named("loopback", "")
    }

    fn named(kind: &str, name: &str) -> Self {
        let mut whole = String::with_capacity(kind.len() + name.len());
        whole.push_str(kind);
        for character in name.chars() {
            if whole.len() + character.len_utf8() > Self::MAX_BYTES {
                break;
            }
            // A subject may carry anything; a log or a table must not get control characters.
            whole.push(if character.is_control() {
                '?'
            } else {
                character
            });
        }
        Self(whole.into())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryStartCommand {
    /// Whether this call is the attempt `holder_attempt_id` names, which re-enters its claim. An
    /// absent attempt_id (the empty one) never matches, not even another absent one.
    pub fn is_attempt(&self, holder_attempt_id: Option<&str>) -> bool {
        matches!(
            (&self.attempt_id, holder_attempt_id),
            (Some(asked), Some(holder)) if asked.as_str() == holder
        )
    }
}

#[derive(Debug, Clone)]
pub struct CompleteCommand {
    pub namespace: Scope,
    pub key: Key,
    pub lease_token: LeaseToken,
    pub response: ResponseBody,
    /// `None`: keep the key for the retention it was claimed with.
    pub retention: Option<KeyRetention>,
}

#[derive(Debug, Clone)]
pub struct ReleaseCommand {
    pub namespace: Scope,
    pub key: Key,
    pub lease_token: LeaseToken,
}

#[derive(Debug, Clone)]
pub struct ExtendLeaseCommand {
    pub namespace: Scope,
    pub key: Key,
    pub lease_token: LeaseToken,
    pub lease_ttl: LeaseTtl,
    /// `None` keeps the stored checkpoint; `Some`, even empty, replaces it.
    pub checkpoint: Option<Checkpoint>,
}

#[derive(Debug, Clone)]
pub struct LookupQuery {
    pub namespace: Scope,
    pub key: Key,
}

#[derive(Debug, Clone)]
pub struct MarkProcessedCommand {
    pub consumer: Scope,
    /// 1-1000 ids in request order, duplicates included.
    pub event_ids: Vec<EventId>,
    pub retention: EventRetention,
}
