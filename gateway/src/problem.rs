//! The gateway's own answers: RFC 9457 `application/problem+json` documents, one `type` URI per
//! case (the draft's suggestion), listed in docs/gateway.md.

use std::time::Duration;

use bytes::Bytes;
use hyper::header::{CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use hyper::{Response, StatusCode};

use crate::body::{Body, full};

/// Every case the gateway answers itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Problem {
    KeyMissing,
    KeyRepeated,
    KeyMalformed,
    IdentityMissing,
    RequestTooLarge,
    RequestUnreadable,
    KeyReused,
    InProgress,
    LeaseLost,
    CoordinatorUnavailable,
    CoordinatorRefused,
    UpstreamUnreachable,
    UpstreamTimeout,
    ResponseNotReplayable,
    StoredResponseUnreadable,
}

/// The prefix of every problem `type`.
pub const TYPE_PREFIX: &str = "urn:idempotency-gateway:problem:";

impl Problem {
    pub fn status(self) -> StatusCode {
        match self {
            Self::KeyMissing
            | Self::KeyRepeated
            | Self::KeyMalformed
            | Self::IdentityMissing
            | Self::RequestUnreadable => StatusCode::BAD_REQUEST,
            Self::RequestTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            Self::InProgress | Self::LeaseLost => StatusCode::CONFLICT,
            Self::CoordinatorUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            Self::CoordinatorRefused
            | Self::ResponseNotReplayable
            | Self::StoredResponseUnreadable => StatusCode::INTERNAL_SERVER_ERROR,
            Self::UpstreamUnreachable => StatusCode::BAD_GATEWAY,
            Self::UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
        }
    }

    /// The last part of the `type` URI.
    pub fn slug(self) -> &'static str {
        match self {
            Self::KeyMissing => "key-missing",
            Self::KeyRepeated => "key-repeated",
            Self::KeyMalformed => "key-malformed",
            Self::IdentityMissing => "identity-missing",
            Self::RequestTooLarge => "request-too-large",
            Self::RequestUnreadable => "request-unreadable",
            Self::KeyReused => "key-reused",
            Self::InProgress => "in-progress",
            Self::LeaseLost => "lease-lost",
            Self::CoordinatorUnavailable => "coordinator-unavailable",
            Self::CoordinatorRefused => "coordinator-refused",
            Self::UpstreamUnreachable => "upstream-unreachable",
            Self::UpstreamTimeout => "upstream-timeout",
            Self::ResponseNotReplayable => "response-not-replayable",
            Self::StoredResponseUnreadable => "stored-response-unreadable",
        }
    }

    fn title(self) -> &'static str {
        match self {
            Self::KeyMissing => "An idempotency key is required",
            Self::KeyRepeated => "The idempotency key header appears more than once",
            Self::KeyMalformed => "The idempotency key is malformed",
            Self::IdentityMissing => "The caller's identity header is missing",
            Self::RequestTooLarge => "The request body is too large",
            Self::RequestUnreadable => "The request body could not be read",
            Self::KeyReused => "The idempotency key was used for a different request",
            Self::InProgress => "A request with this idempotency key is being processed",
            Self::LeaseLost => "The request's claim on the key was lost",
            Self::CoordinatorUnavailable => "The idempotency coordinator is unavailable",
            Self::CoordinatorRefused => "The idempotency coordinator refused the gateway",
            Self::UpstreamUnreachable => "The upstream could not be reached",
            Self::UpstreamTimeout => "The upstream did not answer in time",
            Self::ResponseNotReplayable => "The response to this key cannot be replayed",
            Self::StoredResponseUnreadable => "The stored response cannot be read",
        }
    }

    /// The problem document, with `detail`, and `Retry-After` when given (whole seconds,
    /// rounded up, at least 1).
    pub fn response(self, detail: &str, retry_after: Option<Duration>) -> Response<Body> {
        self.response_with(detail, retry_after, serde_json::Map::new())
    }

    /// Like [`Problem::response`], with extension members.
    pub fn response_with(
        self,
        detail: &str,
        retry_after: Option<Duration>,
        mut members: serde_json::Map<String, serde_json::Value>,
    ) -> Response<Body> {
        let status = self.status();
        members.insert(
            "type".into(),
            format!("{TYPE_PREFIX}{}", self.slug()).into(),
        );
        members.insert("title".into(), self.title().into());
        members.insert("status".into(), status.as_u16().into());
        members.insert("detail".into(), detail.into());
        let body = serde_json::Value::Object(members).to_string();
        let mut response = Response::new(full(Bytes::from(body)));
        *response.status_mut() = status;
        response.headers_mut().insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(after) = retry_after {
            response
                .headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(retry_after_seconds(after)));
        }
        response
    }
}

/// `Retry-After` in whole seconds: rounded up, at least 1 (0 would invite a busy loop).
pub fn retry_after_seconds(after: Duration) -> u64 {
    let seconds = after.as_secs() + u64::from(after.subsec_nanos() > 0);
    seconds.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        assert_eq!(retry_after_seconds(Duration::ZERO), 1);
        assert_eq!(retry_after_seconds(Duration::from_millis(1)), 1);
        assert_eq!(retry_after_seconds(Duration::from_millis(1001)), 2);
        assert_eq!(retry_after_seconds(Duration::from_secs(3)), 3);
    }

    #[test]
    fn every_problem_has_its_own_type() {
        let all = [
            Problem::KeyMissing,
            Problem::KeyRepeated,
            Problem::KeyMalformed,
            Problem::IdentityMissing,
            Problem::RequestTooLarge,
            Problem::RequestUnreadable,
            Problem::KeyReused,
            Problem::InProgress,
            Problem::LeaseLost,
            Problem::CoordinatorUnavailable,
            Problem::CoordinatorRefused,
            Problem::UpstreamUnreachable,
            Problem::UpstreamTimeout,
            Problem::ResponseNotReplayable,
            Problem::StoredResponseUnreadable,
        ];
        let slugs: std::collections::HashSet<_> = all.iter().map(|p| p.slug()).collect();
        assert_eq!(slugs.len(), all.len());
    }
}
