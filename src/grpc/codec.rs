//! The protobuf codec of `idempotency.v1`: prost's, except that a message the decoder refuses
//! (invalid UTF-8 in a string, a truncated message, a wrong wire type) is `INVALID_ARGUMENT` with
//! ErrorInfo reason `INVALID_ARGUMENT`, as the contract has it. tonic-prost answers such a
//! message `INTERNAL`, which this service reserves for its own bugs: monitoring that pages on
//! `INTERNAL` must not page on a client's garbage.
//!
//! `build.rs` names this codec for the generated code (`codec_path`), so the generated client
//! uses it too: there, a response that does not decode is reported the same way.

use std::marker::PhantomData;

use prost::Message;
use tonic::Status;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic_prost::{ProstDecoder, ProstEncoder};

#[derive(Debug, Clone)]
pub struct ApiCodec<T, U> {
    _messages: PhantomData<(T, U)>,
}

impl<T, U> Default for ApiCodec<T, U> {
    fn default() -> Self {
        Self {
            _messages: PhantomData,
        }
    }
}

impl<T, U> Codec for ApiCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = ApiDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::default()
    }

    fn decoder(&mut self) -> Self::Decoder {
        ApiDecoder {
            _message: PhantomData,
        }
    }
}

#[derive(Debug, Clone)]
pub struct ApiDecoder<U> {
    _message: PhantomData<U>,
}

impl<U: Message + Default> Decoder for ApiDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        match U::decode(buf) {
            Ok(message) => Ok(Some(message)),
            Err(error) => {
                tracing::debug!(%error, "a message could not be decoded");
                Err(super::status::undecodable())
            }
        }
    }

    fn buffer_settings(&self) -> BufferSettings {
        ProstDecoder::<U>::default().buffer_settings()
    }
}
