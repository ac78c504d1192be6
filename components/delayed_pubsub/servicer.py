"""dapr.proto.components.v1.PubSub over the Instances registry.

This module only translates protobuf ⇄ domain objects and maps the error
hierarchy to gRPC status codes (answers_errors); the work happens in instance/ and broker.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, TypeAlias, TypeVar

import grpc

from delayed_middleware.entry import StreamEntry
from delayed_middleware.errors import (
    BackendAuthError,
    BackendUnavailableError,
    DelayedPubSubError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotInitializedError,
)
from delayed_pubsub.admission import AdmissionControl
from delayed_pubsub.broker import BulkEntry
from delayed_pubsub.instance import Instance, Instances
from delayed_pubsub.subscription import Subscription
from delayed_pubsub.wire import Responses
from delayed_pubsub_pb.dapr.proto.components.v1 import common_pb2, pubsub_pb2, pubsub_pb2_grpc

log = logging.getLogger(__name__)

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"

INSTANCE_METADATA_KEY = "x-component-instance"

# What daprd should rely on. BULK_PUBSUB: BulkPublish is one pipelined round
# trip. MESSAGE_TTL: we enforce ttlInSeconds/ttl ourselves (stream, delay
# index, redeliveries, raw payloads too), so daprd does not; it would only
# handle CloudEvents, and not a delayed message's time in the index.
FEATURES = ("BULK_PUBSUB", "MESSAGE_TTL")

_STATUS: tuple[tuple[type[DelayedPubSubError], grpc.StatusCode], ...] = (
    (InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT),
    (NotInitializedError, grpc.StatusCode.FAILED_PRECONDITION),
    (FailedPreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (BackendAuthError, grpc.StatusCode.PERMISSION_DENIED),
    (BackendUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (DelayedPubSubError, grpc.StatusCode.INTERNAL),
)


def status_code(error: DelayedPubSubError) -> grpc.StatusCode:
    """The gRPC status code for one of our errors."""
    return next(code for cls, code in _STATUS if isinstance(error, cls))


# The status message travels in a trailer, and gRPC refuses trailers over 8 KiB
# by default (RESOURCE_EXHAUSTED at the client, the real code lost). Anything
# echoed into a message (a topic, a Redis reply) is cut well below that.
MAX_STATUS_MESSAGE_CHARS = 2048


def status_message(error: DelayedPubSubError) -> str:
    """The error's message, cut to MAX_STATUS_MESSAGE_CHARS."""
    text = str(error)
    if len(text) <= MAX_STATUS_MESSAGE_CHARS:
        return text
    return f"{text[:MAX_STATUS_MESSAGE_CHARS]}...({len(text.encode())} bytes)"


async def _abort(context: Context, error: DelayedPubSubError) -> NoReturn:
    code = status_code(error)
    message = status_message(error)
    if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.PERMISSION_DENIED):
        log.warning("%s: %s", code.name, message)
    await context.abort(code, message)


_Self = TypeVar("_Self")
_Request = TypeVar("_Request")
_Reply = TypeVar("_Reply")


def answers_errors(
    method: Callable[[_Self, _Request, Context], Awaitable[_Reply]],
) -> Callable[[_Self, _Request, Context], Awaitable[_Reply]]:
    """Answer a call that raised one of our errors with its status (status_code, status_message).

    Anything else is left to grpc.aio (an unexpected exception is UNKNOWN, as before):
    only the error hierarchy has a table.
    """

    @functools.wraps(method)
    async def answered(self: _Self, request: _Request, context: Context) -> _Reply:
        try:
            return await method(self, request, context)
        except DelayedPubSubError as e:
            await _abort(context, e)

    return answered


def instance_name(context: Context) -> str:
    """The component instance a call is for (the YAML metadata.name); "" if daprd sent none."""
    for key, value in context.invocation_metadata() or ():
        if key == INSTANCE_METADATA_KEY:
            return value if isinstance(value, str) else value.decode()
    return ""


