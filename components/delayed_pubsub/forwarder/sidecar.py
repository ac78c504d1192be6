"""The sidecar side of a forwarder: daprd's gRPC API, one publish call per hand-off job.

The `dapr` SDK's generated stubs on a plain grpc.aio channel: the SDK's DaprClient
would first wait for daprd's HTTP health port, and only the gRPC address is known here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from typing import Any, Final

import grpc
import grpc.aio
from dapr.proto.runtime.v1 import dapr_pb2_grpc, pubsub_pb2

from delayed_middleware.clock import Clock
from delayed_middleware.outbox import OutboxEntry
from delayed_middleware.publish_keys import TTL_IN_SECONDS
from delayed_middleware.target import forwarded_metadata
from delayed_pubsub.forwarder.config import ForwarderConfig
from delayed_pubsub.forwarder.holding import Job
from delayed_pubsub.metrics import ForwarderMetrics

# The name logs have always carried (log queries and alerts key on it), whichever file of the package writes.
log = logging.getLogger("delayed_pubsub.forwarder")

# daprd publishes the bytes as they are (no second CloudEvent around ours).
RAW_PAYLOAD: Final = "rawPayload"
CLOUDEVENT_CONTENT_TYPE: Final = "application/cloudevents+json"
# While daprd stays away, one warning per this many seconds (each hand-off retries on its own).
_DOWN_LOG_EVERY_S: Final = 10.0


class SidecarUnavailableError(Exception):
    """daprd's gRPC API cannot be reached (internal: retried without counting)."""


class Sidecar:
    """daprd's gRPC API as one forwarder calls it: the channel, the publish call, and whether
    daprd answers (one warning per while it does not)."""

    def __init__(
        self, config: ForwarderConfig, clock: Clock, metrics: ForwarderMetrics | None, *, name: str
    ) -> None:
        self._config = config
        self._clock = clock
        self._metrics = metrics
        self._name = name
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None
        self._call_md: tuple[tuple[str, str], ...] = (
            (("dapr-api-token", config.api_token),) if config.api_token else ()
        )
        # When the sidecar stopped answering (loop time), for one warning per while.
        self._down_since: float | None = None
        self._down_logged = 0.0

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close(None)
            self._channel = None
            self._stub = None

    def _dapr(self) -> Any:
        if self._stub is None:
            cap_ms = int(self._config.sidecar_backoff_cap_s * 1000)
            self._channel = grpc.aio.insecure_channel(
                self._config.address,
                # gRPC's own reconnect backoff grows to 120 s: after a long daprd
                # restart hand-offs would wait that long for it. Ours is the cap.
                options=[
                    ("grpc.initial_reconnect_backoff_ms", min(1000, cap_ms)),
                    ("grpc.max_reconnect_backoff_ms", cap_ms),
                ],
            )
            self._stub = dapr_pb2_grpc.DaprStub(self._channel)  # type: ignore[no-untyped-call]
        return self._stub

    def _message_metadata(self, entry: OutboxEntry, now_ms: int) -> dict[str, str]:
        metadata = forwarded_metadata(entry.metadata)
        if entry.expires_at_ms:
            metadata[TTL_IN_SECONDS] = str(max(1, math.ceil((entry.expires_at_ms - now_ms) / 1000)))
        return metadata

    async def publish(self, job: Job) -> None:
        """Publish one job; fills job.failed with what daprd refused; raises
        SidecarUnavailableError when daprd cannot be reached at all."""
        stub, now = self._dapr(), self._clock.now_ms()
        head = job.head
        job.failed = []
        try:
            if len(job.entries) == 1 and not head.bulk:
                metadata = self._message_metadata(head, now)
                metadata[RAW_PAYLOAD] = "true"
                await stub.PublishEvent(
                    pubsub_pb2.PublishEventRequest(
                        pubsub_name=head.pubsub,
                        topic=head.topic,
                        data=head.data,
                        data_content_type=_content_type(head),
                        metadata=metadata,
                    ),
                    timeout=self._config.call_timeout_s,
                    metadata=self._call_md,
                )
                return
            request = pubsub_pb2.BulkPublishRequest(
                pubsub_name=head.pubsub,
                topic=head.topic,
                entries=[
                    pubsub_pb2.BulkPublishRequestEntry(
                        # The outbox stream id: unique within the call, and the
                        # key by which a partial failure names its entries.
                        entry_id=i,
                        event=e.data,
                        content_type=_content_type(e),
                        metadata=self._message_metadata(e, now),
                    )
                    for i, e in zip(job.ids, job.entries, strict=True)
                ],
                metadata={RAW_PAYLOAD: "true"},
            )
            reply = await stub.BulkPublishEventAlpha1(
                request, timeout=self._config.call_timeout_s, metadata=self._call_md
            )
            job.failed = [(f.entry_id, f.error) for f in reply.failedEntries]
        except grpc.aio.AioRpcError as e:
            code = e.code()
            # UNAVAILABLE: the call never reached daprd. A deadline that passed on a
            # connected channel did reach it, and daprd may have published: that is an
            # attempt, counted like a refusal (else a sidecar that answers late would
            # get the same message again and again, never counted, never dead-lettered).
            # A deadline that passed while still connecting is the sidecar not being there.
            if code == grpc.StatusCode.UNAVAILABLE or (
                code == grpc.StatusCode.DEADLINE_EXCEEDED and not self._connected()
            ):
                raise SidecarUnavailableError(e.details() or str(code)) from e
            why = f"{code.name}: {e.details()}"
            job.failed = [(i, why) for i in job.ids]

    def _connected(self) -> bool:
        channel = self._channel
        return channel is not None and channel.get_state() == grpc.ChannelConnectivity.READY

    def unreachable(self, entries: int, held: int, e: Exception) -> None:
        if self._metrics is not None:
            self._metrics.failures.labels(self._name, "unavailable").inc(entries)
        now = asyncio.get_running_loop().time()
        if self._down_since is None:
            self._down_since = now
        if now - self._down_logged >= _DOWN_LOG_EVERY_S:
            self._down_logged = now
            log.warning(
                "forwarder %s: sidecar %s unreachable for %.0fs (%s); %d hand-offs wait and are retried",
                self._name,
                self._config.address,
                now - self._down_since,
                e,
                held,
            )

    def answered(self) -> None:
        if self._down_since is not None:
            log.info(
                "forwarder %s: sidecar %s answers again after %.0fs",
                self._name,
                self._config.address,
                asyncio.get_running_loop().time() - self._down_since,
            )
            self._down_since = None
            self._down_logged = 0.0


def failure_reason(why: str) -> str:
    """The `reason` label of a failed attempt, from what the call ended with."""
    if why.startswith(grpc.StatusCode.DEADLINE_EXCEEDED.name):
        return "timeout"
    return "unknown_target" if "not found" in why.lower() else "refused"


def _content_type(entry: OutboxEntry) -> str:
    """The content type to publish with: the one given at publish, else a CloudEvent's."""
    if entry.content_type:
        return entry.content_type
    # daprd hands a pluggable component its CloudEvents with no content type.
    if entry.data[:1] == b"{":
        try:
            doc = json.loads(entry.data)
        except (ValueError, RecursionError, UnicodeDecodeError):
            return ""
        if isinstance(doc, dict) and "specversion" in doc:
            return CLOUDEVENT_CONTENT_TYPE
    return ""
