"""The typed boundary over the generated messages: the service's methods, bound to a channel.

grpcio-tools' `_pb2_grpc` module would import the messages by their proto path
(`idempotency.v1`), which is not where this package keeps them; six method handles are simpler
than rewriting its imports, and typing them here keeps the generated code out of `mypy --strict`.
"""

from __future__ import annotations

import grpc
import grpc.aio

from ._proto.idempotency.v1 import idempotency_pb2 as pb

_SERVICE = "/idempotency.v1.IdempotencyService/"


class Stub:
    """The six RPCs on a sync channel."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.try_start = channel.unary_unary(
            _SERVICE + "TryStart",
            request_serializer=pb.TryStartRequest.SerializeToString,
            response_deserializer=pb.TryStartResponse.FromString,
        )
        self.complete = channel.unary_unary(
            _SERVICE + "Complete",
            request_serializer=pb.CompleteRequest.SerializeToString,
            response_deserializer=pb.CompleteResponse.FromString,
        )
        self.release = channel.unary_unary(
            _SERVICE + "Release",
            request_serializer=pb.ReleaseRequest.SerializeToString,
            response_deserializer=pb.ReleaseResponse.FromString,
        )
        self.extend_lease = channel.unary_unary(
            _SERVICE + "ExtendLease",
            request_serializer=pb.ExtendLeaseRequest.SerializeToString,
            response_deserializer=pb.ExtendLeaseResponse.FromString,
        )
        self.lookup = channel.unary_unary(
            _SERVICE + "Lookup",
            request_serializer=pb.LookupRequest.SerializeToString,
            response_deserializer=pb.LookupResponse.FromString,
        )
        self.mark_processed = channel.unary_unary(
            _SERVICE + "MarkProcessed",
            request_serializer=pb.MarkProcessedRequest.SerializeToString,
            response_deserializer=pb.MarkProcessedResponse.FromString,
        )


class AsyncStub:
    """The six RPCs on an asyncio channel."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.try_start = channel.unary_unary(
            _SERVICE + "TryStart",
            request_serializer=pb.TryStartRequest.SerializeToString,
            response_deserializer=pb.TryStartResponse.FromString,
        )
        self.complete = channel.unary_unary(
            _SERVICE + "Complete",
            request_serializer=pb.CompleteRequest.SerializeToString,
            response_deserializer=pb.CompleteResponse.FromString,
        )
        self.release = channel.unary_unary(
            _SERVICE + "Release",
            request_serializer=pb.ReleaseRequest.SerializeToString,
            response_deserializer=pb.ReleaseResponse.FromString,
        )
        self.extend_lease = channel.unary_unary(
            _SERVICE + "ExtendLease",
            request_serializer=pb.ExtendLeaseRequest.SerializeToString,
            response_deserializer=pb.ExtendLeaseResponse.FromString,
        )
        self.lookup = channel.unary_unary(
            _SERVICE + "Lookup",
            request_serializer=pb.LookupRequest.SerializeToString,
            response_deserializer=pb.LookupResponse.FromString,
        )
        self.mark_processed = channel.unary_unary(
            _SERVICE + "MarkProcessed",
            request_serializer=pb.MarkProcessedRequest.SerializeToString,
            response_deserializer=pb.MarkProcessedResponse.FromString,
        )
