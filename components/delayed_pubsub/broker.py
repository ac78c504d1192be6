"""The Redis Streams broker: publish, bulk publish, and one subscription per PullMessages stream.

Layout, as pubsub.redis has it (so existing deployments read as they are):
  - a topic is a stream of the same name, entries written by delayed_middleware.entry;
  - subscribers of one app share the consumer group `<consumerID>` created from the
    start of the stream (MKSTREAM), each stream reading as its own consumer;
  - an entry stays in the group's PEL from delivery to XACK, so whatever dies —
    the stream, the process, Redis's connection — it is never lost: a live
    subscription reclaims it after processingTimeout.

A subscription (subscription.py) and its parts have files of their own: the delivery
window (window.py), the fetch loop and reclaim pass (fetch.py), the ack batcher
(acks.py), nacks (nacks.py), its retried Redis calls (calls.py), the conditional
claims (claims.py), and with a retry policy the Retrier (redelivery.py).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.exceptions

from delayed_middleware.aio import text
from delayed_middleware.clock import Clock
from delayed_middleware.entry import StreamEntry, Trim, encode_entry
from delayed_middleware.errors import BackendUnavailableError, DelayedPubSubError
from delayed_pubsub.connection import REDIS_ERRORS, TRANSIENT_ERRORS, RedisPyClient, call_timeout
from delayed_pubsub.metrics import InstanceMetrics, Metrics
from delayed_pubsub.settings import Settings
from delayed_pubsub.subscription import Subscription

log = logging.getLogger(__name__)

# Under load, how long a queued XADD waits for others to share its round trip,
# unless this many are already queued.
PUBLISH_LINGER_S = 0.001
PUBLISH_LINGER_BELOW = 32


def trim_policy(settings: Settings) -> Trim:
    """How topics are trimmed: as pubsub.redis, maxLenApprox wins over streamTTL."""
    if settings.max_len_approx:
        return Trim(mode="MAXLEN", max_len=settings.max_len_approx)
    if settings.stream_ttl_ms:
        return Trim(mode="MINID", max_age_ms=settings.stream_ttl_ms)
    return Trim()


@dataclass(frozen=True)
class BulkEntry:
    """One message of a bulk publish, with the id daprd uses to report its fate."""

    entry_id: str
    entry: StreamEntry


@dataclass(frozen=True)
class FailedEntry:
    """A bulk entry that was not stored, and why."""

    entry_id: str
    error: str


@dataclass(eq=False, repr=False)
class Broker:
    """Publishes to topic streams and opens subscriptions, all on one client."""

    client: RedisPyClient
    settings: Settings
    clock: Clock
    metrics: InstanceMetrics = field(default_factory=lambda: Metrics().for_instance(""))
    # XREADGROUP BLOCK parks a connection: outside poolSize (connection.Connection). None: `client`.
    blocking_client: RedisPyClient | None = None

    def __post_init__(self) -> None:
        self._timeout = call_timeout(self.settings)
        self._batcher = _PublishBatcher(self.client)
        self.trim = trim_policy(self.settings)

    def _trim(self) -> dict[str, Any]:
        mode, threshold = self.trim.args(self.clock.now_ms())
        if mode == "MAXLEN":
            return {"maxlen": int(threshold), "approximate": True}
        if mode == "MINID":
            return {"minid": threshold, "approximate": True}
        return {}

    async def publish(self, topic: str, entry: StreamEntry) -> str:
        """XADD one entry; returns its stream id.

        Publishes that arrive together (daprd's concurrent calls) share one
        pipelined round trip: see _PublishBatcher.
        """
        try:
            async with asyncio.timeout(self._timeout):
                entry_id = await self._batcher.xadd(topic, encode_entry(entry), self._trim())
        except TRANSIENT_ERRORS as e:
            raise BackendUnavailableError(f"publish to {topic!r}: redis unavailable: {e}") from e
        except redis.exceptions.RedisError as e:
            raise DelayedPubSubError(f"publish to {topic!r}: redis refused XADD: {e}") from e
        return text(entry_id)

    async def bulk_publish(self, topic: str, entries: Sequence[BulkEntry]) -> list[FailedEntry]:
        """XADD every entry in one pipelined round trip; returns the entries Redis refused.

        A pipeline, not one script: Redis starts appending while the rest of the
        batch is still on the wire, which on 2 cores beat a Lua loop by ~1.5x.
        A connection failure fails the whole batch (BackendUnavailableError): we
        cannot know which entries landed, and daprd then reports all as failed.
        """
        if not entries:
            return []
        trim = self._trim()
        pipe = self.client.pipeline(transaction=False)
        for item in entries:
            pipe.xadd(topic, encode_entry(item.entry), **trim)  # type: ignore[arg-type]
        try:
            async with asyncio.timeout(self._timeout):
                results = await pipe.execute(raise_on_error=False)
        except TRANSIENT_ERRORS as e:
            raise BackendUnavailableError(f"bulk publish to {topic!r}: redis unavailable: {e}") from e
        return [
            FailedEntry(item.entry_id, f"XADD {topic}: {result}")
            for item, result in zip(entries, results, strict=True)
            if isinstance(result, Exception)
        ]

    async def ping(self) -> None:
        """Redis PING; BackendUnavailableError if it does not answer."""
        try:
            async with asyncio.timeout(self._timeout):
                await self.client.ping()
        except REDIS_ERRORS as e:
            raise BackendUnavailableError(f"redis ping failed: {e}") from e

    def subscription(self, topic: str, consumer: str, paused: bool = False) -> Subscription:
        """A not-yet-started subscription to `topic` in the consumerID group, as a
        consumer named `consumer` plus a random suffix."""
        # Two streams sharing a consumer would share a PEL, and each would XACK
        # or re-deliver the other's entries; the caller's name alone is not
        # unique (two instances of one consumerID in a process, a re-Init).
        unique = f"{consumer}:{uuid.uuid4().hex[:8]}"
        return Subscription(
            self.client,
            self.settings,
            self.clock,
            topic,
            unique,
            paused,
            self.metrics,
            blocking_client=self.client if self.blocking_client is None else self.blocking_client,
        )


class _PublishBatcher:
    """Coalesces concurrent XADDs into one pipelined round trip.

    An XADD with nothing else on the wire goes out at once, as a plain command
    (no task, no pipeline: the common case costs nothing extra). Calls that
    arrive while one is on the wire queue behind it and go out together, in one
    pipeline, as soon as it returns; meanwhile the next batch gathers. Each
    caller gets its own result or error (a refused XADD fails only its caller;
    a connection error fails the whole batch, as no caller can know whether it
    landed). Saves redis-py's per-command overhead (~50 us CPU) on all but one
    call of a batch, and one socket write per call.
    """

    def __init__(self, client: RedisPyClient) -> None:
        self._client = client
        self._queue: list[tuple[str, dict[str, bytes], dict[str, Any], asyncio.Future[Any]]] = []
        self._busy = False
        self._flusher: asyncio.Task[None] | None = None

    async def xadd(self, topic: str, fields: dict[str, bytes], trim: dict[str, Any]) -> Any:
        """XADD `fields` to `topic` with trim arguments `trim`; returns the entry id."""
        if not self._busy:
            self._busy = True
            try:
                return await self._client.xadd(topic, fields, **trim)  # type: ignore[arg-type]
            finally:
                self._next()
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.append((topic, fields, trim, future))
        return await future

    def _next(self) -> None:
        """The round trip on the wire is over: send what queued meanwhile, or go idle."""
        if self._queue:
            self._flusher = asyncio.create_task(self._flush(), name="publish batcher")
        else:
            self._busy = False

    async def _flush(self) -> None:
        batch: list[tuple[str, dict[str, bytes], dict[str, Any], asyncio.Future[Any]]] = []
        try:
            # Only under load (calls queued behind a round trip): grpc.aio takes one
            # call per loop pass, so without a moment's wait most batches held one
            # or two XADDs (~0.7 socket writes per publish under 64 callers).
            if len(self._queue) < PUBLISH_LINGER_BELOW:
                await asyncio.sleep(PUBLISH_LINGER_S)
            batch, self._queue = self._queue, []
            # A caller that gave up (timeout, cancelled call) is still written:
            # one write beats a guess about whether it was already on the wire.
            pipe = self._client.pipeline(transaction=False)
            for topic, fields, trim, _ in batch:
                pipe.xadd(topic, fields, **trim)  # type: ignore[arg-type]
            results = await pipe.execute(raise_on_error=False)
        except asyncio.CancelledError:
            # Cancelled while lingering: the queued calls were never sent.
            if not batch:
                batch, self._queue = self._queue, []
            for *_, future in batch:
                future.cancel()
            raise
        except Exception as e:
            results = [e] * len(batch)
        finally:
            self._flusher = None
            self._next()
        for (*_, future), result in zip(batch, results, strict=True):
            if future.done():
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)
