"""The typed boundary over the generated messages: the service's methods, bound to a channel.

grpcio-tools' `_pb2_grpc` module would import the messages by their proto path
(`idempotency.v1`), which is not where this package keeps them; six method handles are simpler
than rewriting its imports, and typing them here keeps the generated code out of `mypy --strict`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import grpc
import grpc.aio
from google.protobuf.message import Message

from ._proto.idempotency.v1 import idempotency_pb2 as pb

Request = TypeVar("Request", bound=Message)
Response = TypeVar("Response", bound=Message)


@dataclass(frozen=True)
class Method(Generic[Request, Response]):
    """One of the service's RPCs: its name and the messages it takes and answers, bound to a sync
    or an asyncio channel alike."""

    name: str
    request: type[Request]
    response: type[Response]

    @property
    def path(self) -> str:
        return f"/idempotency.v1.IdempotencyService/{self.name}"

    def on(self, channel: grpc.Channel) -> grpc.UnaryUnaryMultiCallable[Request, Response]:
        return channel.unary_unary(
            self.path,
            request_serializer=self.request.SerializeToString,
            response_deserializer=self.response.FromString,
        )

    def on_aio(
        self, channel: grpc.aio.Channel
    ) -> grpc.aio.UnaryUnaryMultiCallable[Request, Response]:
        return channel.unary_unary(
            self.path,
            request_serializer=self.request.SerializeToString,
            response_deserializer=self.response.FromString,
        )


TRY_START = Method("TryStart", pb.TryStartRequest, pb.TryStartResponse)
COMPLETE = Method("Complete", pb.CompleteRequest, pb.CompleteResponse)
RELEASE = Method("Release", pb.ReleaseRequest, pb.ReleaseResponse)
EXTEND_LEASE = Method("ExtendLease", pb.ExtendLeaseRequest, pb.ExtendLeaseResponse)
LOOKUP = Method("Lookup", pb.LookupRequest, pb.LookupResponse)
MARK_PROCESSED = Method("MarkProcessed", pb.MarkProcessedRequest, pb.MarkProcessedResponse)
METHODS = (TRY_START, COMPLETE, RELEASE, EXTEND_LEASE, LOOKUP, MARK_PROCESSED)


class Stub:
    """The six RPCs on a sync channel, one attribute each: for code that sends them itself (the
    tests, the orders example); the clients send theirs through `Method`."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.try_start = TRY_START.on(channel)
        self.complete = COMPLETE.on(channel)
        self.release = RELEASE.on(channel)
        self.extend_lease = EXTEND_LEASE.on(channel)
        self.lookup = LOOKUP.on(channel)
        self.mark_processed = MARK_PROCESSED.on(channel)
