"""One component instance (one YAML `metadata.name`): its settings, Redis connection and broker.

Several instances share one socket; daprd tells them apart by the
`x-component-instance` call metadata. `Instances` is that registry.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import socket
from collections.abc import Callable, Mapping, Sequence

from redis.exceptions import RedisError

from delayed_middleware import envelope as env
from delayed_middleware import plan
from delayed_middleware.clock import Clock
from delayed_middleware.engine import DelayEngine, EngineConfig, FireReport, ShardedEngine
from delayed_middleware.entry import StreamEntry
from delayed_middleware.errors import (
    BackendUnavailableError,
    DelayedPubSubError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotInitializedError,
)
from delayed_middleware.keys import EngineKeys, shard_topics
from delayed_pubsub.broker import Broker, BulkEntry, FailedEntry, Subscription
from delayed_pubsub.connection import Connection, call_timeout, connect
from delayed_pubsub.metrics import InstanceMetrics, Metrics
from delayed_pubsub.settings import Settings, parse_settings

log = logging.getLogger(__name__)


class Instance:
    """An initialized component instance. Publish routing lives here (not in the
    servicer) so the delay engine can be put in front of the broker later."""

    def __init__(
        self, name: str, settings: Settings, connection: Connection, clock: Clock, metrics: InstanceMetrics
    ) -> None:
        self.name = name
        self.settings = settings
        self._connection = connection
        self._clock = clock
        self.metrics = metrics
        self.broker = Broker(connection.client, settings, clock, metrics)
        self._subscriptions: set[Subscription] = set()
        self._paused = False
        # Consumer names must be unique per stream: a consumer shared by two
        # streams would let one stream's XREADGROUP swallow the other's entries.
        self._stream_numbers = itertools.count(1)
        self._host = socket.gethostname()
        self.engine: ShardedEngine | None = None
        self._engine_task: asyncio.Task[None] | None = None
        if settings.enable_delayed_messaging:
            self.engine = _sharded_engine(connection, settings, clock, self.broker, metrics)
        # Topics seen to be streams (or absent), so a delayed publish checks the
        # target's type once, not per call; bounded, and forgotten after a while
        # because a key's type can change under us (the fire path parks then).
        self._stream_topics: dict[str, int] = {}

    def start(self) -> None:
        """Start firing delayed messages (overdue ones fire at once)."""
        if self.engine is not None and self._engine_task is None:
            self._engine_task = asyncio.create_task(self.engine.run(), name=f"delay-engine:{self.name}")

    @classmethod
    async def open(cls, name: str, settings: Settings, clock: Clock, metrics: InstanceMetrics) -> Instance:
        """Connect and PING; BackendUnavailableError (naming host:port) if Redis is unreachable."""
        if settings.enable_delayed_messaging and not settings.consumer_id:
            raise InvalidArgumentError(
                "consumerID",
                "",
                "required with enableDelayedMessaging (it names the <consumerID>-delayed topic)",
            )
        connection = connect(settings)
        try:
            await connection.ping()
        except BaseException:
            await connection.aclose()
            raise
        instance = cls(name, settings, connection, clock, metrics)
        instance.start()
        return instance

    def _context(self) -> plan.PlanContext:
        return plan.PlanContext(
            now_ms=self._clock.now_ms(),
            pubsub_name=self.name,
            enabled=self.settings.enable_delayed_messaging,
            max_delay_ms=self.settings.max_delay_ms,
        )

    async def _check_stream(self, topic: str) -> None:
        """FailedPreconditionError unless `topic`'s key is a stream or absent."""
        now = self._clock.now_ms()
        if now - self._stream_topics.get(topic, -_TYPE_CACHE_MS) < _TYPE_CACHE_MS:
            return
        try:
            async with asyncio.timeout(call_timeout(self.settings)):
                kind = await self._connection.client.type(topic)
        except (RedisError, TimeoutError) as e:
            raise BackendUnavailableError(f"checking topic {topic!r}: redis: {e or 'timed out'}") from e
        kind_s = kind.decode() if isinstance(kind, bytes) else str(kind)
        if kind_s not in ("stream", "none"):
            raise FailedPreconditionError(
                f"topic {topic!r}: its Redis key holds a {kind_s}, not a stream; choose another topic name"
            )
        if len(self._stream_topics) >= _TYPE_CACHE_SIZE:
            self._stream_topics.clear()
        self._stream_topics[topic] = now

    async def _schedule(self, envelopes: Sequence[env.Envelope]) -> None:
        if self.engine is None:
            # parse_delay refuses delay keys while delayed messaging is off.
            raise DelayedPubSubError("delayed messaging is not enabled on this instance")
        for topic in {e.topic for e in envelopes}:
            await self._check_stream(topic)
        try:
            # Bounded like every other Redis call: the client has no socket
            # timeout, and a stalled Redis must not hang the publisher.
            async with asyncio.timeout(call_timeout(self.settings)):
                await self.engine.schedule(envelopes)
        except (RedisError, TimeoutError) as e:
            raise BackendUnavailableError(
                f"scheduling on {self.engine.keys.stream!r}: redis: {e or 'timed out'}"
            ) from e
        if any(e.due_ms <= self._clock.now_ms() for e in envelopes):
            self.engine.wake()

    async def publish(
        self, topic: str, data: bytes, metadata: Mapping[str, str], content_type: str = ""
    ) -> None:
        """Store one message on `topic`, or on the delayed topic when its metadata delays it.

        Everything is validated (plan.plan_publish) before anything is written:
        a refused request stores nothing.
        """
        p = plan.plan_publish(topic, data, metadata, content_type, self._context())
        if p.immediate:
            await self._publish_now(topic, p.immediate[0].entry)
            self.metrics.published_immediate.inc()
        if p.delayed:
            await self._schedule([d.envelope for d in p.delayed])
            self.metrics.published_delayed.inc()

    async def _publish_now(self, topic: str, entry: StreamEntry) -> None:
        try:
            await self.broker.publish(topic, entry)
        except DelayedPubSubError as e:
            if "WRONGTYPE" in str(e):
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
        stored_some = False
        if p.delayed:
            try:
                await self._schedule([d.envelope for d in p.delayed])
                stored_some = True
                self.metrics.published_delayed.inc(sum(len(d.entry_ids) for d in p.delayed))
            except DelayedPubSubError as err:
                failed += [FailedEntry(i, str(err)) for d in p.delayed for i in d.entry_ids]
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

    async def subscribe(self, topic: str, metadata: Mapping[str, str]) -> Subscription:
        """Open a started subscription for one PullMessages stream."""
        plan.check_topic(topic, subscribe=True)
        # A key of another type would fail XGROUP CREATE forever: say so now.
        self._stream_topics.pop(topic, None)
        await self._check_stream(topic)
        if not self.settings.consumer_id:
            raise InvalidArgumentError(
                "consumerID", "", "required to subscribe (daprd sets it to the app-id)"
            )
        consumer = f"{self.settings.consumer_id}:{self._host}:{os.getpid()}:{next(self._stream_numbers)}"
        sub = self.broker.subscription(topic, consumer, paused=self._paused)
        self._subscriptions.add(sub)
        try:
            await sub.start()
        except BaseException:
            self._subscriptions.discard(sub)
            raise
        log.info("instance %r: subscribed to %r as %s", self.name, topic, sub.consumer)
        return sub

    async def unsubscribe(self, sub: Subscription) -> None:
        """Close a subscription (its unacked entries stay pending in Redis)."""
        self._subscriptions.discard(sub)
        await sub.close()

    def pause(self) -> None:
        """Stop sending new messages on every stream of this instance (idempotent)."""
        self._paused = True
        for sub in self._subscriptions:
            sub.pause()

    def resume(self) -> None:
        """Start sending again (idempotent)."""
        self._paused = False
        for sub in self._subscriptions:
            sub.resume()

    async def ping(self) -> None:
        """Redis PING."""
        await self.broker.ping()

    async def close(self) -> None:
        """Stop the delay engine and close every subscription, then the Redis connection.

        Nothing pending is lost: delayed messages wait in Redis for the next start.
        """
        if self._engine_task is not None:
            self._engine_task.cancel()
            try:
                await self._engine_task
            except asyncio.CancelledError:
                pass
            except Exception:
                # Whatever ended the engine must not keep the rest from closing.
                log.exception("instance %r: delay engine had failed", self.name)
            self._engine_task = None
        subs = list(self._subscriptions)
        self._subscriptions.clear()
        await asyncio.gather(*(s.close() for s in subs), return_exceptions=True)
        await self._connection.aclose()


