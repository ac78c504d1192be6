"""Retry notices under `serve --workers N`: a worker's scan of the retry schedules, and the
gRPC process's listener that wakes the pollers (redelivery.Retrier) of the topics it names.

A notice is only a wake-up: taking the record is the token and the claim is conditional
(claims.py), so a notice lost costs at most the pollers' long cap and a repeated one
delivers nothing twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Protocol

from delayed_middleware.aio import text
from delayed_middleware.backoff import REDIS_RECONNECT
from delayed_middleware.clock import Clock
from delayed_middleware.liveness import Supervised
from delayed_middleware.retry import retry_key, retry_topics_key
from delayed_pubsub.connection import REDIS_ERRORS, RedisPyClient
from delayed_pubsub.metrics import InstanceMetrics

# The notices log as they did inside redelivery.py.
log = logging.getLogger("delayed_pubsub.redelivery")

# Longest the worker's due scan sleeps without looking at the retry schedules: bounds how
# late a record written by another process or replica is announced.
SCAN_CAP_S = 1.0
# Least wait between two scans, however long one took.
SCAN_FLOOR_S = 0.05

_RETRIED: tuple[type[BaseException], ...] = (*REDIS_ERRORS, TimeoutError)


class Notified(Protocol):
    """What a notice wakes: a topic's retry poller (redelivery.Retrier)."""

    def notify(self) -> None:
        """Look at the retry schedule now."""


def retry_due_channel(consumer_id: str) -> str:
    """The pub/sub channel on which a worker's due scan names the topics with due retry records."""
    return f"{retry_topics_key(consumer_id)}:due"


class RetryNotices:
    """The gRPC process's ear for a worker's due scan (`serve --workers N`): one listener per
    instance that wakes the pollers of each topic named on `retry_due_channel`.

    Redis pub/sub rather than serve's files to its workers: a worker restarted (or the scan
    of another replica's worker) reaches it with nothing to re-open, and a notice lost on a
    reconnect costs at most the pollers' long cap. A notice is only a wake-up: the take is
    the token and the claim is conditional, so a repeated one delivers nothing twice.
    """

    def __init__(self, client: RedisPyClient, consumer_id: str, metrics: InstanceMetrics) -> None:
        self._client = client
        self._channel = retry_due_channel(consumer_id)
        self._metrics = metrics
        self._retriers: dict[str, set[Notified]] = {}
        self.loop: Supervised | None = None

    def add(self, topic: str, retrier: Notified) -> None:
        """Wake `retrier` on notices for `topic` (the listener starts with the first one)."""
        self._retriers.setdefault(topic, set()).add(retrier)
        if self.loop is None:
            self.loop = Supervised(
                f"retry notice listener on {self._channel}",
                self._listen,
                on_state=self._metrics.loop_state("retry"),
            )
            self.loop.start()

    def discard(self, topic: str, retrier: Notified) -> None:
        """Stop waking `retrier`."""
        retriers = self._retriers.get(topic)
        if retriers is not None:
            retriers.discard(retrier)
            if not retriers:
                del self._retriers[topic]

    async def close(self) -> None:
        """Stop listening."""
        if self.loop is not None:
            await self.loop.stop()

    def _wake(self, topic: str | None) -> None:
        groups = self._retriers.values() if topic is None else [self._retriers.get(topic, set())]
        for retriers in groups:
            for retrier in retriers:
                retrier.notify()

    async def _listen(self, stop: asyncio.Event) -> None:
        backoff = REDIS_RECONNECT.backoff()
        while not stop.is_set():
            pubsub: Any = self._client.pubsub(ignore_subscribe_messages=True)
            try:
                # A Redis Cluster client maps the slots on its first command.
                await self._client.ping()
                await pubsub.subscribe(self._channel)
                # A notice may have been missed while (re)subscribing.
                self._wake(None)
                backoff.reset()
                while not stop.is_set():
                    # get_message with a timeout, not listen(): an idle channel must not
                    # look like a dead socket to the read timeout.
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if msg is not None:
                        self._wake(text(msg["data"]))
            except _RETRIED as e:
                self._metrics.redis_errors.inc()
                log.warning("retry notice listener on %s: %s", self._channel, e)
                await _sleep_or_stop(stop, backoff.next())
            finally:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(1.0):
                        await pubsub.aclose()


class DueScan:
    """A worker's watch over every retry schedule of one app (`serve --workers N`): it sleeps
    until the earliest record is due (at most SCAN_CAP_S) and names the topics with due
    records on `retry_due_channel`, so the gRPC process's pollers need not look every second.

    It takes nothing: the pollers that hear it take, claim and deliver, as without workers.
    A topic still due at the next look is named again (a notice lost, or no stream of it
    open anywhere yet).
    """

    def __init__(
        self,
        client: RedisPyClient,
        consumer_id: str,
        clock: Clock,
        metrics: InstanceMetrics,
        call_timeout: float | None,
    ) -> None:
        self._client = client
        self._group = consumer_id
        self._channel = retry_due_channel(consumer_id)
        self._clock = clock
        self._metrics = metrics
        self._timeout = call_timeout

    async def run(self, stop: asyncio.Event) -> None:
        """The scan loop (a Supervised body)."""
        backoff = REDIS_RECONNECT.backoff()
        while not stop.is_set():
            started_ms = self._clock.now_ms()
            try:
                async with asyncio.timeout(self._timeout):
                    next_ms = await self.scan()
                backoff.reset()
            except _RETRIED as e:
                self._metrics.redis_errors.inc()
                log.warning("retry due scan of %s: %s", self._group, e)
                await _sleep_or_stop(stop, backoff.next())
                continue
            # The cap counts from the scan's start: a slow scan (a loaded worker) must not
            # stretch the time between two looks past SCAN_CAP_S; a scan that takes longer
            # than that still leaves Redis SCAN_FLOOR_S between two.
            wait = max(SCAN_FLOOR_S, SCAN_CAP_S - (self._clock.now_ms() - started_ms) / 1000)
            if next_ms is not None:
                wait = min(wait, max(0.0, (next_ms - self._clock.now_ms()) / 1000))
            await _sleep_or_stop(stop, wait)

    async def scan(self) -> int | None:
        """Announce the topics with due records; returns the next record's time (ms) or None."""
        topics = sorted(text(t) for t in await self._client.smembers(retry_topics_key(self._group)))
        if not topics:
            return None
        pipe = self._client.pipeline(transaction=False)
        for topic in topics:
            pipe.zrange(retry_key(self._group, topic), 0, 0, withscores=True)
        heads = await pipe.execute()
        now = self._clock.now_ms()
        next_ms: int | None = None
        for topic, head in zip(topics, heads, strict=True):
            if not head:
                continue
            due_ms = int(head[0][1])
            if due_ms <= now:
                await self._client.publish(self._channel, topic)
            elif next_ms is None or due_ms < next_ms:
                next_ms = due_ms
        return next_ms


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    if seconds <= 0:
        return
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await stop.wait()
