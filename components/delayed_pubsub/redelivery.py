"""Carries out a subscription's RetryPolicy on Redis (the design is in delayed_middleware.retry).

The hook into a Subscription is narrow, so it survives rewrites of the
subscription itself. A subscription with `retry = Retrier(...)` calls:

- `retry.start(push)` once it is fetching: the poller that redelivers due
  entries; `push(entry_id, fields, attempt)` must queue a delivery even if the
  subscription already saw that id (it is a redelivery);
- `await retry.on_nack(entry_id, error)` instead of its own redelivery timer,
  then forgets the id (it is no longer this stream's: the record is);
- `await retry.hold_back(ids)` on ids XAUTOCLAIM took over, and delivers only
  those returned: an entry with a future retry record must wait for it;
- `await retry.close()` when it closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from delayed_middleware import history
from delayed_middleware.aio import retrying, text
from delayed_middleware.backoff import Backoff
from delayed_middleware.clock import Clock
from delayed_middleware.deadletters import GaveUp, write_dead_letter
from delayed_middleware.entry import StreamEntry, decode_entry
from delayed_middleware.history import Retention
from delayed_middleware.keys import EngineKeys, delayed_topic, is_stream_id
from delayed_middleware.kinds import Kind
from delayed_middleware.liveness import Supervised
from delayed_middleware.retry import DeadLetter, RetryPolicy, retry_key, retry_topics_key
from delayed_pubsub.connection import REDIS_ERRORS, RedisClient
from delayed_pubsub.metrics import InstanceMetrics

log = logging.getLogger(__name__)

T = TypeVar("T")

# Longest the poller sleeps without looking: bounds how late a record written by
# another replica (or before a restart) is noticed.
POLL_CAP_S = 1.0
POLL_BATCH = 100

Push = Callable[[str, Any, int], None]

_RETRIED: tuple[type[BaseException], ...] = (*REDIS_ERRORS, TimeoutError)


class Retrier:
    """One subscription's retries: durable records, the poller, dead letters."""

    def __init__(
        self,
        client: RedisClient,
        policy: RetryPolicy,
        *,
        topic: str,
        group: str,
        consumer: str,
        clock: Clock,
        metrics: InstanceMetrics,
        call_timeout: float | None,
        history: Retention | None = None,
    ) -> None:
        self.policy = policy
        self._client = client
        self._topic = topic
        self._group = group
        self._consumer = consumer
        self._clock = clock
        self._metrics = metrics
        self._timeout = call_timeout
        self._key = retry_key(group, topic)
        self._history = EngineKeys.for_topic(delayed_topic(group)).history
        # historyMaxLen / historyMaxAge, as the engine's own records obey them (0: none written).
        self._retention = history if history is not None else Retention()
        self._wake = asyncio.Event()
        self._poller: Supervised | None = None
        self._closed = False

    # --- the hook -------------------------------------------------------------

    def start(self, push: Push) -> None:
        """Start redelivering due entries of this group and topic into `push` (a supervised loop)."""
        if self._poller is None:
            self._poller = Supervised(
                f"retry poller of {self._key}",
                functools.partial(self._poll, push),
                on_state=self._metrics.loop_state("retry"),
            )
            self._poller.start()

    @property
    def loop(self) -> Supervised | None:
        """The supervised poller, once started."""
        return self._poller

    async def close(self) -> None:
        """Stop the poller; records stay in Redis for the next stream of the group."""
        self._closed = True
        if self._poller is not None:
            await self._poller.stop()

    async def on_nack(self, entry_id: str, error: str) -> None:
        """Record when `entry_id` may come back, or dead-letter it after its last attempt."""
        attempt, fields = await self._retrying("read nacked entry", lambda: self._read(entry_id))
        if fields is None:
            return  # acked elsewhere, deleted or trimmed: nothing left to retry
        entry = decode_entry(fields)
        decision = self.policy.on_nack(attempt, error)
        if isinstance(decision, DeadLetter):
            await self._dead_letter(entry_id, entry, decision)
            return
        now = self._clock.now_ms()
        due_ms = now + int(decision.after_s * 1000)
        record = self._history_fields(
            history.RETRIED, entry_id, entry, due_ms=due_ms, attempt=attempt, reason=error, at_ms=now
        )
        await self._retrying("record retry", lambda: self._record(entry_id, due_ms, record))
        self._metrics.retried.inc()
        log.info(
            "%s on %s: delivery %d failed; next in %.3fs",
            entry_id,
            self._topic,
            attempt,
            decision.after_s,
        )
        self._wake.set()

    async def hold_back(self, ids: Sequence[str]) -> list[str]:
        """The ids that may be delivered now: those without a retry record still in the future.

        A record whose time has come is consumed here (ZREM as the token), so
        exactly one stream delivers it.
        """
        if not ids:
            return []
        scores = await self._retrying("ZMSCORE", lambda: self._client.zmscore(self._key, list(ids)))
        now = self._clock.now_ms()
        free: list[str] = []
        for entry_id, score in zip(ids, scores, strict=True):
            if score is None or (score <= now and await self._take(entry_id)):
                free.append(entry_id)
        return free

    # --- Redis ----------------------------------------------------------------

    async def _read(self, entry_id: str) -> tuple[int, Any]:
        pipe = self._client.pipeline(transaction=False)
        pipe.xpending_range(self._topic, self._group, min=entry_id, max=entry_id, count=1)
        pipe.xrange(self._topic, entry_id, entry_id)
        pending, rows = await pipe.execute()
        if not pending or not rows:
            return 0, None
        return int(pending[0]["times_delivered"]), rows[0][1]

    async def _record(self, entry_id: str, due_ms: int, record: dict[str, str]) -> None:
        """The retry record, the idle reset and the history entry, in one round trip."""
        pipe = self._client.pipeline(transaction=False)
        pipe.zadd(self._key, {entry_id: due_ms})
        # Keep it ours meanwhile (idle reset; JUSTID leaves the count alone).
        pipe.xclaim(self._topic, self._group, self._consumer, 0, [entry_id], justid=True)
        # So operators find the waiting retries knowing only the app id.
        pipe.sadd(retry_topics_key(self._group), self._topic)
        self._retention.append(pipe, self._history, record, self._clock.now_ms())
        zadd, xclaim, sadd, *hist = await pipe.execute(raise_on_error=False)
        for result in (zadd, xclaim, sadd):
            if isinstance(result, Exception):
                raise result  # retried whole: both steps are idempotent
        failed = next((r for r in hist if isinstance(r, Exception)), None)
        if failed is not None:
            # History is for people; the retry itself is durable.
            self._metrics.redis_errors.inc()
            log.warning("history of %s not written: %s", entry_id, failed)

    async def _take(self, entry_id: str) -> bool:
        removed = await self._retrying("ZREM", lambda: self._client.zrem(self._key, entry_id))
        return bool(removed)

    async def _dead_letter(self, entry_id: str, entry: StreamEntry, decision: DeadLetter) -> None:
        topic = decision.topic
        if topic:
            why = GaveUp(decision.reason, decision.attempts, self._topic, self._group, self._clock.now_ms())
            write = functools.partial(write_dead_letter, self._client, self._group, topic, entry, why)
            # Appended before the XACK: a crash in between dead-letters twice, never zero times.
            await self._retrying("dead letter XADD", write)
        await self._retrying("XACK", lambda: self._client.xack(self._topic, self._group, entry_id))
        (self._metrics.dead_lettered if topic else self._metrics.dropped).inc()
        record = self._history_fields(
            history.DEAD_LETTERED,
            entry_id,
            entry,
            due_ms=None,
            attempt=decision.attempts,
            reason=decision.reason,
        )
        await self._append_history(entry_id, record)
        log.warning(
            "%s on %s: gave up after %d deliveries; %s",
            entry_id,
            self._topic,
            decision.attempts,
            f"dead-lettered to {topic!r}" if topic else "dropped (no deadLetterTopic)",
        )

    async def _append_history(self, entry_id: str, fields: dict[str, str]) -> None:
        if not self._retention.enabled:
            return
        try:
            async with asyncio.timeout(self._timeout):
                pipe = self._client.pipeline(transaction=False)
                self._retention.append(pipe, self._history, fields, self._clock.now_ms())
                await pipe.execute()
        except _RETRIED as e:
            # History is for people; the decision itself is already carried out.
            self._metrics.redis_errors.inc()
            log.warning("history of %s not written: %s", entry_id, e)

    def _history_fields(
        self,
        event: str,
        entry_id: str,
        entry: StreamEntry,
        *,
        due_ms: int | None,
        attempt: int,
        reason: str,
        at_ms: int | None = None,
    ) -> dict[str, str]:
        # Linked to the delayed message that produced it when there was one
        # (`scheduler` is its scheduleId or envelope id), else the entry id.
        scheduler = entry.metadata.get("scheduler", "")
        return {
            "event": event,
            "at": str(self._clock.now_ms() if at_ms is None else at_ms),
            "id": scheduler or entry_id,
            "sid": scheduler if scheduler and not is_stream_id(scheduler) else "",
            "topic": self._topic,
            "kind": Kind.RETRY.label,
            "due": "" if due_ms is None else str(due_ms),
            "size": str(len(entry.data)),
            "attempt": str(attempt),
            "reason": reason[:200],
        }

    async def _poll(self, push: Push, stop: asyncio.Event) -> None:
        backoff = Backoff(base_s=0.05, cap_s=2.0)
        while not self._closed and not stop.is_set():
            try:
                next_ms = await self._redeliver_due(push)
                backoff.reset()
            except _RETRIED as e:
                self._metrics.redis_errors.inc()
                log.warning("retry poller on %s: %s", self._key, e)
                await self._clock.sleep(backoff.next())
                continue
            except Exception:
                # Must not die: its records would then wait for another stream.
                log.exception("retry poller on %s failed; going on", self._key)
                await self._clock.sleep(backoff.next())
                continue
            if stop.is_set():
                return
            wait = POLL_CAP_S
            if next_ms is not None:
                wait = min(wait, max(0.0, (next_ms - self._clock.now_ms()) / 1000))
            if wait > 0:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await self._wake.wait()

    async def _redeliver_due(self, push: Push) -> int | None:
        """Redeliver what is due, in four round trips per batch; returns the next record's time (ms) or None."""
        now = self._clock.now_ms()
        pipe = self._client.pipeline(transaction=False)
        pipe.zrangebyscore(self._key, "-inf", now, start=0, num=POLL_BATCH)
        pipe.zrangebyscore(self._key, f"({now}", "+inf", start=0, num=1, withscores=True)
        async with asyncio.timeout(self._timeout):
            due, later = await pipe.execute()
        if due:
            ids = [text(raw) for raw in due]
            async with asyncio.timeout(self._timeout):
                # ZREM returning 1 is the token: of racing streams, one redelivers.
                pipe = self._client.pipeline(transaction=False)
                for entry_id in ids:
                    pipe.zrem(self._key, entry_id)
                mine: list[Any] = [i for i, removed in zip(ids, await pipe.execute(), strict=True) if removed]
                claimed: Any = []
                if mine:
                    # Bumps each PEL delivery count: that is the attempt number.
                    claimed = await self._client.xclaim(self._topic, self._group, self._consumer, 0, mine)
                # Deleted or trimmed while they waited: nothing to redeliver.
                live = [(text(i), f) for i, f in claimed if f is not None]
                attempts = await self._attempts([i for i, _ in live])
            for entry_id, fields in live:
                push(entry_id, fields, attempts.get(entry_id, 2))
            if len(due) == POLL_BATCH:
                return now
        return int(later[0][1]) if later else None

    async def _attempts(self, ids: Sequence[str]) -> dict[str, int]:
        return await delivery_counts(self._client, self._topic, self._group, ids)

    async def _retrying(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """Run `call` until it works; gives up (CancelledError) once closed."""

        async def count(e: BaseException) -> None:
            self._metrics.redis_errors.inc()
            log.warning("%s on %s: %s; retrying", what, self._topic, e)

        return await retrying(
            call,
            retried=_RETRIED,
            on_error=count,
            stopped=lambda: self._closed,
            sleep=self._clock.sleep,
            backoff=Backoff(base_s=0.05, cap_s=2.0),
            call_timeout=self._timeout,
        )


async def delivery_counts(client: Any, topic: str, group: str, ids: Sequence[str]) -> dict[str, int]:
    """Each entry's delivery count in `group`'s PEL on `topic`, in one round trip: the attempt
    number a redelivery carries (an id no longer pending is left out)."""
    if not ids:
        return {}
    pipe = client.pipeline(transaction=False)
    for entry_id in ids:
        pipe.xpending_range(topic, group, min=entry_id, max=entry_id, count=1)
    counts: dict[str, int] = {}
    for rows in await pipe.execute():
        for row in rows:
            counts[text(row["message_id"])] = int(row["times_delivered"])
    return counts