def _sharded_engine(
    connection: Connection, settings: Settings, clock: Clock, broker: Broker, metrics: InstanceMetrics
) -> ShardedEngine:
    """The delay engine over the delayed topic's shard streams (keys.shard_topics).

    On Redis Cluster the fire is two-phase (target topics live in other hash
    slots than the shard); on a single node or Sentinel it is one script.
    """
    config = EngineConfig(
        history_max_len=settings.history_max_len,
        history_max_age_ms=settings.history_max_age_ms,
        two_phase=settings.redis_type == "cluster",
    )
    topics = shard_topics(settings.consumer_id, settings.shards)
    pending = [0] * len(topics)

    def on_batch(shard: int) -> Callable[[FireReport], None]:
        # The pending gauge is the instance's total over its shards.
        def hook(report: FireReport) -> None:
            pending[shard] = report.pending
            metrics.on_fire(dataclasses.replace(report, pending=sum(pending)))

        return hook

    return ShardedEngine(
        [
            DelayEngine(
                connection.client,  # type: ignore[arg-type]
                EngineKeys.for_topic(topic),
                clock,
                trim=broker.trim,
                on_batch=on_batch(n),
                config=config,
            )
            for n, topic in enumerate(topics)
        ]
    )


class Instances:
    """The component instances served on one socket, by name."""

    def __init__(self, clock: Clock, metrics: Metrics) -> None:
        self._clock = clock
        self._metrics = metrics
        self._instances: dict[str, Instance] = {}
        self._lock = asyncio.Lock()

    async def init(self, name: str, props: Mapping[str, str]) -> Instance:
        """Parse, connect and register `name`, replacing (and closing) any previous Init of it.

        On failure the previous instance, if any, stays as it was.
        """
        settings = parse_settings(props)
        instance = await Instance.open(name, settings, self._clock, self._metrics.for_instance(name))
        async with self._lock:
            old = self._instances.get(name)
            self._instances[name] = instance
        if old is not None:
            log.info("instance %r re-initialized; closing the previous one", name)
            await old.close()
        log.info(
            "instance %r initialized: redis %s, consumerID %r", name, settings.address, settings.consumer_id
        )
        return instance

    def get(self, name: str) -> Instance:
        """The instance named `name`; NotInitializedError if daprd has not called Init for it."""
        try:
            return self._instances[name]
        except KeyError:
            raise NotInitializedError(name) from None

    async def close(self) -> None:
        """Close every instance."""
        instances = list(self._instances.values())
        self._instances.clear()
        await asyncio.gather(*(i.close() for i in instances), return_exceptions=True)


_TYPE_CACHE_MS = 60_000
_TYPE_CACHE_SIZE = 10_000
