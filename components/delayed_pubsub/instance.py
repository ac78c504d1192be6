"""One component instance (one YAML `metadata.name`): its settings, Redis connection and broker.

Several instances share one socket; daprd tells them apart by the
`x-component-instance` call metadata. `Instances` is that registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import secrets
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from delayed_middleware import envelope as env
from delayed_middleware import plan, storage_format
from delayed_middleware.aio import text
from delayed_middleware.backoff import Backoff
from delayed_middleware.clock import Clock
from delayed_middleware.control import Control, Pause
from delayed_middleware.engine import FireReport, ShardedEngine
from delayed_middleware.entry import StreamEntry
from delayed_middleware.errors import (
    BackendUnavailableError,
    DelayedPubSubError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotInitializedError,
    PartiallyStoredError,
    RestoreFailedError,
)
from delayed_middleware.history import Retention
from delayed_middleware.keys import EngineKeys, shard_topics
from delayed_middleware.liveness import Supervised
from delayed_middleware.schedules import EnvelopeRecurrence
from delayed_pubsub.admission import Admission
from delayed_pubsub.broker import Broker, BulkEntry, FailedEntry
from delayed_pubsub.connection import Connection, call_timeout, connect
from delayed_pubsub.controls import control_request
from delayed_pubsub.engines import build_engine, engine_config
from delayed_pubsub.forwarder import Forwarder
from delayed_pubsub.gauges import PendingByTopic
from delayed_pubsub.metrics import InstanceMetrics, Metrics
from delayed_pubsub.records import InitRecord, RecordRefusedError, RecordStore
from delayed_pubsub.redelivery import Retrier
from delayed_pubsub.retry_notices import DueScan, RetryNotices
from delayed_pubsub.settings import Settings, parse_settings, unknown_keys
from delayed_pubsub.subscription import Subscription

log = logging.getLogger(__name__)

# Beyond a fire loop's longest pass and sleep, how long it may go without a pass before it counts as stalled.
STALL_SLACK_S = 10.0


class Instance:
    """An initialized component instance. Publish routing lives here (not in the
    servicer) so the delay engine can be put in front of the broker later."""

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
        # What one Redis call may take (settings are fixed for the instance's life).
        self._call_timeout = call_timeout(settings)
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
        self.forwarder: Forwarder | None = None
        self._shard_forwarders: list[Forwarder] = []
        if settings.enable_delayed_messaging:
            self.forwarder = Forwarder.from_settings(
                connection.client,
                settings,
                clock,
                metrics.forwarder,
                name=name,
                read_client=connection.blocking_client,
                on_state=metrics.loop_state("forwarder"),
            )
            # Each shard fires into its own outbox (its own hash slot): shard 0's
            # is the forwarder above, the others get one each, same settings.
            self._shard_forwarders = [
                Forwarder(
                    connection.client,
                    EngineKeys.for_topic(topic),
                    clock,
                    self.forwarder.config,
                    metrics.forwarder,
                    name=f"{name}~{n}",
                    read_client=connection.blocking_client,
                    on_state=metrics.loop_state("forwarder"),
                )
                for n, topic in enumerate(shard_topics(settings.consumer_id, settings.shards))
                if n
            ]
            self.engine = _sharded_engine(connection, settings, clock, self.broker, metrics, name, fmt)
        # Topics seen to be streams (or absent), so a delayed publish checks the
        # target's type once, not per call; bounded, and forgotten after a while
        # because a key's type can change under us (the fire path parks then).
        self._stream_topics: dict[str, int] = {}

    def start(self) -> None:
        """Start firing delayed messages (overdue ones fire at once)."""
        if self.engine is not None and not self.engine.loops:
            cfg = self.engine.engines[0].config
            # A pass takes at most op_timeout_s and a sleep at most max_sleep_s
            # (or a backoff, at most retry_max_s): longer without one is a stall.
            stall = cfg.op_timeout_s + max(cfg.max_sleep_s, cfg.retry_max_s) + STALL_SLACK_S
            self.engine.start(on_state=self.metrics.fire_loop_state, stall_after_s=stall)
        if self.forwarder is not None:
            self.forwarder.start()
        for f in self._shard_forwarders:
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
                fmt = await _settle_format(connection, settings)
        except BaseException:
            await connection.aclose()
            raise
        instance = cls(name, settings, connection, clock, metrics, fmt=fmt)
        if instance.forwarder is not None:
            # The outbox and its group exist once Init returns, not at some
            # moment after: what Init leaves in Redis is settled when it answers.
            try:
                await instance.forwarder.prepare()
                for f in instance._shard_forwarders:
                    await f.prepare()
            except (RedisError, TimeoutError, OSError) as e:
                log.warning("instance %r: outbox group not created yet (%s); the forwarder retries", name, e)
        if settings.enable_delayed_messaging:
            await instance._warn_if_evicting()
        if background:
            instance.start()
            instance._start_gauges()
            if retry_scan:
                instance._start_due_scan()
        elif settings.consumer_id:
            instance.retry_notices = RetryNotices(connection.blocking_client, settings.consumer_id, metrics)
        return instance

    def _start_due_scan(self) -> None:
        """The retry due scan (retry_notices.DueScan) of this app, announcing due retry records."""
        if not self.settings.consumer_id:
            return
        scan = DueScan(
            self._connection.client,
            self.settings.consumer_id,
            self._clock,
            self.metrics,
            call_timeout=call_timeout(self.settings),
        )
        self._due_scan = Supervised(
            f"retry due scan of {self.name!r}", scan.run, on_state=self.metrics.loop_state("retry")
        )
        self._due_scan.start()

    def _start_gauges(self) -> None:
        """The pending-per-topic gauge (gauges.py), for apps with delayed messaging on."""
        if self.engine is None:
            return
        gauge = PendingByTopic(
            self._connection.client,
            self.settings.consumer_id,
            self.metrics,
            self._clock,
            call_timeout=call_timeout(self.settings),
            shards=self.settings.shards,
        )
        self._gauge = Supervised(
            f"pending gauge of {self.name!r}", gauge.run, on_state=self.metrics.loop_state("gauge")
        )
        self._gauge.start()

    async def _warn_if_evicting(self) -> None:
        """Log an error when Redis may evict the delay engine's keys.

        An allkeys-* maxmemory-policy drops any key under memory pressure: an
        index bucket, the ids hash or the delayed topic itself, and with them
        pending messages, silently. (volatile-* policies evict only keys with a
        TTL, which the engine's keys never have.) Managed Redis may refuse
        CONFIG: then nothing can be said.
        """
        try:
            async with asyncio.timeout(call_timeout(self.settings)):
                got = await self._connection.client.config_get("maxmemory-policy")
        except (RedisError, TimeoutError):
            return
        value = next(iter(dict(got).values()), b"")
        policy = text(value)
        if policy.startswith("allkeys"):
            log.error(
                "instance %r: Redis maxmemory-policy is %s: under memory pressure Redis may evict the delay "
                "engine's keys and pending delayed messages with them; use noeviction (or a volatile-* "
                "policy) for this Redis",
                self.name,
                policy,
            )

    def _context(self) -> plan.PlanContext:
        return plan.PlanContext(
            now_ms=self._clock.now_ms(),
            pubsub_name=self.name,
            enabled=self.settings.enable_delayed_messaging,
            max_delay_ms=self.settings.max_delay_ms,
            default_target_pubsub=self.settings.default_target_pubsub,
        )

    def _stream_checked(self, topic: str) -> bool:
        """Whether `topic` was seen to be a stream (or absent) lately: no TYPE call needed."""
        return self._clock.now_ms() - self._stream_topics.get(topic, -_TYPE_CACHE_MS) < _TYPE_CACHE_MS

    async def _check_stream(self, topic: str) -> None:
        """FailedPreconditionError unless `topic`'s key is a stream or absent."""
        if self._stream_checked(topic):
            return
        now = self._clock.now_ms()
        try:
            async with asyncio.timeout(call_timeout(self.settings)):
                kind = await self._connection.client.type(topic)
        except (RedisError, TimeoutError) as e:
            raise BackendUnavailableError(f"checking topic {topic!r}: redis: {e or 'timed out'}") from e
        kind_s = text(kind)
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
        if len(envelopes) == 1:
            if not self._stream_checked(envelopes[0].topic):
                await self._check_stream(envelopes[0].topic)
        else:
            for topic in {e.topic for e in envelopes}:
                await self._check_stream(topic)
        # One token for the call and its retries: a reply lost after the write
        # landed makes the retry a no-op in Redis, so the publish is answered
        # OK and stored once (the client library itself never resends).
        token = secrets.token_hex(8)
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
                    await self.engine.schedule(envelopes, token=token, timeout_s=self._call_timeout)
                    break
                except (PartiallyStoredError, OSError, RedisConnectionError) as e:
                    cause = e.__cause__ if isinstance(e, PartiallyStoredError) else e
                    if backoff is None:
                        backoff = Backoff(base_s=0.02, cap_s=0.5)
                    if not isinstance(cause, _DROPPED) or backoff.failures >= max(
                        1, self.settings.max_retries
                    ):
                        raise
                await asyncio.sleep(backoff.next())
        except (RedisError, TimeoutError, OSError) as e:
            raise BackendUnavailableError(
                f"scheduling on {self.engine.keys.stream!r}: redis: {e or 'timed out'}"
            ) from e
        if any(e.due_ms <= self._clock.now_ms() for e in envelopes):
            self.engine.wake()

    async def _cancel(self, cancels: Sequence[plan.Cancel]) -> None:
        """Withdraw pending messages or schedules (scheduleCancel), in one script call per
        few hundred. An unknown id is not an error: it may have fired or been cancelled already."""
        if self.engine is None:
            raise DelayedPubSubError("delayed messaging is not enabled on this instance")
        ids = [c.schedule_id for c in cancels]
        try:
            async with asyncio.timeout(call_timeout(self.settings)):
                results = await self.engine.cancel_many(ids)
        except (RedisError, TimeoutError) as e:
            raise BackendUnavailableError(
                f"cancelling {len(ids)} id(s) on {self.engine.keys.stream!r}: redis: {e or 'timed out'}"
            ) from e
        # A bulk of cancels is thousands per second: the cancelled ones are
        # counted in one line (each at debug), the unknown ones named each.
        stream = self.engine.keys.stream
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
        """Store one message on `topic`, or on the delayed topic when its metadata delays it.

        Everything is validated (plan.plan_publish) before anything is written:
        a refused request stores nothing.
        """
        p = plan.plan_publish(topic, data, metadata, content_type, self._context())
        if self.storage_format < storage_format.CURRENT:
            why = self._needs_current([d.envelope for d in p.delayed], p.control)
            if why is not None:
                raise storage_format.pinned_refusal(self.storage_format, why)
        if p.immediate:
            await self._publish_now(topic, p.immediate[0].entry)
            self.metrics.published_immediate.inc()
        if p.delayed:
            await self._schedule([d.envelope for d in p.delayed])
            self.metrics.published_delayed.inc()
        if p.cancels:
            await self._cancel(p.cancels)
        if p.control is not None:
            await self._control(p.control)

    @staticmethod
    def _needs_current(envelopes: Sequence[env.Envelope], control: Control | None) -> str | None:
        """What in a planned publish the previous release's storage format cannot hold, if anything
        (a string check per envelope: the rollback window costs the publish path no Redis call)."""
        if isinstance(control, Pause) and control.pause:
            return "schedulePause: true (a paused message)"
        for e in envelopes:
            why = storage_format.needs_current(e.schedule)
            if why is not None:
                return why
        return None

    async def _control(self, request: Control) -> None:
        """Execute a schedulePause or a scheduleIdPrefix cancel (control.py); see pausing.py."""
        if self.engine is None:
            raise DelayedPubSubError("delayed messaging is not enabled on this instance")
        try:
            await control_request(self.engine, request, self.metrics, log)
        except (RedisError, TimeoutError) as e:
            raise BackendUnavailableError(
                f"{type(request).__name__} on {self.engine.keys.stream!r}: redis: {e or 'timed out'}"
            ) from e

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
        if self.storage_format < storage_format.CURRENT and p.delayed:
            # In the rollback window: each entry that needs the newer format fails alone.
            keep: list[plan.Delayed] = []
            for d in p.delayed:
                why = storage_format.needs_current(d.envelope.schedule)
                if why is None:
                    keep.append(d)
                else:
                    refusal = str(storage_format.pinned_refusal(self.storage_format, why))
                    failed += [FailedEntry(i, refusal) for i in d.entry_ids]
            p = dataclasses.replace(p, delayed=tuple(keep))
        stored_some = False
        if p.delayed:
            stored = len(p.delayed)
            try:
                await self._schedule([d.envelope for d in p.delayed])
            except DelayedPubSubError as err:
                # Only what is not stored failed: a retry of the rest would
                # store those twice.
                stored = err.stored if isinstance(err, PartiallyStoredError) else 0
                failed += [FailedEntry(i, str(err)) for d in p.delayed[stored:] for i in d.entry_ids]
            stored_some = stored > 0
            self.metrics.published_delayed.inc(sum(len(d.entry_ids) for d in p.delayed[:stored]))
        if p.cancels:
            try:
                await self._cancel(p.cancels)
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
        loops += [f.loop for f in ([self.forwarder, *self._shard_forwarders] if self.forwarder else [])]
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
        for f in [self.forwarder, *self._shard_forwarders] if self.forwarder is not None else []:
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


async def _settle_format(connection: Connection, settings: Settings) -> int:
    """The app's storage format, settled on every shard (storage_format.settle_format): once per
    Init, so the publish path only reads the instance's copy."""
    keys = [EngineKeys.for_topic(t) for t in shard_topics(settings.consumer_id, settings.shards)]
    try:
        fmt = await storage_format.settle_format(
            connection.client,
            keys,
            settings.storage_format,
            consumer_id=settings.consumer_id,
            timeout_s=call_timeout(settings),
        )
    except (RedisError, TimeoutError) as e:
        raise BackendUnavailableError(
            f"reading the storage format of {keys[0].stream!r}: redis: {e or 'timed out'}"
        ) from e
    if fmt < storage_format.CURRENT:
        log.warning(
            "%r: delayed data kept in storage %s (the rollback window): compaction is off and "
            "publishes needing %s are refused; set %s: %d once no replica runs an older release",
            keys[0].stream,
            storage_format.describe(fmt),
            storage_format.describe(storage_format.CURRENT),
            storage_format.SETTING,
            storage_format.CURRENT,
        )
    return fmt


def _sharded_engine(
    connection: Connection,
    settings: Settings,
    clock: Clock,
    broker: Broker,
    metrics: InstanceMetrics,
    name: str,
    fmt: int,
) -> ShardedEngine:
    """The delay engine over the delayed topic's shard streams (keys.shard_topics).

    On Redis Cluster the fire is two-phase (target topics live in other hash
    slots than the shard); on a single node or Sentinel it is one script.
    Below the newest storage format compaction is off: the envelopes it
    re-homes are lost to the previous release. At the newest, each shard's
    fire loop starts with a sweep that re-indexes the envelopes such a release
    left out of the due index (engine/recovery.py).
    """
    topics = shard_topics(settings.consumer_id, settings.shards)
    pending = [0] * len(topics)

    def on_batch(shard: int) -> Callable[[FireReport], None]:
        # The pending gauge is the instance's total over its shards.
        def hook(report: FireReport) -> None:
            pending[shard] = report.pending
            metrics.on_fire(dataclasses.replace(report, pending=sum(pending)))

        return hook

    pinned = fmt < storage_format.CURRENT
    return build_engine(
        settings,
        connection.client,
        clock,
        # In the window nothing is moved, so no release can have orphaned a moved copy either.
        config=engine_config(settings, compact_check_every=0, recover_orphans=False) if pinned else None,
        trim=broker.trim,
        pubsub_name=name,
        on_batch=on_batch,
        listen_client=connection.blocking_client,
        recurrence=EnvelopeRecurrence(),
        on_listener_state=metrics.loop_state("wake"),
    )


class Instances:
    """The component instances served on one socket, by name.

    With a RecordStore it also makes a restart of `serve` survivable under a
    running daprd (which calls Init only once, at its own start):

    - every successful Init is recorded (records.py), and a call for an
      instance this process has not seen Init'ed restores it from its record
      first: once, under that instance's lock, while concurrent callers wait;
    - the topics with open PullMessages streams are recorded too. daprd never
      re-opens a stream, so topics a previous process had open are *orphaned*
      until daprd re-opens them (it restarted) or re-Inits the instance. They
      are logged at ERROR once each, counted in a gauge, and reported to
      `on_change` (the server turns its subscriptions health NOT_SERVING).

    A topic from a record is only *suspect* at first: if daprd restarted too,
    its Init arrives within seconds and clears it. It turns orphaned when a
    call for the instance arrives without an Init (proof that the daprd which
    opened the streams is alive and will not re-open them) or when
    `orphan_grace_s` passes with neither. But when daprd Init'ed *other*
    instances in this process and, `orphan_grace_s` later, neither Init'ed nor
    called this one, its component is gone from daprd (its YAML was removed
    before daprd restarted): its topics are dropped, not reported.
    """

    def __init__(
        self,
        clock: Clock,
        metrics: Metrics,
        records: RecordStore | None = None,
        orphan_grace_s: float = 30.0,
        *,
        background: bool = True,
    ) -> None:
        self._clock = clock
        self._metrics = metrics
        # False under `serve --workers N`: the workers run the instances' background loops.
        self._background = background
        # Called with live_properties() whenever an instance is opened, replaced or closed.
        self.on_live_change: Callable[[dict[str, dict[str, str]]], None] | None = None
        self._instances: dict[str, Instance] = {}
        self._lock = asyncio.Lock()
        self._records = records
        self._orphan_grace_s = orphan_grace_s
        # One lock per instance name: Init and restore of one name are serialized,
        # and a slow Redis behind one instance does not hold up the others.
        self._name_locks: dict[str, asyncio.Lock] = {}
        # The Init metadata each live instance was built from (rewritten into
        # its record whenever its topics change).
        self._props: dict[str, dict[str, str]] = {}
        # Open PullMessages streams: name -> topic -> count, and stream -> (name, topic).
        self._open: dict[str, dict[str, int]] = {}
        self._streams: dict[Subscription, tuple[str, str]] = {}
        self._suspect: dict[str, set[str]] = {}
        self._orphaned: dict[str, set[str]] = {}
        self._told: set[tuple[str, str]] = set()
        self._restore_failures: dict[str, _RestoreFailure] = {}
        self._grace_task: asyncio.Task[None] | None = None
        self._after_init_task: asyncio.Task[None] | None = None
        self._daprd_inited = False
        # The records read at start, for rewriting those of instances daprd no longer has.
        self._found: dict[str, InitRecord] = {}
        self._closing = False
        self.on_change: Callable[[], None] | None = None
        """Called when the set of orphaned subscriptions changes."""

    def start(self) -> None:
        """Read the records a previous process left; arm the orphan timer for their topics."""
        if self._records is None:
            return
        for record in self._records.load_all():
            if record.topics and record.instance not in self._instances:
                self._suspect[record.instance] = set(record.topics)
                self._found[record.instance] = record
        if self._suspect:
            log.warning(
                "a previous process had subscriptions open: %s; unless daprd Inits them again (it restarted "
                "too) they are orphaned, at once when daprd calls them or after %gs",
                _describe(self._suspect),
                self._orphan_grace_s,
            )
            self._grace_task = asyncio.create_task(self._settle_later(), name="orphan grace")

    async def _settle_later(self) -> None:
        await self._clock.sleep(self._orphan_grace_s)
        self._settle()

    def _settle(self) -> None:
        """Decide about the recorded topics nobody has claimed `orphan_grace_s` after the start
        (or after daprd's last Init): orphaned, or dropped if daprd no longer has the instance."""
        for name in list(self._suspect):
            if not self._daprd_inited:
                self._orphan(name, self._suspect.pop(name))
        if not self._daprd_inited:
            return
        for name in sorted(set(self._suspect) | set(self._orphaned)):
            if name in self._instances:
                continue  # called or Init'ed in this process: daprd has it
            topics = self._suspect.pop(name, set()) | self._orphaned.pop(name, set())
            log.info(
                "instance %r: daprd Init'ed other instances but has not called this one for %gs: its "
                "component is gone from daprd; its recorded subscriptions (%s) are dropped, not orphaned",
                name,
                self._orphan_grace_s,
                ", ".join(sorted(topics)),
            )
            found = self._found.pop(name, None)
            if found is not None and self._records is not None:
                with contextlib.suppress(OSError, RecordRefusedError):
                    self._records.save(InitRecord(name, found.properties, (), self._clock.now_ms()))
            self._orphans_changed(name)

    def _name_lock(self, name: str) -> asyncio.Lock:
        return self._name_locks.setdefault(name, asyncio.Lock())

    async def init(self, name: str, props: Mapping[str, str]) -> Instance:
        """Parse, connect and register `name`, replacing (and closing) any previous Init of it.

        On failure the previous instance, if any, stays as it was. On success
        the Init is recorded, and subscriptions a previous process had open for
        `name` are no longer counted orphaned: daprd re-Inits a component when
        it (re)starts or reloads it, and then opens whatever it subscribes.
        """
        # Before parsing: a misspelt key may be why the parse fails (redisHots: "redisHost required").
        for warning in unknown_keys(props):
            log.warning("instance %r: %s", name, warning)
        settings = parse_settings(props)
        async with self._name_lock(name):
            instance = await Instance.open(
                name, settings, self._clock, self._metrics.for_instance(name), background=self._background
            )
            async with self._lock:
                old = self._instances.get(name)
                self._instances[name] = instance
            self._props[name] = dict(props)
            self._live_changed()
            self._restore_failures.pop(name, None)
            cleared = self._suspect.pop(name, set()) | self._orphaned.pop(name, set())
            self._found.pop(name, None)
            self._write_record(name)
            # A daprd (re)started or reloaded: the instances it has are Init'ed in a
            # burst; recorded ones it does not Init are settled once the burst is over.
            self._daprd_inited = True
            if self._suspect or self._orphaned:
                if self._after_init_task is not None:
                    self._after_init_task.cancel()
                self._after_init_task = asyncio.create_task(self._settle_later(), name="orphan settle")
        if cleared:
            log.info("instance %r: daprd Init'ed it again; it re-opens its subscriptions itself", name)
            self._orphans_changed(name)
        if old is not None:
            log.info("instance %r re-initialized; closing the previous one", name)
            await old.close()
        log.info(
            "instance %r initialized: redis %s, consumerID %r", name, settings.address, settings.consumer_id
        )
        return instance

    def find(self, name: str) -> Instance | None:
        """The instance named `name` if this process has it (Init'ed or restored), else None."""
        return self._instances.get(name)

    def get(self, name: str) -> Instance:
        """The instance named `name`; NotInitializedError if daprd has not called Init for it."""
        try:
            return self._instances[name]
        except KeyError:
            raise NotInitializedError(name) from None

    async def ready(self, name: str) -> Instance:
        """The instance named `name`, restored from its Init record if this process has not seen its Init.

        NotInitializedError if there is no record; RestoreFailedError (also a
        NotInitializedError) if the record is refused or its Init fails for
        good; BackendUnavailableError if Redis is unreachable (a later call
        tries again, after a backoff during which calls fail at once).
        """
        instance = self._instances.get(name)
        if instance is not None:
            return instance
        if self._records is None or not self._records.has(name):
            # Nothing to restore (and no lock kept for names nobody Init'ed).
            raise NotInitializedError(name)
        async with self._name_lock(name):
            # Whoever held the lock may have restored it (or daprd Init'ed it).
            instance = self._instances.get(name)
            if instance is not None:
                return instance
            failure = self._restore_failures.get(name)
            if failure is not None and self._clock.now_ms() < failure.retry_at_ms:
                raise failure.error
            try:
                instance = await self._restore(name)
            except NotInitializedError as e:
                if not isinstance(e, RestoreFailedError):
                    raise  # never Init'ed, nothing recorded: the plain "call Init first"
                self._failed_restore(name, e, failure)
                raise
            except BackendUnavailableError as e:
                self._failed_restore(name, e, failure)
                raise
            self._restore_failures.pop(name, None)
            return instance

    def _failed_restore(self, name: str, error: DelayedPubSubError, previous: _RestoreFailure | None) -> None:
        backoff = previous.backoff if previous is not None else Backoff(base_s=0.5, cap_s=10.0)
        retry_at_ms = self._clock.now_ms() + int(backoff.next() * 1000)
        self._restore_failures[name] = _RestoreFailure(error, retry_at_ms, backoff)
        log.error("%s", error)

    async def _restore(self, name: str) -> Instance:
        assert self._records is not None
        try:
            record = self._records.load(name)
        except (RecordRefusedError, OSError) as e:
            raise RestoreFailedError(name, f"its record was refused: {e}") from e
        if record is None:
            raise NotInitializedError(name)
        try:
            settings = parse_settings(record.properties)
            instance = await Instance.open(
                name, settings, self._clock, self._metrics.for_instance(name), background=self._background
            )
        except BackendUnavailableError as e:
            raise BackendUnavailableError(
                f"component instance {name!r} restarting from its Init record {record.path}: {e}"
            ) from e
        except DelayedPubSubError as e:
            raise RestoreFailedError(name, f"Init from {record.path} failed: {e}") from e
        async with self._lock:
            self._instances[name] = instance
        self._props[name] = dict(record.properties)
        self._live_changed()
        log.warning(
            "instance %r: called without an Init in this process (the component restarted under a "
            "running daprd); re-initialized from its Init record %s of %s: redis %s, consumerID %r",
            name,
            record.path,
            _iso(record.written_at_ms),
            settings.address,
            settings.consumer_id,
        )
        # The daprd that opened this instance's streams is alive and did not
        # re-Init it: those streams died with the previous process for good.
        self._found.pop(name, None)
        self._orphan(name, self._suspect.pop(name, set()) | set(record.topics))
        return instance

    async def subscribe(
        self, name: str, instance: Instance, topic: str, metadata: Mapping[str, str]
    ) -> Subscription:
        """Open a subscription on `instance` for one PullMessages stream, and record its topic."""
        sub = await instance.subscribe(topic, metadata)
        counts = self._open.setdefault(name, {})
        counts[topic] = counts.get(topic, 0) + 1
        self._streams[sub] = (name, topic)
        resumed = False
        for known in (self._suspect.get(name), self._orphaned.get(name)):
            if known is not None and topic in known:
                known.discard(topic)
                resumed = True
        if resumed:
            log.info("instance %r: daprd opened topic %r again; it is no longer orphaned", name, topic)
            self._orphans_changed(name)
        if counts[topic] == 1 or resumed:
            self._write_record(name)
        return sub

    async def unsubscribe(self, instance: Instance, sub: Subscription) -> None:
        """Close a stream's subscription. Unless this process is shutting down
        (then daprd loses the stream for good, and the record must keep it),
        its topic leaves the record once no stream of it is open."""
        where = self._streams.pop(sub, None)
        await instance.unsubscribe(sub)
        if where is None or self._closing:
            return
        name, topic = where
        counts = self._open.get(name, {})
        counts[topic] = counts.get(topic, 1) - 1
        if counts[topic] <= 0:
            del counts[topic]
            self._write_record(name)

    def orphaned(self) -> dict[str, frozenset[str]]:
        """instance -> topics whose streams a previous process had open and daprd has not re-opened."""
        return {name: frozenset(t) for name, t in self._orphaned.items() if t}

    def live_properties(self) -> dict[str, dict[str, str]]:
        """The Init metadata of every live instance, by name."""
        return {name: dict(self._props[name]) for name in self._instances if name in self._props}

    def _live_changed(self) -> None:
        if self.on_live_change is not None:
            self.on_live_change(self.live_properties())

    def items(self) -> list[tuple[str, Instance]]:
        """The live instances (a snapshot)."""
        return list(self._instances.items())

    def _orphan(self, name: str, topics: set[str]) -> None:
        topics = topics - set(self._open.get(name, ()))
        if not topics:
            return
        self._orphaned.setdefault(name, set()).update(topics)
        for topic in sorted(topics):
            if (name, topic) in self._told:
                continue
            self._told.add((name, topic))
            log.error(
                "instance %r: the subscription to topic %r was open before this component restarted and "
                "daprd never re-opens a subscription stream: nothing is delivered on it until daprd is "
                "restarted. Restart daprd (in Kubernetes: the pod) to resume it; its messages wait in "
                "Redis meanwhile, none is lost",
                name,
                topic,
            )
        self._orphans_changed(name)

    def _orphans_changed(self, name: str) -> None:
        self._metrics.orphaned_subscriptions.labels(name).set(len(self._orphaned.get(name, ())))
        if self.on_change is not None:
            self.on_change()

    def _write_record(self, name: str) -> None:
        if self._records is None or name not in self._props:
            return
        topics = (
            set(self._open.get(name, ())) | self._suspect.get(name, set()) | self._orphaned.get(name, set())
        )
        record = InitRecord(name, self._props[name], tuple(sorted(topics)), self._clock.now_ms())
        try:
            self._records.save(record)
        except (OSError, RecordRefusedError) as e:
            # The call itself succeeded; only restart safety is lost: say so loudly.
            log.error(
                "instance %r: cannot write its Init record in %s (%s): a restart of this component will "
                "need a restart of daprd",
                name,
                self._records.folder,
                e,
            )

    async def drain(self, within_s: float) -> None:
        """First step of a graceful stop: send nothing new on any stream, give the
        messages daprd is processing up to `within_s` seconds to be acked, then end
        every stream. Unacked messages stay pending in Redis; the streams' topics
        stay recorded, so the next process reports them orphaned."""
        self._closing = True
        for _, instance in self.items():
            instance.pause()
        subs = list(self._streams)
        waited = 0.0
        while any(s.in_flight for s in subs) and waited < within_s:
            await self._clock.sleep(0.05)
            waited += 0.05
        left = sum(s.in_flight for s in subs)
        if left:
            log.warning(
                "%d delivered messages not acked within %gs; they stay pending in Redis", left, within_s
            )
        for sub in subs:
            sub.stop()

    async def close(self) -> None:
        """Close every instance (recorded topics stay recorded)."""
        self._closing = True
        for task in (self._grace_task, self._after_init_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._grace_task = self._after_init_task = None
        instances = list(self._instances.values())
        self._instances.clear()
        self._live_changed()
        await asyncio.gather(*(i.close() for i in instances), return_exceptions=True)


# A connection that dropped (a lost reply among them): the schedule step is
# idempotent under its token, so it is retried.
_DROPPED = (OSError, RedisConnectionError)

_TYPE_CACHE_MS = 60_000
_TYPE_CACHE_SIZE = 10_000


@dataclass(frozen=True)
class _RestoreFailure:
    error: DelayedPubSubError
    retry_at_ms: int
    backoff: Backoff


def _describe(topics: Mapping[str, set[str]]) -> str:
    return "; ".join(f"{name!r}: {', '.join(sorted(t))}" for name, t in sorted(topics.items()))


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="seconds")
