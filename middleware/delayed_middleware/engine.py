"""The delay engine: durable scheduling and exactly-once firing on Redis.

State lives only in Redis (see keys.EngineKeys): the component keeps nothing
per message in memory, so a million pending messages cost Redis memory, not
ours. Firing never polls on a fixed tick: the loop sleeps until the earliest
due time and is woken early through a pub/sub channel when any replica
schedules an earlier one. Each batch is fired by one atomic script (scripts.FIRE),
so every message lands on its target exactly once whatever dies when and however
many replicas race for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from delayed_middleware import scripts
from delayed_middleware.clock import Clock
from delayed_middleware.entry import StreamEntry, Trim
from delayed_middleware.envelope import Envelope, encode_envelope
from delayed_middleware.keys import EngineKeys

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    """Tuning knobs; the defaults suit most deployments."""

    batch_size: int = 500
    # A cap on any one sleep, so a lost wake message (a dropped pub/sub
    # connection) or a stepped clock delays a fire by at most this much.
    max_sleep_s: float = 5.0
    retry_min_s: float = 0.05
    retry_max_s: float = 2.0
    # Bound on one peek-and-fire round trip: a connection that died without a
    # FIN (a partitioned Redis) must not stall the loop forever.
    op_timeout_s: float = 30.0


@dataclass(frozen=True)
class FireReport:
    """What one fire_due call did, for metrics: handed to the engine's on_batch hook."""

    fired: int
    # now - the earliest due time in the batch (0 when nothing fired).
    max_lateness_ms: int
    # Messages still waiting in the index after the batch.
    pending: int


class DelayEngine:
    """Schedules envelopes on one delayed topic and fires them when due."""

    def __init__(
        self,
        client: aioredis.Redis,
        keys: EngineKeys,
        clock: Clock,
        *,
        trim: Trim | None = None,
        config: EngineConfig = EngineConfig(),
        on_batch: Callable[[FireReport], None] | None = None,
    ) -> None:
        self._redis = client
        self._keys = keys
        self._clock = clock
        self._trim = trim or Trim()
        self._config = config
        self._schedule = client.register_script(scripts.SCHEDULE)
        self._fire_due = client.register_script(scripts.FIRE_DUE)
        self._cancel = client.register_script(scripts.CANCEL)
        self._on_batch = on_batch
        self._wake = asyncio.Event()

    @property
    def keys(self) -> EngineKeys:
        return self._keys

    async def schedule(self, envelopes: Sequence[Envelope]) -> list[str]:
        """Store envelopes durably; returns their ids on the delayed topic.

        When this returns, Redis holds them: a crash of this process from here
        on loses nothing.
        """
        if not envelopes:
            return []
        args: list[Any] = [self._keys.buckets, self._keys.wake, len(envelopes)]
        for env in envelopes:
            args += [encode_envelope(env), env.due_ms, env.schedule_id]
        ids = await self._schedule(keys=self._keys.script_keys, args=args)
        return [i.decode() if isinstance(i, bytes) else str(i) for i in ids]

    async def cancel(self, schedule_id: str) -> bool:
        """Withdraw the pending message with this scheduleId; True if one was pending."""
        n = await self._cancel(keys=self._keys.script_keys, args=[self._keys.buckets, schedule_id])
        return bool(n)

    async def pending(self) -> int:
        """How many messages wait on this delayed topic."""
        return int(await self._redis.get(self._keys.count) or 0)

    async def fire_due(self) -> tuple[int, int | None]:
        """Fire one batch of what is due now, in one atomic script.

        Returns (envelopes fired by this call, earliest due time left or None).
        """
        now = self._clock.now_ms()
        mode, threshold = self._trim.args(now)
        raw = await self._fire_due(
            keys=self._keys.script_keys,
            args=[self._keys.buckets, now, self._config.batch_size, mode, threshold],
        )
        fired, head, first, pending = int(raw[0]), raw[1], raw[2], int(raw[3])
        if self._on_batch is not None:
            # The batch's earliest due time is its latest message.
            late_ms = now - int(float(first)) if first else 0
            self._on_batch(FireReport(fired=fired, max_lateness_ms=late_ms, pending=pending))
        if len(raw) > 4:
            bad = [b.decode() if isinstance(b, bytes) else str(b) for b in raw[4:]]
            log.error(
                "%d envelopes on %s could not be decoded and were not fired (left on the topic): %s",
                len(bad),
                self._keys.stream,
                ", ".join(bad[:10]),
            )
        return fired, (int(float(head)) if head else None)

    async def run(self) -> None:
        """Fire due messages until cancelled; survives Redis outages."""
        listener = asyncio.create_task(self._listen_wake(), name=f"wake:{self._keys.stream}")
        backoff = self._config.retry_min_s
        try:
            while True:
                try:
                    # asyncio.timeout, not wait_for: wait_for can swallow a
                    # cancellation that races with completion (Python < 3.12).
                    async with asyncio.timeout(self._config.op_timeout_s):
                        fired, head = await self.fire_due()
                    _honour_swallowed_cancel()
                    backoff = self._config.retry_min_s
                except (RedisError, TimeoutError) as exc:
                    log.warning(
                        "delay engine on %s: redis error %s; retrying in %.2fs",
                        self._keys.stream,
                        exc,
                        backoff,
                    )
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, self._config.retry_max_s)
                    continue
                if fired or (head is not None and head <= self._clock.now_ms()):
                    continue  # more may be due right now: no sleep between batches
                await self._sleep_until(head)
        finally:
            listener.cancel()
            # Bounded: closing a pub/sub connection to a dead server may hang.
            await asyncio.wait({listener}, timeout=1.0)

    async def _sleep_until(self, head: int | None) -> None:
        timeout = self._config.max_sleep_s
        if head is not None:
            timeout = min(timeout, max(0.0, (head - self._clock.now_ms()) / 1000))
        self._wake.clear()
        waker = asyncio.ensure_future(self._wake.wait())
        sleeper = asyncio.ensure_future(self._clock.sleep(timeout))
        try:
            await asyncio.wait({waker, sleeper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (waker, sleeper):
                t.cancel()

    def wake(self) -> None:
        """Re-check the index now (used by this process after it schedules)."""
        self._wake.set()

    async def _listen_wake(self) -> None:
        backoff = self._config.retry_min_s
        while True:
            _honour_swallowed_cancel()
            pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self._keys.wake)
                # A message may have been missed while (re)subscribing.
                self._wake.set()
                backoff = self._config.retry_min_s
                while True:
                    # get_message with a timeout, not listen(): an idle channel
                    # must not look like a dead socket to the read timeout.
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    _honour_swallowed_cancel()
                    if msg is not None:
                        self._wake.set()
            except RedisError as exc:
                log.debug("wake listener on %s: %s", self._keys.wake, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self._config.retry_max_s)
            finally:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(1.0):
                        await pubsub.aclose()  # type: ignore[no-untyped-call]


def _honour_swallowed_cancel() -> None:
    """Re-raise a cancellation that redis-py swallowed.

    On Python 3.11 redis-py's asyncio client sometimes eats a CancelledError that
    races with a reply arriving (seen here: about one cancel in thirty). The
    request stays recorded on the task, so a loop that checks after each Redis
    call still stops, instead of sleeping on as if never told.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def _target_entries(env: Envelope) -> list[StreamEntry]:
    if env.is_bulk:
        return [StreamEntry(e.event, e.metadata, e.content_type) for e in env.bulk_entries]
    return [StreamEntry(env.message, env.metadata, env.content_type)]
