"""One component instance (one YAML `metadata.name`): its settings, Redis connection and broker.

Its publish path is publishing.Publisher, what it runs in the background is built
in background.py; this holds them together with its subscriptions.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
from collections.abc import Mapping, Sequence

from redis.exceptions import RedisError

from delayed_middleware import plan, storage_format
from delayed_middleware.clock import Clock
from delayed_middleware.engine import ShardedEngine
from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.history import Retention
from delayed_middleware.liveness import Supervised
from delayed_pubsub.admission import Admission
from delayed_pubsub.broker import Broker, BulkEntry, FailedEntry
from delayed_pubsub.connection import Connection, call_timeout, connect
from delayed_pubsub.forwarder import Forwarder
from delayed_pubsub.instance import background
from delayed_pubsub.instance.publishing import Publisher
from delayed_pubsub.instance.rollback import settle_format
from delayed_pubsub.metrics import InstanceMetrics
from delayed_pubsub.redelivery import Retrier
from delayed_pubsub.retry_notices import RetryNotices
from delayed_pubsub.settings import Settings
from delayed_pubsub.subscription import Subscription

# The name logs have always carried (log queries and alerts key on it), whichever file of the package writes.
log = logging.getLogger("delayed_pubsub.instance")


class Instance:
    """An initialized component instance: publishes (Publisher), subscriptions, background loops."""

    def __init__(
        self,
        name: str,
        settings: Settings,
        connection: Connection,
        clock: Clock,
        metrics: InstanceMetrics,
        *,
        fmt: int = storage_format.CURRENT,
    ) -> None:
        self.name = name
        self.settings = settings
        # The storage format settled at Init (storage_format.settle_format): below the newest, the
        # app is in the rollback window, and publishes needing the newer format are refused.
        self.storage_format = fmt
        self._connection = connection
        self._clock = clock
        self.metrics = metrics
        self.broker = Broker(
            connection.client, settings, clock, metrics, blocking_client=connection.blocking_client
        )
        self._subscriptions: set[Subscription] = set()
        self._paused = False
        # Publish/BulkPublish calls in flight, bounded by maxInflightPublishes (checked by the servicer).
        self.admission = Admission(settings.max_inflight_publishes, name, metrics.refused)
        # Consumer names must be unique per stream: a consumer shared by two
        # streams would let one stream's XREADGROUP swallow the other's entries.
        self._stream_numbers = itertools.count(1)
        self._host = socket.gethostname()
        self.engine: ShardedEngine | None = None
        self._gauge: Supervised | None = None
        # `serve --workers N`: the retry due scan in worker 0 (DueScan), and the gRPC
        # process's ear for it that wakes the retry pollers (RetryNotices).
        self._due_scan: Supervised | None = None
        self.retry_notices: RetryNotices | None = None
        # Hands fired messages bound for another Dapr pub/sub (targetPubsub) to the sidecar.
        # Shard 0's forwarder, then the other shards' (background.forwarders).
        self._forwarders: list[Forwarder] = []
        if settings.enable_delayed_messaging:
            self._forwarders = background.forwarders(connection, settings, clock, metrics, name)
            self.engine = background.sharded_engine(
                connection, settings, clock, self.broker, metrics, name, fmt
            )
        self.publisher = Publisher(
            name,
            settings,
            connection.client,
            clock,
            metrics,
            self.broker,
            self.engine,
            storage_format=fmt,
            call_timeout_s=call_timeout(settings),
        )

    @property
    def forwarder(self) -> Forwarder | None:
        """Shard 0's forwarder (the delayed topic's outbox), with delayed messaging on."""
        return self._forwarders[0] if self._forwarders else None

    def start(self) -> None:
        """Start firing delayed messages (overdue ones fire at once)."""
        if self.engine is not None and not self.engine.loops:
            self.engine.start(
                on_state=self.metrics.fire_loop_state, stall_after_s=background.stall_after_s(self.engine)
            )
        for f in self._forwarders:
            f.start()

    @classmethod
    async def open(
        cls,
        name: str,
        settings: Settings,
        clock: Clock,
        metrics: InstanceMetrics,
        *,
        background: bool = True,
        retry_scan: bool = False,
    ) -> Instance:
        """Connect and PING; BackendUnavailableError (naming host:port) if Redis is unreachable.

        `background=False` leaves the fire loops, forwarders and gauges unstarted: `serve
        --workers N` runs them in its worker processes (workers.py), this one serves calls,
        and its retry pollers wait for the notices of a worker's due scan. `retry_scan` runs
        that scan here (in one worker of `serve --workers N`).
        """
        if settings.enable_delayed_messaging and not settings.consumer_id:
            raise InvalidArgumentError(
                "consumerID",
                "",
                "required with enableDelayedMessaging (it names the <consumerID>-delayed topic)",
            )
        connection = connect(settings)
        fmt = storage_format.CURRENT
        try:
            await connection.ping()
            await connection.check_version()
            if settings.enable_delayed_messaging:
                fmt = await settle_format(connection, settings)
        except BaseException:
            await connection.aclose()
            raise
        instance = cls(name, settings, connection, clock, metrics, fmt=fmt)
        await instance._prepare()
        if background:
            instance.start()
            instance._start_gauges()
            if retry_scan:
                instance._start_due_scan()
        elif settings.consumer_id:
            instance.retry_notices = RetryNotices(connection.blocking_client, settings.consumer_id, metrics)
        return instance

    async def _prepare(self) -> None:
        """What Init leaves in Redis is settled when it answers: the outbox and its group exist
        once Init returns, not at some moment after. Warns if Redis may evict the engine's keys."""
        if not self.settings.enable_delayed_messaging:
            return
        try:
            for f in self._forwarders:
                await f.prepare()
        except (RedisError, TimeoutError, OSError) as e:
            log.warning("instance %r: outbox group not created yet (%s); the forwarder retries", self.name, e)
        await background.warn_if_evicting(self._connection, self.settings, self.name)

    def _start_due_scan(self) -> None:
        """The retry due scan (retry_notices.DueScan) of this app, announcing due retry records."""
        if not self.settings.consumer_id:
            return
        self._due_scan = background.due_scan(
            self._connection, self.settings, self._clock, self.metrics, self.name
        )
        self._due_scan.start()

    def _start_gauges(self) -> None:
        """The pending-per-topic gauge (gauges.py), for apps with delayed messaging on."""
        if self.engine is None:
            return
        self._gauge = background.pending_gauge(
            self._connection, self.settings, self._clock, self.metrics, self.name
        )
        self._gauge.start()

    async def publish(
        self, topic: str, data: bytes, metadata: Mapping[str, str], content_type: str = ""
    ) -> None:
        """Store one message on `topic`, or on the delayed topic when its metadata delays it.

        Everything is validated (plan.plan_publish) before anything is written:
        a refused request stores nothing.
        """
        await self.publisher.publish(topic, data, metadata, content_type)

    async def bulk_publish(
        self, topic: str, entries: Sequence[BulkEntry], metadata: Mapping[str, str]
    ) -> list[FailedEntry]:
        """Store many messages on `topic` in one round trip; returns the ones that failed."""
        return await self.publisher.bulk_publish(topic, entries, metadata)

    async def subscribe(self, topic: str, metadata: Mapping[str, str]) -> Subscription:
        """Open a started subscription for one PullMessages stream."""
        plan.check_topic(topic, subscribe=True)
        # A key of another type would fail XGROUP CREATE forever: say so now.
        self.publisher.forget_topic(topic)
        await self.publisher.check_stream(topic)
        if not self.settings.consumer_id:
            raise InvalidArgumentError(
                "consumerID", "", "required to subscribe (daprd sets it to the app-id)"
            )
        # The subscription's own metadata may override the component's retry policy;
        # on the dead-letter topic itself a failed message is kept, never dead-lettered into it.
        policy = self.settings.retry.for_subscription(topic, metadata)
        if self.settings.retry.dead_letter_topic == topic and not policy.dead_letter_topic:
            log.info(
                "instance %r: %r is the dead-letter topic: a message failed there is redelivered "
                "until it is acked, never dead-lettered again",
                self.name,
                topic,
            )
        consumer = f"{self.settings.consumer_id}:{self._host}:{os.getpid()}:{next(self._stream_numbers)}"
        sub = self.broker.subscription(topic, consumer, paused=self._paused)
        if policy.active:
            sub.retry = Retrier(
                self._connection.client,
                policy,
                topic=topic,
                group=self.settings.consumer_id,
                consumer=sub.consumer,
                clock=self._clock,
                metrics=self.metrics,
                call_timeout=call_timeout(self.settings),
                history=Retention(self.settings.history_max_len, self.settings.history_max_age_ms),
                notices=self.retry_notices,
            )
        self._subscriptions.add(sub)
        self.metrics.subscriptions.set(len(self._subscriptions))
        try:
            await sub.start()
        except BaseException:
            self._subscriptions.discard(sub)
            self.metrics.subscriptions.set(len(self._subscriptions))
            raise
        log.info("instance %r: subscribed to %r as %s", self.name, topic, sub.consumer)
        return sub

    async def unsubscribe(self, sub: Subscription) -> None:
        """Close a subscription (its unacked entries stay pending in Redis)."""
        self._subscriptions.discard(sub)
        self.metrics.subscriptions.set(len(self._subscriptions))
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

    def dead_loops(self) -> list[str]:
        """The background loops that ended without a stop (waiting for their restart) or
        stalled, by name: while there is one, health is NOT_SERVING."""
        loops: list[Supervised | None] = []
        if self.engine is not None:
            loops += self.engine.loops
            loops += [e.listener for e in self.engine.engines]
        loops += [f.loop for f in self._forwarders]
        loops.append(self._gauge)
        loops.append(self._due_scan)
        if self.retry_notices is not None:
            loops.append(self.retry_notices.loop)
        for sub in self._subscriptions:
            loops += sub.loops()
        return [
            f"{loop.name} ({'stalled' if loop.up else 'ended'})"
            for loop in loops
            if loop is not None and loop.down
        ]

    async def close(self) -> None:
        """Stop the delay engine and close every subscription, then the Redis connection.

        Nothing pending is lost: delayed messages wait in Redis for the next start.
        """
        if self.engine is not None:
            await self.engine.close()
            # This instance's fire loops are gone, not down: no stale series.
            for n in range(len(self.engine.engines)):
                self.metrics.drop_fire_loop(n)
        if self._gauge is not None:
            await self._gauge.stop()
        if self._due_scan is not None:
            await self._due_scan.stop()
        for f in self._forwarders:
            try:
                await f.close()
            except Exception:
                log.exception("instance %r: the forwarder had failed", self.name)
        subs = list(self._subscriptions)
        self._subscriptions.clear()
        self.metrics.subscriptions.set(0)
        await asyncio.gather(*(s.close() for s in subs), return_exceptions=True)
        if self.retry_notices is not None:
            await self.retry_notices.close()
        await self._connection.aclose()
