"""The Redis Streams broker: publish, bulk publish, and one subscription per PullMessages stream.

Layout, as pubsub.redis has it (so existing deployments read as they are):
  - a topic is a stream of the same name, entries written by delayed_middleware.entry;
  - subscribers of one app share the consumer group `<consumerID>` created from the
    start of the stream (MKSTREAM), each stream reading as its own consumer;
  - an entry stays in the group's PEL from delivery to XACK, so whatever dies —
    the stream, the process, Redis's connection — it is never lost: a live
    subscription reclaims it after processingTimeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.exceptions

from delayed_middleware.aio import raise_if_stopped, retrying, text
from delayed_middleware.backoff import Backoff
from delayed_middleware.clock import Clock
from delayed_middleware.entry import StreamEntry, Trim, decode_entry, encode_entry
from delayed_middleware.errors import BackendUnavailableError, DelayedPubSubError
from delayed_middleware.liveness import Supervised
from delayed_pubsub.claims import Claimed, claim_unchanged, nack_hold
from delayed_pubsub.connection import REDIS_ERRORS, TRANSIENT_ERRORS, RedisClient, call_timeout
from delayed_pubsub.lua import DELETE_IDLE_CONSUMER
from delayed_pubsub.metrics import InstanceMetrics, Metrics
from delayed_pubsub.redelivery import Retrier
from delayed_pubsub.settings import Settings

log = logging.getLogger(__name__)

T = TypeVar("T")

_CLOSE_ERRORS: tuple[type[BaseException], ...] = (*REDIS_ERRORS, TimeoutError)

DELIVERY_ATTEMPT = "deliveryAttempt"

# Backoff between retries of a failing Redis call inside a subscription. The cap
# keeps recovery after a Redis restart quick without hammering a dead server.
BACKOFF_BASE_S = 0.05
BACKOFF_CAP_S = 2.0

# How long the fetch loop waits for more acks when less than half the window is free.
FETCH_LINGER_S = 0.002
# Under load, how long a queued XADD waits for others to share its round trip,
# unless this many are already queued.
PUBLISH_LINGER_S = 0.001
PUBLISH_LINGER_BELOW = 32
# How long acks gather before one XACK sends them all (unless half a window is in).
ACK_LINGER_S = 0.002
# How long they may wait instead when the fetch loop waits for the slots they free:
# the read that fills those slots carries them, one round trip for both, unless the
# subscriber is slower than this (daprd calls the app for each message in turn).
ACK_LINGER_MAX_S = 0.01
# A reclaim pass reads at most this many XPENDING pages to find its count of abandoned
# entries among those it holds or that wait out a retry backoff; the next pass goes on.
RECLAIM_PAGES = 4
# How many rows a page adds for entries this stream holds (XPENDING lists them too).
RECLAIM_OWNED_SLACK = 256
# The fewest rows a reclaim pass asks XPENDING for at a time.
RECLAIM_PAGE_MIN = 100


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


@dataclass(frozen=True)
class Delivery:
    """One message handed to a subscriber; `id` is the stream entry id, used to ack it."""

    id: str
    topic: str
    entry: StreamEntry
    attempt: int

    @property
    def metadata(self) -> dict[str, str]:
        """The publish metadata plus `deliveryAttempt` (1 on first delivery)."""
        return {**self.entry.metadata, DELIVERY_ATTEMPT: str(self.attempt)}


class Broker:
    """Publishes to topic streams and opens subscriptions, all on one client."""

    def __init__(
        self,
        client: RedisClient,
        settings: Settings,
        clock: Clock,
        metrics: InstanceMetrics | None = None,
        blocking_client: RedisClient | None = None,
    ) -> None:
        self._client = client
        # XREADGROUP BLOCK parks a connection: outside poolSize (connection.Connection).
        self._blocking_client = blocking_client if blocking_client is not None else client
        self._settings = settings
        self._clock = clock
        self._metrics = metrics or Metrics().for_instance("")
        self._timeout = call_timeout(settings)
        self._batcher = _PublishBatcher(client)

        self.trim = trim_policy(settings)

    def _trim(self) -> dict[str, Any]:
        mode, threshold = self.trim.args(self._clock.now_ms())
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
        pipe = self._client.pipeline(transaction=False)
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
                await self._client.ping()
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
            self._client,
            self._settings,
            self._clock,
            topic,
            unique,
            paused,
            self._metrics,
            blocking_client=self._blocking_client,
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

    def __init__(self, client: RedisClient) -> None:
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


class Subscription:
    """One PullMessages stream's view of a topic.

    Three loops share the state below: a fetch loop (XPENDING and XCLAIM of abandoned
    entries every redeliverInterval, else XREADGROUP BLOCK for new ones) fills
    `_ready`; `deliveries()` hands entries out while fewer than `concurrency` are
    unacked; an ack loop XACKs, in one command per round trip, every ack that
    came in while the previous XACK was on the wire. Nacks wait
    redeliverInterval and XCLAIM the entry back, which bumps its delivery count,
    unless another stream delivered it meanwhile (the claim names the nacked
    count); with a retry policy (`retry`) the Retrier decides instead.
    Entries past their `expiresAt` are acked away, never delivered. Every Redis
    call is retried until it works or the subscription closes: daprd never
    re-opens a stream that ended.
    """

    def __init__(
        self,
        client: RedisClient,
        settings: Settings,
        clock: Clock,
        topic: str,
        consumer: str,
        paused: bool = False,
        metrics: InstanceMetrics | None = None,
        blocking_client: RedisClient | None = None,
    ) -> None:
        self.topic = topic
        self._metrics = metrics or Metrics().for_instance("")
        self.consumer = consumer
        self._client = client
        self._blocking_client = blocking_client if blocking_client is not None else client
        self._settings = settings
        self._clock = clock
        self._group = settings.consumer_id
        self._paused = paused
        self._closed = False
        self._shut = False
        self._ready: deque[Delivery] = deque()
        # When each buffered delivery was claimed or read (loop time): one that waited long
        # is checked before it is handed out (_still_ours).
        self._ready_at: dict[str, float] = {}
        # Sent to the subscriber and not yet acked or nacked, with the attempt
        # it was sent as: each holds a slot, and only these may be acked.
        self._unacked: dict[str, int] = {}
        # Every id this stream is responsible for (ready, unacked, waiting to be
        # redelivered, or acked and not yet XACKed): a reclaim pass must not hand
        # these out a second time.
        self._owned: set[str] = set()
        # Acked (or expired) ids not yet sent to Redis, and the future the ack
        # loop resolves once the XACK holding them has landed.
        self._acks: list[str] = []
        self._acks_landed: asyncio.Future[None] | None = None
        # When the first of the queued acks came (loop time): the ack loop sends them
        # ACK_LINGER_S after it, unless a read has carried them by then.
        self._acks_since = 0.0
        # True while the fetch loop waits for free slots or an empty buffer: its
        # next read will carry the queued acks (_read_new_acking).
        self._reading_soon = False
        # The batches on the wire (the ack loop's, a read's), each with its future.
        self._acking: list[tuple[list[str], asyncio.Future[None] | None]] = []
        self._ack_wake = asyncio.Event()
        self._can_send = asyncio.Event()
        self._can_fetch = asyncio.Event()
        # Read when at least half the window is free (or nothing is in flight),
        # so one XREADGROUP fills many slots instead of one read per ack.
        self._low_water = max(1, min(settings.concurrency // 2, settings.queue_depth))
        self._fetcher: Supervised | None = None
        self._acker: Supervised | None = None
        self._timers: set[asyncio.Task[None]] = set()
        self._reclaim_cursor = "-"
        self._reclaim_round_at = time.monotonic()
        # The retry policy's executor (redelivery.py), when one is configured; set before start().
        self.retry: Retrier | None = None
        # Short blocks keep a dead connection from going unnoticed for long.
        self._block_ms = 1000
        base = call_timeout(settings)
        self._timeout = None if base is None else base + self._block_ms / 1000

    # --- lifecycle ------------------------------------------------------------

    async def start(self) -> None:
        """Create the consumer group (retrying while Redis is down) and start fetching."""
        await self._retrying("XGROUP CREATE", self._create_group)
        raise_if_stopped(self._closed)  # stopped while creating the group
        # Supervised: without the fetch loop nothing new is ever sent, and daprd
        # (which never re-opens a stream) would wait on this one forever; without
        # the ack loop every message would come back after processingTimeout.
        # Whatever ends either but our stop is logged, counted and restarted.
        self._fetcher = Supervised(
            f"fetch loop of {self.topic} as {self.consumer}",
            self._fetch_loop,
            backoff=Backoff(base_s=BACKOFF_BASE_S, cap_s=BACKOFF_CAP_S),
            on_state=self._metrics.loop_state("fetch"),
        )
        self._acker = Supervised(
            f"ack loop of {self.topic} as {self.consumer}",
            self._ack_loop,
            backoff=Backoff(base_s=BACKOFF_BASE_S, cap_s=BACKOFF_CAP_S),
            on_state=self._metrics.loop_state("ack"),
        )
        self._fetcher.start()
        self._acker.start()
        if self.retry is not None:
            self.retry.room = self._room
            self.retry.start(lambda i, f, attempt: self._push(i, f, attempt, requeue=True), self._give_up)

    def loops(self) -> list[Supervised]:
        """The subscription's supervised loops (fetch, ack, and the retry poller), once started."""
        found = [loop for loop in (self._fetcher, self._acker) if loop is not None]
        if self.retry is not None and self.retry.loop is not None:
            found.append(self.retry.loop)
        return found

    def stop(self) -> None:
        """Make deliveries() end; close() finishes the job."""
        self._closed = True
        # Our stop flag (see delayed_middleware.liveness): the loops end on it.
        for loop in (self._fetcher, self._acker):
            if loop is not None:
                loop.stop_flag.set()
        if self.retry is not None:
            self.retry.stop()
        self._can_send.set()
        self._can_fetch.set()
        self._ack_wake.set()

    async def close(self) -> None:
        """Stop fetching and sending, XACK what was acked, and remove our consumer if it holds nothing.

        Whatever was fetched and not acked stays pending in Redis, and comes
        back after processingTimeout.
        """
        if self._shut:
            return
        self._shut = True
        self.stop()
        timers = list(self._timers)
        for task in timers:
            task.cancel()
        loops = [loop.stop() for loop in (self._fetcher, self._acker) if loop is not None]
        await asyncio.gather(*loops, *timers, return_exceptions=True)
        if self.retry is not None:
            await self.retry.close()
        # The batch that was on the wire when the ack loop was cancelled may or
        # may not have landed: XACK is idempotent, send it again with the rest.
        last = [*(i for batch, _ in self._acking for i in batch), *self._acks]
        try:
            if last:
                await asyncio.wait_for(self._client.xack(self.topic, self._group, *last), timeout=2)
                self._metrics.acked.inc(len(last))
            await asyncio.wait_for(
                self._client.eval(DELETE_IDLE_CONSUMER, 1, self.topic, self._group, self.consumer),
                timeout=2,
            )
        except _CLOSE_ERRORS as e:
            # Harmless: an idle consumer left behind holds nothing, and an ack
            # that did not land means one redelivery after processingTimeout.
            log.info("closing consumer %s of %s: %s", self.consumer, self.topic, e)
        finally:
            for landed in (self._acks_landed, *(f for _, f in self._acking)):
                if landed is not None and not landed.done():
                    landed.set_result(None)
            self._acks, self._acking = [], []

    @property
    def closed(self) -> bool:
        """True once stop() or close() has been called."""
        return self._closed

    @property
    def buffered(self) -> int:
        """Entries read from Redis (pending for this stream) and not yet handed to the subscriber."""
        return len(self._ready)

    @property
    def in_flight(self) -> int:
        """Messages sent to the subscriber and not yet acked or nacked (a graceful stop waits for them)."""
        return len(self._unacked)

    def pause(self) -> None:
        """Stop handing out new messages (acks still go through)."""
        self._paused = True
        self._can_fetch.set()

    def resume(self) -> None:
        """Hand out messages again."""
        self._paused = False
        self._can_send.set()
        self._can_fetch.set()

    # --- the subscriber side ---------------------------------------------------

    async def deliveries(self) -> AsyncIterator[Delivery]:
        """Messages to send, at most `concurrency` unacked at once; ends on close()."""
        limit = self._settings.concurrency
        ready, unacked, delivered = self._ready, self._unacked, self._metrics.delivered
        while not self._closed:
            if ready and not self._paused and len(unacked) < limit:
                delivery = ready.popleft()
                if not await self._still_ours(delivery):
                    self._slot_freed()
                    continue
                if _expired(delivery.entry, self._clock):
                    # Its TTL ended while it waited in our buffer: never delivered.
                    self._expire(delivery.id)
                    if not ready:
                        self._can_fetch.set()
                    continue
                unacked[delivery.id] = delivery.attempt
                if not ready:
                    self._can_fetch.set()  # the fetch loop may wait for an empty buffer
                delivered.inc()
                yield delivery
                continue
            self._can_send.clear()
            await self._can_send.wait()

    async def _still_ours(self, delivery: Delivery) -> bool:
        """Whether a buffered delivery may be handed out: yes at once if it waited less than
        half processingTimeout; else only if nobody has taken it over meanwhile.

        An entry waiting in the buffer sits in our PEL going idle; past processingTimeout
        another stream's reclaim pass may deliver it, and handing out our copy as well
        would deliver it twice at once. NACK_HOLD under the count it came with tells
        (every delivery bumps the count) and resets its idle time, so no reclaim pass takes
        it while the subscriber works on it.
        """
        timeout_ms = self._settings.processing_timeout_ms
        waited = asyncio.get_running_loop().time() - self._ready_at.pop(delivery.id, 0.0)
        if timeout_ms <= 0 or waited * 1000 < timeout_ms / 2:
            return True
        try:
            _, fields = await self._retrying("XCLAIM", lambda: self._nack_hold(delivery.id, delivery.attempt))
        except asyncio.CancelledError:
            if self._closed:
                return False  # closing: it stays pending and comes back after processingTimeout
            raise
        if fields is not None:
            return True
        log.info(
            "%s on %s: taken over while it waited in the buffer (delivery %d); not handed out",
            delivery.id,
            self.topic,
            delivery.attempt,
        )
        self._disown(delivery.id)
        return False

    def ack_nowait(self, entry_id: str) -> bool:
        """The subscriber processed `entry_id`: free its slot and queue its XACK.

        Only an id this stream sent and has not seen acked or nacked counts:
        anything else (an id of another stream, a repeat, garbage) is ignored,
        so a stream cannot ack away a message another stream holds. Returns
        whether the ack was taken.
        """
        if self._unacked.pop(entry_id, None) is None:
            log.debug("ack of %r, which this stream does not hold; ignored", entry_id)
            return False
        self._queue_ack(entry_id)
        self._slot_freed()
        return True

    async def ack(self, entry_id: str) -> None:
        """ack_nowait(), then wait until the XACK holding it has landed (or the subscription closed)."""
        if self.ack_nowait(entry_id) and self._acker is not None and not self._acker.stopping:
            await asyncio.shield(self._ack_landed())

    def nack(self, entry_id: str, error: str = "") -> None:
        """The subscriber failed `entry_id` (with `error`): free its slot and decide its fate (_retry_later).

        The entry stays in the PEL meanwhile, so if this process dies it is
        reclaimed by another consumer after processingTimeout.
        """
        attempt = self._unacked.pop(entry_id, None)
        if attempt is None:
            log.warning("nack of %r, which this stream does not hold; ignored", entry_id)
            return
        self._metrics.nacked.inc()
        self._slot_freed()
        self._retry_later(entry_id, attempt, error)

    def _retry_later(self, entry_id: str, attempt: int, error: str = "") -> None:
        """What happens to a message the subscriber failed on its `attempt`-th delivery.

        Without a retry policy: delivered again after redeliverInterval. With
        one, the Retrier records when it may come back (or dead-letters it).
        """
        if self.retry is not None:
            work: Coroutine[Any, Any, None] = self._retry_nack(entry_id, error, attempt)
        else:
            work = self._redeliver(entry_id, attempt, self._settings.redeliver_interval_ms / 1000)
        timer = asyncio.create_task(work, name=f"redeliver {entry_id}")
        self._timers.add(timer)
        timer.add_done_callback(self._timers.discard)

    async def _retry_nack(self, entry_id: str, error: str, attempt: int) -> None:
        assert self.retry is not None
        try:
            await self.retry.on_nack(entry_id, error, attempt)
        except Exception:
            # Still in the PEL: reclaimed after processingTimeout like any abandoned entry.
            log.exception("retry of %s on %s failed", entry_id, self.topic)
        finally:
            # Its durable retry record (or its dead letter) owns it now: whichever
            # stream of the group the record's time finds redelivers it.
            self._disown(entry_id)
            self._can_fetch.set()

    def _disown(self, entry_id: str) -> None:
        """Forget `entry_id` as ours, unless a later delivery of it is in our buffer or with the
        subscriber (we took it over again while the subscriber still held an earlier one)."""
        if entry_id not in self._unacked and entry_id not in self._ready_at:
            self._owned.discard(entry_id)

    def _give_up(self, claimed: Claimed) -> None:
        """Dead-letter an entry claimed with its deliveries used up (claim_unchanged), in the
        background: a dead-letter topic that refuses writes must not hold up the fetch loop or
        the retry poller. Ours meanwhile, so our own reclaim passes leave it alone."""
        if self.retry is None or self._closed:
            return  # stays pending: another stream gives it up after processingTimeout
        self._owned.add(claimed.id)
        last = claimed.attempt - 1
        reason = (
            f"delivery {last} not answered within processingTimeout "
            f"({self._settings.processing_timeout_ms}ms)"
        )
        timer = asyncio.create_task(self._giving_up(claimed, reason), name=f"give up {claimed.id}")
        self._timers.add(timer)
        timer.add_done_callback(self._timers.discard)

    async def _giving_up(self, claimed: Claimed, reason: str) -> None:
        assert self.retry is not None
        try:
            await self.retry.give_up(claimed, reason)
        except Exception:
            # Still in the PEL, its count past the maximum: given up by the next reclaim pass.
            log.exception("giving up %s on %s failed", claimed.id, self.topic)
        finally:
            self._disown(claimed.id)

    async def _nack_hold(self, entry_id: str, attempt: int) -> tuple[int, Any]:
        return await nack_hold(self._client, self.topic, self._group, self.consumer, entry_id, attempt)

    def _room(self) -> int:
        """Deliveries the window takes now: neither sent and unacked nor waiting in the buffer."""
        return self._settings.concurrency - len(self._unacked) - len(self._ready)

    def _slot_freed(self) -> None:
        if self._ready:
            self._can_send.set()
        if self.retry is not None:
            self.retry.room_freed()
        # Wake the fetch loop once half the window is free, or at the first free
        # slot (it then lingers a moment for more acks), or when nothing is in flight.
        free = self._room()
        if free >= self._low_water or free == 1 or not self._unacked:
            self._can_fetch.set()

    def _expire(self, entry_id: str) -> None:
        """Never deliver `entry_id` (its TTL ended): XACK it with the next batch and count it."""
        log.debug("dropping %s on %s: its TTL ended before delivery", entry_id, self.topic)
        self._metrics.expired.inc()
        self._queue_ack(entry_id)

    def _queue_ack(self, entry_id: str) -> None:
        if not self._acks:
            self._acks_since = asyncio.get_running_loop().time()
        self._acks.append(entry_id)
        self._ack_wake.set()

    def _ack_landed(self) -> asyncio.Future[None]:
        if self._acks_landed is None:
            self._acks_landed = asyncio.get_running_loop().create_future()
        return self._acks_landed

    async def _ack_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if not self._acks:
                self._ack_wake.clear()
                await self._ack_wake.wait()
                continue
            if len(self._acks) < self._low_water or self._reading_soon:
                # Under load acks arrive one per message: gathering them for a
                # moment makes one XACK of many (each Redis call costs ~50 us of
                # CPU in redis-py). Slots are freed already; only Redis waits.
                # Counted from the first queued ack: a read that carried the
                # earlier ones (_read_new_acking) started the count again.
                linger = ACK_LINGER_MAX_S if self._reading_soon else ACK_LINGER_S
                wait_s = self._acks_since + linger - asyncio.get_running_loop().time()
                if wait_s > 0:
                    await asyncio.sleep(wait_s)
                    continue
            batch, landed = self._take_acks()
            try:
                await self._retrying("XACK", functools.partial(self._xack, batch))
            except redis.exceptions.ResponseError as e:
                # Ids come from Redis, so only a key turned into something else
                # gets here; never let it end the stream.
                self._ack_refused(batch, e)
            except BaseException:
                self._acks_back(batch, landed)
                raise
            self._acks_landed_now(batch, landed)

    def _take_acks(self) -> tuple[list[str], asyncio.Future[None] | None]:
        """The acks queued so far, and their future, now on the wire (close() sends them again
        if the call carrying them does not come back)."""
        batch, landed = self._acks, self._acks_landed
        self._acks, self._acks_landed = [], None
        self._acking.append((batch, landed))
        return batch, landed

    def _acks_back(self, batch: list[str], landed: asyncio.Future[None] | None) -> None:
        """A batch whose call failed past its retries: back at the head of the queue, its
        future resolved with the batch that carries it next (or by close()). Left on the
        wire list, nothing would send it before close(), and its entries would time out
        in our PEL and be delivered again by another stream."""
        self._acking = [b for b in self._acking if b[0] is not batch]
        if not batch:
            return
        if not self._acks:
            self._acks_since = asyncio.get_running_loop().time()
        self._acks[:0] = batch
        if landed is not None and not landed.done():

            def carried(_: asyncio.Future[None]) -> None:
                if not landed.done():
                    landed.set_result(None)

            self._ack_landed().add_done_callback(carried)
        self._ack_wake.set()

    def _acks_landed_now(self, batch: list[str], landed: asyncio.Future[None] | None) -> None:
        self._acking = [b for b in self._acking if b[0] is not batch]
        self._owned.difference_update(batch)
        self._metrics.acked.inc(len(batch))
        if landed is not None and not landed.done():
            landed.set_result(None)

    def _ack_refused(self, batch: list[str], e: BaseException) -> None:
        log.warning("cannot ack %d entries on %s: %s", len(batch), self.topic, e)

    async def _xack(self, ids: Sequence[str]) -> Any:
        return await self._client.xack(self.topic, self._group, *ids)

    # --- the Redis side --------------------------------------------------------

    async def _create_group(self) -> None:
        try:
            await self._client.xgroup_create(self.topic, self._group, id="0", mkstream=True)
        except redis.exceptions.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    async def _fetch_loop(self, stop: asyncio.Event) -> None:
        next_reclaim = 0.0
        reclaim_every = self._settings.redeliver_interval_ms / 1000
        backoff = Backoff(base_s=BACKOFF_BASE_S, cap_s=BACKOFF_CAP_S)
        lingered = False
        # Whether this read fills slots that acks freed: then it carries those acks.
        waited = False
        while not self._closed and not stop.is_set():
            try:
                # Fetch no more than the free slots (the buffer holds some): entries
                # read into a buffer sit in our PEL, and could time out there and be
                # claimed twice. With half the window free, and more free slots than
                # entries buffered, fetch even while the buffer is being handed out:
                # PullMessages writes one message at a time, and a fire that lands
                # meanwhile is read at once, not after the last write of the one
                # before. Otherwise wait for the buffer to empty: the read then fills
                # more slots at once, and carries the acks that came meanwhile.
                free = self._room()
                ready = len(self._ready)
                if self._paused or free <= 0 or (ready and (free < self._low_water or free <= ready)):
                    self._reading_soon = waited = not self._paused
                    await self._wait_fetch()
                    continue
                if free < self._low_water and self._unacked and not lingered:
                    # Under load acks come in a stream: a moment's wait lets one
                    # read fill half the window. A slow subscriber costs 2 ms.
                    lingered = waited = self._reading_soon = True
                    await self._wait_fetch(FETCH_LINGER_S)
                    continue
                lingered = False
                # Read ahead no further than one queueDepth: what waits in the buffer
                # ages in our PEL at the pace of the writes, not of the window, and
                # past processingTimeout another stream would deliver it too.
                count = min(self._settings.queue_depth - ready, free)
                if count <= 0:
                    self._reading_soon = waited = True
                    await self._wait_fetch()
                    continue
                carry, waited = waited and bool(self._acks), False
                self._reading_soon = False
                now = time.monotonic()
                # redeliverInterval 0 turns reclaiming off, as in pubsub.redis.
                if reclaim_every > 0 and now >= next_reclaim:
                    next_reclaim = now + reclaim_every
                    if await self._reclaim(count):
                        continue
                if carry and self._acks:  # the ack loop may have sent them during the reclaim
                    await self._read_new_acking(count)
                    continue
                block = self._block_ms
                if reclaim_every > 0:
                    block = max(1, min(block, int((next_reclaim - time.monotonic()) * 1000)))
                await self._retrying("XREADGROUP", functools.partial(self._read_new, count, block))
            except Exception:
                # Whatever _retrying does not handle (a bug, a reply we did not
                # expect) must not end the loop: daprd never re-opens the stream.
                log.exception("fetching %s as %s failed; retrying", self.topic, self.consumer)
                await self._clock.sleep(backoff.next())
            else:
                backoff.reset()

    async def _wait_fetch(self, linger_s: float | None = None) -> None:
        self._can_fetch.clear()
        if linger_s is None:
            await self._can_fetch.wait()
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(linger_s):
                await self._can_fetch.wait()

    async def _read_new_acking(self, count: int) -> None:
        """XACK the queued acks and read up to `count` new entries, in one round trip.

        Under a backlog every read follows acks that freed its slots: sending
        both together halves the Redis calls per message. The read does not
        block (the XACK's reply would wait with it); if it finds nothing, the
        next pass blocks as usual.
        """
        batch, landed = self._take_acks()

        async def call() -> Any:
            pipe = self._client.pipeline(transaction=False)
            pipe.xack(self.topic, self._group, *batch)
            pipe.xreadgroup(self._group, self.consumer, {self.topic: ">"}, count=count)
            acked, read = await pipe.execute(raise_on_error=False)
            if isinstance(read, Exception):
                raise read  # retried as a plain read's error is (XACK is idempotent)
            if isinstance(acked, redis.exceptions.ResponseError):
                self._ack_refused(batch, acked)
            return read

        try:
            reply = await self._retrying("XREADGROUP", call)
        except BaseException:
            self._acks_back(batch, landed)
            raise
        self._acks_landed_now(batch, landed)
        self._push_read(reply)

    async def _read_new(self, count: int, block_ms: int) -> None:
        reply: Any = await self._blocking_client.xreadgroup(
            self._group, self.consumer, {self.topic: ">"}, count=count, block=block_ms
        )
        self._push_read(reply)

    def _push_read(self, reply: Any) -> None:
        for _stream, items in reply or ():
            for raw_id, fields in items:
                self._push(text(raw_id), fields, attempt=1)

    async def _reclaim(self, count: int) -> int:
        """Take over up to `count` entries idle past processingTimeout; returns how many were taken.

        Listed first, claimed after, each only if its delivery count is still the
        listed one (claim_unchanged): a retry poller that took an entry's record
        after it was listed has claimed it, or will, under that same count, and
        exactly one of the two delivers it. Listing takes nothing, so a failure
        anywhere here strands nothing: the next pass lists the same entries.
        """
        listed = await self._idle_entries(count)
        if not listed:
            return 0
        # A repeat after a lost reply claims nothing twice (the first try bumped the
        # counts) and hands back what the first try claimed (the nonce's memo).
        nonce = uuid.uuid4().hex
        claimed = await self._retrying(
            "XCLAIM",
            lambda: claim_unchanged(
                self._client,
                self.topic,
                self._group,
                self.consumer,
                listed,
                self._settings.processing_timeout_ms,
                nonce=nonce,
                max_attempts=self._max_attempts(),
            ),
        )
        for entry in claimed:
            if entry.given_up:
                self._give_up(entry)
            else:
                # requeue: a takeover of an entry whose earlier delivery our subscriber still
                # holds (see _idle_entries) is a delivery of its own.
                self._push(entry.id, entry.fields, entry.attempt, requeue=entry.id in self._unacked)
        if claimed:
            log.info(
                "reclaimed %d entries of %s idle > %dms",
                len(claimed),
                self.topic,
                self._settings.processing_timeout_ms,
            )
        return len(claimed)

    async def _idle_entries(self, count: int) -> dict[str, int]:
        """Up to `count` of the group's entries idle past processingTimeout that we do not hold
        and that wait for no retry, with their delivery counts; the passes go round the PEL.

        Each pass goes on from where the last one stopped (the cursor), and once per
        processingTimeout a pass looks at the PEL's head instead, leaving the cursor where
        it was: an entry that went idle behind the cursor waits at most about two
        processingTimeouts however long a backlog lasts, and the cursor still gets round
        a head that never empties. Entries this stream holds, and entries waiting out a
        retry backoff, do not use up `count`: a pass reads up to RECLAIM_PAGES pages to
        fill it, so a long run of them at the head cannot hide an abandoned entry.
        """
        now = time.monotonic()
        head = False
        if now - self._reclaim_round_at >= self._settings.processing_timeout_ms / 1000:
            head, self._reclaim_round_at = self._reclaim_cursor != "-", now
        cursor = "-" if head else self._reclaim_cursor
        # XPENDING cannot leave out what we hold: the page is that much longer, up to a bound
        # (a page that yields too little is followed by the next one, not stalled on).
        # At least RECLAIM_PAGE_MIN rows: a long run of entries waiting out retry backoffs is
        # crossed in a few calls, and a pass that fills its count early stops inside the page.
        page = max(RECLAIM_PAGE_MIN, count + min(len(self._owned), RECLAIM_OWNED_SLACK))
        limited = self._max_attempts() is not None
        found: dict[str, int] = {}
        for _ in range(RECLAIM_PAGES):
            rows: Any = await self._retrying(
                "XPENDING",
                functools.partial(
                    self._client.xpending_range,
                    self.topic,
                    self._group,
                    min=cursor,
                    max="+",
                    count=page,
                    idle=self._settings.processing_timeout_ms,
                ),
            )
            ids = [text(row["message_id"]) for row in rows]
            listed = {
                i: int(row["times_delivered"])
                for i, row in zip(ids, rows, strict=True)
                if i not in self._owned or (limited and self._taken_from_us(i, row))
            }
            wanted = count - len(found)
            if self.retry is not None and listed:
                # Entries waiting out a retry backoff are not abandoned: not yet.
                free, seen = await self.retry.hold_back(list(listed), wanted)
            else:
                free = list(listed)[:wanted]
                seen = len(free)
            found.update((i, listed[i]) for i in free)
            short = len(rows) < page
            if len(found) >= count and seen < len(listed):
                # Stopped inside the page: the next pass goes on after the last id used.
                cursor = f"({list(listed)[seen - 1]}"
                short = False
            elif ids:
                cursor = f"({ids[-1]}"
            if short:
                cursor = "-"
            if short or len(found) >= count:
                break
        if not head or cursor == "-":
            # A head pass leaves the cursor for the next pass, unless it went round the PEL.
            self._reclaim_cursor = cursor
            if cursor == "-":
                self._reclaim_round_at = now
        return found

    def _max_attempts(self) -> int | None:
        """maxDeliveryAttempts of this subscription's retry policy (None: unlimited)."""
        return None if self.retry is None else self.retry.policy.max_attempts

    def _taken_from_us(self, entry_id: str, row: Any) -> bool:
        """Whether our subscriber holds an earlier delivery of `entry_id` that another stream
        has taken over since (the PEL names another consumer), the entry now idle there.

        With maxDeliveryAttempts such an entry is abandoned like any other: every takeover
        counts, so an app that never answers on any stream still uses its attempts up and
        the entry reaches the dead-letter topic. Without a limit it stays with the streams
        that hold it (slow is not dead), rather than going round them for ever.
        """
        return (
            entry_id in self._unacked
            and entry_id not in self._ready_at
            and text(row["consumer"]) != self.consumer
        )

    async def _redeliver(self, entry_id: str, attempt: int, delay_s: float) -> None:
        """Deliver `entry_id`, nacked on its `attempt`-th delivery, again after `delay_s`.

        Its idle time is reset now (NACK_HOLD), or another stream could reclaim it while
        it waits here; and the claim after the wait is made only under the delivery count
        of the nack: when redeliverInterval outlasts processingTimeout, another stream may
        still have delivered it meanwhile, and that delivery is the redelivery.
        """
        _, fields = await self._retrying("XCLAIM", lambda: self._nack_hold(entry_id, attempt))
        claimed: list[Claimed] = []
        if fields is not None:
            await self._clock.sleep(delay_s)
            nonce = uuid.uuid4().hex
            claimed = await self._retrying(
                "XCLAIM",
                lambda: claim_unchanged(
                    self._client, self.topic, self._group, self.consumer, {entry_id: attempt}, nonce=nonce
                ),
            )
        if not claimed:
            # Deleted or trimmed while it waited, acked elsewhere, or delivered again by
            # another stream: nothing to redeliver here.
            self._owned.discard(entry_id)
            self._slot_freed()
            return
        self._push(entry_id, claimed[0].fields, claimed[0].attempt, requeue=True)

    def _push(self, entry_id: str, fields: Any, attempt: int, requeue: bool = False) -> None:
        if self._closed:
            return
        if entry_id in self._owned and not requeue:
            return
        # Decoded before it counts as ours: if that fails, our own reclaim pass
        # must still be able to pick it up.
        entry = decode_entry(fields)
        self._owned.add(entry_id)
        if _expired(entry, self._clock):
            # Its TTL ended in the stream or while waiting for a redelivery.
            self._expire(entry_id)
            return
        self._ready.append(Delivery(entry_id, self.topic, entry, attempt))
        self._ready_at[entry_id] = asyncio.get_running_loop().time()
        self._can_send.set()

    async def _retrying(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """Run `call` until it succeeds: transient errors back off and retry, a
        missing group (Redis restarted empty) is recreated. Other Redis errors
        (e.g. WRONGTYPE) are retried with backoff too, logged as errors, except
        for XACK where they are the caller's to handle. Gives up (CancelledError)
        once the subscription is stopped: by its own flag, never by a
        cancellation request left on the task (see delayed_middleware.aio)."""
        backoff = Backoff(base_s=BACKOFF_BASE_S, cap_s=BACKOFF_CAP_S)
        result = await retrying(
            call,
            retried=(redis.exceptions.ResponseError, *TRANSIENT_ERRORS),
            on_error=functools.partial(self._on_redis_error, what),
            stopped=lambda: self._closed,
            sleep=self._clock.sleep,
            backoff=backoff,
            call_timeout=self._timeout,
        )
        if backoff.failures:
            log.info("%s on %s: redis is back", what, self.topic)
        return result

    async def _on_redis_error(self, what: str, e: BaseException) -> None:
        self._metrics.redis_errors.inc()
        if not isinstance(e, redis.exceptions.ResponseError):
            log.warning("%s on %s: redis unavailable (%s); retrying", what, self.topic, e)
        elif "NOGROUP" in str(e):
            log.warning(
                "%s on %s: consumer group gone (Redis restarted empty?), recreating", what, self.topic
            )
            with contextlib.suppress(*REDIS_ERRORS):
                await self._create_group()
        elif what == "XACK":
            raise e
        else:
            log.error("%s on %s failed: %s; retrying", what, self.topic, e)


def _expired(entry: StreamEntry, clock: Clock) -> bool:
    """True once the entry's expiry (0 = never) has come: the instant itself counts as expired."""
    return entry.expires_at_ms > 0 and clock.now_ms() >= entry.expires_at_ms
