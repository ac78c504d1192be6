"""The publish path of one instance: plan a Publish or BulkPublish, then store it.

Everything is validated (delayed_middleware.plan) before anything is written: a
refused request stores nothing. What is due now goes to the broker, what is
delayed to the delay engine, cancels and control requests to the engine too.
A publish's Redis failure is retried here and only here (Publisher.schedule),
with the call's token, so a lost reply never stores a message twice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
from collections.abc import Mapping, Sequence

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from delayed_middleware import envelope as env
from delayed_middleware import plan
from delayed_middleware.aio import text
from delayed_middleware.backoff import PUBLISH_RETRY, Backoff
from delayed_middleware.clock import Clock
from delayed_middleware.control import Control
from delayed_middleware.engine import ShardedEngine
from delayed_middleware.entry import StreamEntry
from delayed_middleware.errors import (
    DelayedPubSubError,
    FailedPreconditionError,
    PartiallyStoredError,
)
from delayed_middleware.redis_errors import is_wrong_type
from delayed_pubsub.broker import Broker, BulkEntry, FailedEntry
from delayed_pubsub.connection import RedisPyClient
from delayed_pubsub.controls import control_request
from delayed_pubsub.instance.rollback import refuse_if_pinned, withhold_pinned
from delayed_pubsub.instance.unavailable import redis_unavailable
from delayed_pubsub.metrics import InstanceMetrics
from delayed_pubsub.settings import Settings

# The name logs have always carried (log queries and alerts key on it), whichever file of the package writes.
log = logging.getLogger("delayed_pubsub.instance")

# A connection that dropped (a lost reply among them): the schedule step is
# idempotent under its token, so it is retried.
_DROPPED = (OSError, RedisConnectionError)

_TYPE_CACHE_MS = 60_000
_TYPE_CACHE_SIZE = 10_000


@dataclasses.dataclass(eq=False, repr=False)
class Publisher:
    """Publish and BulkPublish of one instance, over its broker and delay engine."""

    name: str
    settings: Settings
    client: RedisPyClient
    clock: Clock
    metrics: InstanceMetrics
    broker: Broker
    engine: ShardedEngine | None
    _: dataclasses.KW_ONLY
    storage_format: int
    # What one Redis call may take (settings are fixed for the instance's life; None: unbounded).
    call_timeout_s: float | None
    # Topics seen to be streams (or absent), so a delayed publish checks the
    # target's type once, not per call; bounded, and forgotten after a while
    # because a key's type can change under us (the fire path parks then).
    _stream_topics: dict[str, int] = dataclasses.field(default_factory=dict, init=False)

    def _context(self) -> plan.PlanContext:
        return plan.PlanContext(
            now_ms=self.clock.now_ms(),
            pubsub_name=self.name,
            enabled=self.settings.enable_delayed_messaging,
            max_delay_ms=self.settings.max_delay_ms,
            default_target_pubsub=self.settings.default_target_pubsub,
        )

    def _stream_checked(self, topic: str) -> bool:
        """Whether `topic` was seen to be a stream (or absent) lately: no TYPE call needed."""
        return self.clock.now_ms() - self._stream_topics.get(topic, -_TYPE_CACHE_MS) < _TYPE_CACHE_MS

    def forget_topic(self, topic: str) -> None:
        """Ask Redis for `topic`'s type again at its next check."""
        self._stream_topics.pop(topic, None)

    async def check_stream(self, topic: str) -> None:
        """FailedPreconditionError unless `topic`'s key is a stream or absent."""
        if self._stream_checked(topic):
            return
        now = self.clock.now_ms()
        try:
            async with asyncio.timeout(self.call_timeout_s):
                kind = await self.client.type(topic)
        except (RedisError, TimeoutError) as e:
            raise redis_unavailable(f"checking topic {topic!r}", e) from e
        kind_s = text(kind)
        if kind_s not in ("stream", "none"):
            raise FailedPreconditionError(
                f"topic {topic!r}: its Redis key holds a {kind_s}, not a stream; choose another topic name"
            )
        if len(self._stream_topics) >= _TYPE_CACHE_SIZE:
            self._stream_topics.clear()
        self._stream_topics[topic] = now

    def _enabled_engine(self) -> ShardedEngine:
        if self.engine is None:
            # parse_delay refuses delay keys while delayed messaging is off.
            raise DelayedPubSubError("delayed messaging is not enabled on this instance")
        return self.engine

    async def schedule(self, envelopes: Sequence[env.Envelope]) -> None:
        """Store delayed envelopes; the one place a publish's Redis failure is retried."""
        engine = self._enabled_engine()
        if len(envelopes) == 1:
            if not self._stream_checked(envelopes[0].topic):
                await self.check_stream(envelopes[0].topic)
        else:
            for topic in {e.topic for e in envelopes}:
                await self.check_stream(topic)
        # One token for the call and its retries: a reply lost after the write
        # landed makes the retry a no-op in Redis, so the publish is answered
        # OK and stored once. Retried at one level only: here, where the
        # client never resends; on Redis Cluster redis-py's client resends the
        # call itself (redisMaxRetries times, connection.py), with the same
        # token, so here only when it resends nothing (redisMaxRetries <= 0).
        token = secrets.token_hex(8)
        resent_by_client = self.settings.redis_type == "cluster" and self.settings.max_retries > 0
        retries = 0 if resent_by_client else max(1, self.settings.max_retries)
        # Made at the first dropped connection: nearly every call needs none.
        backoff: Backoff | None = None
        try:
            # Bounded like every other Redis call: the client has no socket
            # timeout, and a stalled Redis must not hang the publisher (per
            # chunk: a failure part way raises PartiallyStoredError, saying how
            # many are stored). A dropped connection is retried with the same
            # token; a timeout is not (a frozen Redis must fail fast).
            while True:
                try:
                    await engine.schedule(envelopes, token=token, timeout_s=self.call_timeout_s)
                    break
                except (PartiallyStoredError, OSError, RedisConnectionError) as e:
                    cause = e.__cause__ if isinstance(e, PartiallyStoredError) else e
                    if backoff is None:
                        backoff = PUBLISH_RETRY.backoff()
                    if not isinstance(cause, _DROPPED) or backoff.failures >= retries:
                        raise
                await asyncio.sleep(backoff.next())
        except (RedisError, TimeoutError, OSError) as e:
            raise redis_unavailable(f"scheduling on {engine.keys.stream!r}", e) from e
        if any(e.due_ms <= self.clock.now_ms() for e in envelopes):
            engine.wake()

    async def cancel(self, cancels: Sequence[plan.Cancel]) -> None:
        """Withdraw pending messages or schedules (scheduleCancel), in one script call per
        few hundred. An unknown id is not an error: it may have fired or been cancelled already."""
        engine = self._enabled_engine()
        ids = [c.schedule_id for c in cancels]
        try:
            async with asyncio.timeout(self.call_timeout_s):
                results = await engine.cancel_many(ids)
        except (RedisError, TimeoutError) as e:
            raise redis_unavailable(f"cancelling {len(ids)} id(s) on {engine.keys.stream!r}", e) from e
        # A bulk of cancels is thousands per second: the cancelled ones are
        # counted in one line (each at debug), the unknown ones named each.
        stream = engine.keys.stream
        cancelled = 0
        for sid, (found, _) in zip(ids, results, strict=True):
            if found:
                cancelled += 1
                log.debug("cancelled %r on %s", sid, stream)
            else:
                log.info(
                    "scheduleCancel of %r on %s: nothing pending under that id (fired, cancelled or never there)",
                    sid,
                    stream,
                )
        if cancelled:
            self.metrics.cancelled.inc(cancelled)
            if len(ids) == 1:
                log.info("cancelled %r on %s", ids[0], stream)
            else:
                log.info("cancelled %d of %d ids on %s", cancelled, len(ids), stream)
        if cancelled < len(ids):
            self.metrics.cancel_unknown.inc(len(ids) - cancelled)

    async def publish(
        self, topic: str, data: bytes, metadata: Mapping[str, str], content_type: str = ""
    ) -> None:
        """Store one message on `topic`, or on the delayed topic when its metadata delays it."""
        p = plan.plan_publish(topic, data, metadata, content_type, self._context())
        refuse_if_pinned(self.storage_format, p.delayed, p.control)
        if p.immediate:
            await self._publish_now(topic, p.immediate[0].entry)
            self.metrics.published_immediate.inc()
        if p.delayed:
            await self.schedule([d.envelope for d in p.delayed])
            self.metrics.published_delayed.inc()
        if p.cancels:
            await self.cancel(p.cancels)
        if p.control is not None:
            await self._control(p.control, data)

    async def _control(self, request: Control, data: bytes) -> None:
        """Execute a schedulePause or a scheduleIdPrefix cancel (control.py); see engine/pause.py.
        `data` identifies a trigger request (its CloudEvent id): a retry of it delivers once."""
        engine = self._enabled_engine()
        try:
            await control_request(engine, request, self.metrics, log, data)
        except (RedisError, TimeoutError) as e:
            raise redis_unavailable(f"{type(request).__name__} on {engine.keys.stream!r}", e) from e

    async def _publish_now(self, topic: str, entry: StreamEntry) -> None:
        try:
            await self.broker.publish(topic, entry)
        except DelayedPubSubError as e:
            if is_wrong_type(e):
                raise FailedPreconditionError(
                    f"topic {topic!r}: its Redis key is not a stream; choose another topic name"
                ) from e
            raise

    async def bulk_publish(
        self, topic: str, entries: Sequence[BulkEntry], metadata: Mapping[str, str]
    ) -> list[FailedEntry]:
        """Store many messages on `topic` in one round trip; returns the ones that failed.

        Planning (plan.plan_bulk) decides what is stored now, what is delayed
        and what is refused; this executes it.
        """
        p = plan.plan_bulk(topic, [(i.entry_id, i.entry) for i in entries], metadata, self._context())
        failed = [FailedEntry(f.entry_id, f.error) for f in p.failed]
        if p.delayed:
            # In the rollback window: each entry that needs the newer format fails alone.
            keep, withheld = withhold_pinned(self.storage_format, p.delayed)
            if withheld:
                failed += withheld
                p = dataclasses.replace(p, delayed=keep)
        stored_some = False
        if p.delayed:
            stored_some = await self._schedule_bulk(p.delayed, failed)
        if p.cancels:
            try:
                await self.cancel(p.cancels)
                stored_some = True
            except DelayedPubSubError as err:
                failed += [FailedEntry(i, str(err)) for c in p.cancels for i in c.entry_ids]
        if p.immediate:
            now = [BulkEntry(i.entry_id, i.entry) for i in p.immediate]
            try:
                refused = await self.broker.bulk_publish(topic, now)
            except DelayedPubSubError as err:
                if not stored_some:
                    raise
                # The delayed part is stored: report only what failed, so a
                # retry by daprd or the app does not store it twice.
                refused = [FailedEntry(i.entry_id, str(err)) for i in now]
            self.metrics.published_immediate.inc(len(now) - len(refused))
            failed += refused
        return failed

    async def _schedule_bulk(self, delayed: Sequence[plan.Delayed], failed: list[FailedEntry]) -> bool:
        """Store a bulk's delayed part; adds what is not stored to `failed`. Whether any is stored."""
        stored = len(delayed)
        try:
            await self.schedule([d.envelope for d in delayed])
        except DelayedPubSubError as err:
            # Only what is not stored failed: a retry of the rest would
            # store those twice.
            stored = err.stored if isinstance(err, PartiallyStoredError) else 0
            failed += [FailedEntry(i, str(err)) for d in delayed[stored:] for i in d.entry_ids]
        self.metrics.published_delayed.inc(sum(len(d.entry_ids) for d in delayed[:stored]))
        return stored > 0
