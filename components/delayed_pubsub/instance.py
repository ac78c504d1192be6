"""One component instance (one YAML `metadata.name`): its settings, Redis connection and broker.

Several instances share one socket; daprd tells them apart by the
`x-component-instance` call metadata. `Instances` is that registry.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
from collections.abc import Mapping, Sequence

from redis.exceptions import RedisError

from delayed_middleware import envelope as env
from delayed_middleware.clock import Clock
from delayed_middleware.delay import DELAY_KEYS, SCHEDULE_ID, Delay, parse_delay
from delayed_middleware.engine import DelayEngine
from delayed_middleware.entry import StreamEntry
from delayed_middleware.errors import (
    BackendUnavailableError,
    DelayedPubSubError,
    InvalidArgumentError,
    NotInitializedError,
)
from delayed_middleware.keys import EngineKeys, delayed_topic
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
        self.broker = Broker(
            connection.client, settings, clock, metrics, blocking_client=connection.blocking_client
        )
        self._subscriptions: set[Subscription] = set()
        self._paused = False
        # Consumer names must be unique per stream: a consumer shared by two
        # streams would let one stream's XREADGROUP swallow the other's entries.
        self._stream_numbers = itertools.count(1)
        self._host = socket.gethostname()
        self.engine: DelayEngine | None = None
        self._engine_task: asyncio.Task[None] | None = None
        if settings.enable_delayed_messaging:
            self.engine = DelayEngine(
                connection.client,  # type: ignore[arg-type]
                EngineKeys.for_topic(delayed_topic(settings.consumer_id)),
                clock,
                trim=self.broker.trim,
                on_batch=metrics.on_fire,
            )

    def start(self) -> None:
        """Start firing delayed messages (overdue ones fire at once)."""
        if self.engine is not None and self._engine_task is None:
            self._engine_task = asyncio.create_task(self.engine.run(), name=f"delay-engine:{self.name}")

    @classmethod
    async def open(cls, name: str, settings: Settings, clock: Clock, metrics: InstanceMetrics) -> Instance:
        """Connect and PING; BackendUnavailableError (naming host:port) if Redis is unreachable."""
        if settings.enable_delayed_messaging and settings.redis_type == "cluster":
            # The fire script appends to target topics in other hash slots, which
            # a cluster refuses inside one script; refusing here beats failing
            # at the first due time with every message stuck.
            raise InvalidArgumentError(
                "enableDelayedMessaging",
                "true",
                "not supported with redisType cluster yet (single node or Sentinel)",
            )
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

    def _check_publish_topic(self, topic: str) -> None:
        _check_topic(topic)
        # Only the engine writes the delayed topic: a plain publish there would
        # be trimmed by maxLenApprox/streamTTL and take pending envelopes with it.
        if topic == delayed_topic(self.settings.consumer_id):
            raise InvalidArgumentError(
                "topic",
                topic,
                "reserved for this app's pending delayed messages; publish with a delay instead",
            )

    def _delay(self, metadata: Mapping[str, str]) -> Delay | None:
        return parse_delay(
            metadata,
            now_ms=self._clock.now_ms(),
            enabled=self.settings.enable_delayed_messaging,
            max_delay_ms=self.settings.max_delay_ms,
        )

    def _envelope(
        self,
        topic: str,
        delay: Delay,
        *,
        message: bytes = b"",
        content_type: str = "",
        metadata: Mapping[str, str] | None = None,
        bulk_entries: Sequence[env.BulkEntry] = (),
    ) -> env.Envelope:
        return env.Envelope(
            # The envelope's stream entry id already identifies it; a generated id
            # would cost ~34 bytes per pending message for nothing.
            id=delay.schedule_id or "",
            topic=topic,
            due_ms=delay.due_ms,
            published_at_ms=self._clock.now_ms(),
            message=message,
            content_type=content_type,
            metadata=dict(metadata or {}),
            pubsub_name=self.name,
            schedule_id=delay.schedule_id or "",
            bulk_entries=tuple(bulk_entries),
        )

    async def _schedule(self, envelopes: Sequence[env.Envelope]) -> None:
        assert self.engine is not None  # parse_delay refuses delay keys when disabled
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

        Delay metadata is validated before anything is written: a refused
        request stores nothing.
        """
        self._check_publish_topic(topic)
        delay = self._delay(metadata)
        if delay is None:
            await self.broker.publish(topic, StreamEntry(data, dict(metadata), content_type))
            self.metrics.published_immediate.inc()
            return
        await self._schedule(
            [self._envelope(topic, delay, message=data, content_type=content_type, metadata=metadata)]
        )
        self.metrics.published_delayed.inc()

    async def bulk_publish(
        self, topic: str, entries: Sequence[BulkEntry], metadata: Mapping[str, str]
    ) -> list[FailedEntry]:
        """Store many messages on `topic` in one round trip; returns the ones that failed.

        The request's metadata applies to every entry; an entry's own keys win.
        Request-level delay metadata delays the whole bulk as one envelope that
        fires as one batch; an entry with delay keys of its own becomes an
        envelope of its own, and a bad value there fails that entry alone.
        """
        self._check_publish_topic(topic)
        request_delay = self._delay(metadata)  # a bad request-level value refuses it all
        failed: list[FailedEntry] = []
        now: list[BulkEntry] = []
        together: list[BulkEntry] = []
        alone: list[tuple[str, env.Envelope]] = []
        ids_taken: set[str] = set()
        if request_delay is not None and request_delay.schedule_id:
            ids_taken.add(request_delay.schedule_id)
        for item in entries:
            # The common case, no metadata anywhere, allocates nothing new.
            merged = item
            if metadata:
                e = item.entry
                merged = BulkEntry(
                    item.entry_id, StreamEntry(e.data, {**metadata, **e.metadata}, e.content_type)
                )
            if _DELAY_KEYS.isdisjoint(item.entry.metadata):
                (together if request_delay else now).append(merged)
                continue
            try:
                delay = self._delay(merged.entry.metadata)
            except InvalidArgumentError as err:
                failed.append(FailedEntry(item.entry_id, str(err)))
                continue
            if delay is None:
                now.append(merged)
                continue
            # An entry of its own is identified by its own scheduleId only: the
            # request's belongs to the batch envelope, and sharing it would make
            # one envelope silently replace the other.
            own_id = item.entry.metadata.get(SCHEDULE_ID) or None
            if own_id is not None and own_id in ids_taken:
                failed.append(
                    FailedEntry(
                        item.entry_id,
                        str(
                            InvalidArgumentError(
                                SCHEDULE_ID, own_id, "given to two messages of one bulk publish"
                            )
                        ),
                    )
                )
                continue
            if own_id is not None:
                ids_taken.add(own_id)
            m = merged.entry
            envelope = self._envelope(
                topic,
                Delay(delay.due_ms, own_id),
                message=m.data,
                content_type=m.content_type,
                metadata=m.metadata,
            )
            alone.append((item.entry_id, envelope))
        envelopes = [e for _, e in alone]
        if together and request_delay is not None:
            bulk = [
                env.BulkEntry(i.entry_id, i.entry.data, i.entry.content_type, dict(i.entry.metadata))
                for i in together
            ]
            envelopes.append(self._envelope(topic, request_delay, metadata=metadata, bulk_entries=bulk))
        stored_some = False
        if envelopes:
            try:
                await self._schedule(envelopes)
                stored_some = True
                self.metrics.published_delayed.inc(len(together) + len(alone))
            except DelayedPubSubError as err:
                failed += [FailedEntry(i.entry_id, str(err)) for i in together]
                failed += [FailedEntry(entry_id, str(err)) for entry_id, _ in alone]
        if now:
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
        _check_topic(topic)
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


_DELAY_KEYS = frozenset(DELAY_KEYS)


def _check_topic(topic: str) -> None:
    if not topic:
        raise InvalidArgumentError("topic", topic, "must not be empty")
