//! What the gateway stores in the coordinator for a completed key: the upstream's status,
//! headers (minus hop-by-hop ones) and body, or, for a response too large to keep, a marker
//! with its status and headers only.
//!
//! The encoding is binary and versioned, since headers are bytes and the body anything:
//! `kind` (1 byte: 1 response, 2 too large to keep), status (u16), the number of headers
//! (u16), each header's name (u16 length + bytes) and value (u32 length + bytes), then the body
//! (the rest, empty for the marker). All numbers big-endian.

use bytes::Bytes;
use hyper::header::{HeaderName, HeaderValue};
use hyper::{HeaderMap, StatusCode};
use idempotency_client::{BoxError, Codec};

const KIND_RESPONSE: u8 = 1;
const KIND_TOO_LARGE: u8 = 2;

/// A response as the gateway stores and replays it.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
    /// The body was larger than the storable limit: only the status and headers are kept, and
    /// a replay answers that the response cannot be replayed.
    pub too_large: bool,
}

impl Record {
    /// How many bytes the record takes once encoded.
    pub fn encoded_len(status_and_headers: &HeaderMap, body: usize) -> usize {
        let headers: usize = status_and_headers
            .iter()
            .map(|(name, value)| 2 + name.as_str().len() + 4 + value.len())
            .sum();
        1 + 2 + 2 + headers + body
    }
}

/// The codec the gateway gives `run_once`: [`Record`]s to bytes and back.
#[derive(Debug, Clone, Copy, Default)]
pub struct RecordCodec;

impl Codec<Record> for RecordCodec {
    fn encode(&self, record: &Record) -> Result<Vec<u8>, BoxError> {
        let body: &[u8] = if record.too_large { &[] } else { &record.body };
        let mut out = Vec::with_capacity(Record::encoded_len(&record.headers, body.len()));
        out.push(if record.too_large {
            KIND_TOO_LARGE
        } else {
            KIND_RESPONSE
        });
        out.extend_from_slice(&record.status.as_u16().to_be_bytes());
        out.extend_from_slice(&u16::try_from(record.headers.len())?.to_be_bytes());
        for (name, value) in &record.headers {
            out.extend_from_slice(&u16::try_from(name.as_str().len())?.to_be_bytes());
            out.extend_from_slice(name.as_str().as_bytes());
            out.extend_from_slice(&u32::try_from(value.len())?.to_be_bytes());
            out.extend_from_slice(value.as_bytes());
        }
        out.extend_from_slice(body);
        Ok(out)
    }

    fn decode(&self, bytes: &[u8]) -> Result<Record, BoxError> {
        let mut input = Reader(bytes);
        let too_large = match input.take(1)? {
            [KIND_RESPONSE] => false,
            [KIND_TOO_LARGE] => true,
            _ => return Err("not a response stored by the gateway".into()),
        };
        let status = StatusCode::from_u16(input.u16()?)?;
        let count = input.u16()?;
        let mut headers = HeaderMap::with_capacity(usize::from(count));
        for _ in 0..count {
            let name_len = usize::from(input.u16()?);
            let name = HeaderName::from_bytes(input.take(name_len)?)?;
            let value_len = usize::try_from(input.u32()?)?;
            let value = HeaderValue::from_bytes(input.take(value_len)?)?;
            headers.append(name, value);
        }
        Ok(Record {
            status,
            headers,
            body: Bytes::copy_from_slice(input.0),
            too_large,
        })
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], BoxError> {
        if self.0.len() < n {
            return Err("the stored response is truncated".into());
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u16(&mut self) -> Result<u16, BoxError> {
        let bytes = self.take(2)?;
        Ok(u16::from_be_bytes([bytes[0], bytes[1]]))
    }

    fn u32(&mut self) -> Result<u32, BoxError> {
        let bytes = self.take(4)?;
        Ok(u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(too_large: bool) -> Record {
        let mut headers = HeaderMap::new();
        headers.append("content-type", HeaderValue::from_static("application/json"));
        headers.append("set-cookie", HeaderValue::from_static("a=1"));
        headers.append("set-cookie", HeaderValue::from_static("b=2"));
        headers.append(
            "x-bytes",
            HeaderValue::from_bytes(b"\xff\x80").expect("opaque"),
        );
        Record {
            status: StatusCode::CREATED,
            headers,
            body: Bytes::from_static(b"{\"id\":1}\x00\xff"),
            too_large,
        }
    }

    #[test]
    fn a_record_survives_encoding_byte_for_byte() {
        let original = record(false);
        let encoded = RecordCodec.encode(&original).expect("encodes");
        assert_eq!(
            encoded.len(),
            Record::encoded_len(&original.headers, original.body.len())
        );
        let decoded = RecordCodec.decode(&encoded).expect("decodes");
        assert_eq!(decoded, original);
        let values: Vec<_> = decoded.headers.get_all("set-cookie").iter().collect();
        assert_eq!(values, ["a=1", "b=2"], "repeated headers keep their order");
    }

    #[test]
    fn a_too_large_marker_keeps_no_body() {
        let encoded = RecordCodec.encode(&record(true)).expect("encodes");
        let decoded = RecordCodec.decode(&encoded).expect("decodes");
        assert!(decoded.too_large);
        assert!(decoded.body.is_empty());
        assert_eq!(decoded.status, StatusCode::CREATED);
    }

    #[test]
    fn foreign_or_truncated_bytes_are_refused() {
        assert!(RecordCodec.decode(b"").is_err());
        assert!(RecordCodec.decode(b"{\"json\":1}").is_err());
        let encoded = RecordCodec.encode(&record(false)).expect("encodes");
        assert!(RecordCodec.decode(&encoded[..10]).is_err());
    }
}