class PubSubServicer(pubsub_pb2_grpc.PubSubServicer):
    """The PubSub service daprd drives."""

    def __init__(self, instances: Instances, admission: AdmissionControl | None = None) -> None:
        self._instances = instances
        # Publishes past an instance's bound are refused here, in the call's own task
        # (admission.py), not by an interceptor every call of every method would pay for.
        self._admission = admission if admission is not None else AdmissionControl()

    @contextlib.asynccontextmanager
    async def _admitted(self, context: Context) -> AsyncIterator[Instance]:
        """The call's instance, holding a slot of its admission for the block; RESOURCE_EXHAUSTED,
        naming the bound, past it. Used in methods that answer our errors (answers_errors)."""
        instance = self._instances.find(instance_name(context))
        if instance is None:
            instance = await self._instance(context)
        admission = instance.admission
        if not self._admission.admit(admission):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, admission.refusal())
        try:
            yield instance
        finally:
            # However the call ends (answered, failed, cancelled by the client).
            admission.leave()

    async def _instance(self, context: Context) -> Instance:
        # Restored from its Init record when this process has not seen daprd's
        # Init (the component restarted under a running daprd).
        return await self._instances.ready(instance_name(context))

    @answers_errors
    async def Init(
        self, request: pubsub_pb2.PubSubInitRequest, context: Context
    ) -> pubsub_pb2.PubSubInitResponse:
        await self._instances.init(instance_name(context), dict(request.metadata.properties))
        return pubsub_pb2.PubSubInitResponse()

    @answers_errors
    async def Features(
        self, request: common_pb2.FeaturesRequest, context: Context
    ) -> common_pb2.FeaturesResponse:
        # The instance this process has (no coroutine for it), else restored from its record.
        if self._instances.find(instance_name(context)) is None:
            await self._instance(context)
        return common_pb2.FeaturesResponse(features=FEATURES)

    @answers_errors
    async def Publish(
        self, request: pubsub_pb2.PublishRequest, context: Context
    ) -> pubsub_pb2.PublishResponse:
        async with self._admitted(context) as instance:
            # The publish path itself (not Instance.publish): one coroutine less per call.
            await instance.publisher.publish(
                request.topic, request.data, request.metadata, request.content_type
            )
        return pubsub_pb2.PublishResponse()

    @answers_errors
    async def BulkPublish(
        self, request: pubsub_pb2.BulkPublishRequest, context: Context
    ) -> pubsub_pb2.BulkPublishResponse:
        # Admitted before the entries are read: a refusal costs as little as it can.
        async with self._admitted(context) as instance:
            # {k: md[k] for k in md}, not dict(md): dict() reads a protobuf map
            # through the pure-Python KeysView (~40% more per entry of a bulk).
            entries = [
                BulkEntry(e.entry_id, StreamEntry(e.event, {k: md[k] for k in md}, e.content_type))
                for e in request.entries
                for md in (e.metadata,)
            ]
            failed = await instance.publisher.bulk_publish(request.topic, entries, request.metadata)
        return pubsub_pb2.BulkPublishResponse(
            failed_entries=[
                pubsub_pb2.BulkPublishResponseFailedEntry(entry_id=f.entry_id, error=f.error) for f in failed
            ]
        )

    async def PullMessages(
        self,
        request_iterator: AsyncIterator[pubsub_pb2.PullMessagesRequest],
        context: Context,
    ) -> AsyncIterator[bytes]:
        """daprd's stream: each PullMessagesResponse, serialised, as the subscription hands the
        message out; daprd's acks and nacks read meanwhile (_pump_acks)."""
        # A stream is held by gRPC but is no queue: admission control leaves it out
        # until the call's task ends, however it ends.
        task = asyncio.current_task()
        if task is not None:
            self._admission.stream_started()
            task.add_done_callback(self._admission.stream_ended)
        opened = await self._subscribed(request_iterator, context)
        if opened is None:
            return
        instance, sub = opened
        acks = asyncio.create_task(_pump_acks(request_iterator, sub), name=f"acks {sub.consumer}")
        # Each message serialised by hand (wire.py); server.py registers this stream with
        # a serializer that passes bytes through.
        response = Responses(sub.topic)
        try:
            async for d in sub.deliveries():
                yield response(d)
        finally:
            acks.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await acks
            await self._instances.unsubscribe(instance, sub)

    @answers_errors
    async def _subscribed(
        self, request_iterator: AsyncIterator[pubsub_pb2.PullMessagesRequest], context: Context
    ) -> tuple[Instance, Subscription] | None:
        """A PullMessages stream's instance and its open subscription (None if daprd closed
        the stream before naming a topic); our errors end the stream with their status."""
        name = instance_name(context)
        instance = await self._instance(context)
        first = await anext(request_iterator, None)
        if first is None:
            return None
        sub = await self._instances.subscribe(name, instance, first.topic.name, dict(first.topic.metadata))
        return instance, sub

    @answers_errors
    async def Pause(self, request: pubsub_pb2.PauseRequest, context: Context) -> pubsub_pb2.PauseResponse:
        (await self._instance(context)).pause()
        return pubsub_pb2.PauseResponse()

    @answers_errors
    async def Resume(self, request: pubsub_pb2.ResumeRequest, context: Context) -> pubsub_pb2.ResumeResponse:
        (await self._instance(context)).resume()
        return pubsub_pb2.ResumeResponse()

    @answers_errors
    async def Ping(self, request: common_pb2.PingRequest, context: Context) -> common_pb2.PingResponse:
        await (await self._instance(context)).ping()
        return common_pb2.PingResponse()


async def _pump_acks(requests: AsyncIterator[pubsub_pb2.PullMessagesRequest], sub: Subscription) -> None:
    """Apply daprd's acks; when daprd closes its side, stop the subscription (ending the stream).

    Acks are queued, not awaited: the subscription XACKs everything that came
    in meanwhile in one command, so reading the next ack never waits on Redis.
    """
    try:
        async for request in requests:
            entry_id = request.ack_message_id
            if entry_id:
                if request.HasField("ack_error"):
                    sub.nack(entry_id, request.ack_error.message)
                else:
                    sub.ack_nowait(entry_id)
            if sub.closed:
                # The subscription's state, not only cancellation, ends this loop.
                break
    except grpc.aio.AioRpcError:
        pass  # the call is going away; the handler's finally cleans up
    finally:
        sub.stop()
