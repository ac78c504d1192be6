"""Carries out a subscription's RetryPolicy on Redis (the design is in delayed_middleware.retry).

The hook into a Subscription is narrow, so it survives rewrites of the
subscription itself. A subscription with `retry = Retrier(...)` calls:

- `retry.start(push, give_up)` once it is fetching: the poller that redelivers due
  entries; `push(entry_id, fields, attempt)` must queue a delivery even if the
  subscription already saw that id (it is a redelivery), and `give_up(claimed)`
  dead-letters (with `retry.give_up`) an entry claimed with its attempts used up;
- `await retry.on_nack(entry_id, error, attempt)` instead of its own
  redelivery timer, then forgets the id (it is no longer this stream's: the
  record is);
- `await retry.hold_back(ids, limit)` on the idle ids its reclaim pass found, and
  claims only those returned (with `claim_unchanged`): an entry with a future
  retry record must wait for it; an entry delivered maxDeliveryAttempts times
  is claimed to be given up, never delivered again;
- `retry.stop()` when it starts closing (nothing more is claimed for it), and
  `await retry.close()` when it closes.

Who delivers a due retry: every delivery is a claim that bumps the entry's
delivery count in the PEL, and every claim here is conditional on a count
(`claim_unchanged`). A record keeps the count its nack was about
(RETRY_RECORD); the poller takes due records (RETRY_TAKE: removing the record
is the token among pollers, and a record rewritten to a later time since it
was read is left alone), then claims under that count. A reclaim pass of
another stream that finds no record (the poller took it a moment ago) claims
under the count it listed, the same one, so one of them wins; and if a
reclaim pass delivered the entry before a late record landed, the record's
count no longer matches and the stale record is dropped. The record and the
stream may sit on different Cluster masters, and no step needs both.
A late record never replaces one about a later delivery (RETRY_RECORD).
Records of an older version carry no count, and its replicas take records
without removing their counts: a count is kept with its record's due time and
trusted only beside that record; the poller claims the others under the count
it read just before taking them, and sweeps away counts left without a record.

When the poller looks: at the due times it has read, on its own nacks, and
at least every POLL_CAP_S. Under `serve --workers N` a worker's DueScan (retry_notices.py) looks
at every retry schedule of the app instead and names the topics with due
records on Redis pub/sub; the RetryNotices listener of the gRPC process wakes
their pollers (`notify`), which then look on their own only every
NOTICED_POLL_CAP_S.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, TypeVar

from delayed_middleware import history
from delayed_middleware.aio import retrying, text
from delayed_middleware.backoff import REDIS_RECONNECT
from delayed_middleware.clock import Clock
from delayed_middleware.deadletters import GaveUp, write_dead_letter
from delayed_middleware.entry import StreamEntry, decode_entry
from delayed_middleware.history import Retention
from delayed_middleware.keys import EngineKeys, delayed_topic, is_stream_id
from delayed_middleware.kinds import Kind
from delayed_middleware.liveness import Supervised
from delayed_middleware.retry import (
    DeadLetter,
    RetryPolicy,
    retry_counts_key,
    retry_key,
    retry_topics_key,
)
from delayed_pubsub.claims import Claimed, claim_unchanged, delivery_counts, nack_hold
from delayed_pubsub.connection import REDIS_ERRORS, RedisPyClient
from delayed_pubsub.lua import RETRY_RECORD, RETRY_SWEEP, RETRY_TAKE
from delayed_pubsub.metrics import InstanceMetrics
from delayed_pubsub.retry_notices import RetryNotices

log = logging.getLogger(__name__)

T = TypeVar("T")

# Longest the poller sleeps without looking: bounds how late a record written by
# another replica (or before a restart) is noticed.
POLL_CAP_S = 1.0
# The same under `serve --workers N`, where a worker's due scan (DueScan) tells the pollers
# when records are due: only a dead worker or a lost notice waits this long, never forever.
NOTICED_POLL_CAP_S = 30.0
POLL_BATCH = 100
# Fields of the counts hash one poll looks at for counts left without a record (RETRY_SWEEP).
SWEEP_STEP = 100
# RETRY_TAKE's answer for an id whose record it did not take.
_NOT_TAKEN = -1


Push = Callable[[str, Any, int], None]
# Called with an entry claimed to be given up (Claimed.given_up): the subscription dead-letters it.
GiveUp = Callable[[Claimed], None]

_RETRIED: tuple[type[BaseException], ...] = (*REDIS_ERRORS, TimeoutError)


@dataclass(eq=False, repr=False)
class Retrier:
    """One subscription's retries: durable records, the poller, dead letters."""

    client: RedisPyClient
    policy: RetryPolicy
    _: KW_ONLY
    topic: str
    group: str
    consumer: str
    clock: Clock
    metrics: InstanceMetrics
    call_timeout: float | None
    # historyMaxLen / historyMaxAge, as the engine's own records obey them (None: the defaults).
    history: Retention | None = None
    # Under `serve --workers N` a worker's due scan wakes the poller (notify): it then
    # looks on its own only at the due times it read and at the long cap.
    notices: RetryNotices | None = None
    # How many more deliveries the stream's window takes now (None: no bound); set by
    # the subscription. Due retries beyond it are left for later polls or other streams.
    room: Callable[[], int] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._key = retry_key(self.group, self.topic)
        self._counts = retry_counts_key(self.group, self.topic)
        self._history_key = EngineKeys.for_topic(delayed_topic(self.group)).history
        # 0 in historyMaxLen / historyMaxAge: no record written.
        self._retention = self.history if self.history is not None else Retention()
        self._wake = asyncio.Event()
        # Where the poller's sweep of orphaned counts (RETRY_SWEEP) goes on from.
        self._sweep_cursor = "0"
        # The poller left due records for want of room: room_freed() wakes it.
        self._starved = False
        # Due retries were left for want of room, and none claimed since: the stream reads
        # nothing ahead meanwhile (Window.read_room), so the slots acks free go to them.
        self.wants_room = False
        self._poller: Supervised | None = None
        self._closed = False
        self._cap_s = NOTICED_POLL_CAP_S if self.notices is not None else POLL_CAP_S

    # --- the hook -------------------------------------------------------------

    def start(self, push: Push, give_up: GiveUp) -> None:
        """Start redelivering due entries of this group and topic into `push` (a supervised loop);
        one found with its deliveries used up goes to `give_up` instead."""
        if self._poller is None:
            self._poller = Supervised(
                f"retry poller of {self._key}",
                functools.partial(self._poll, push, give_up),
                on_state=self.metrics.loop_state("retry"),
            )
            self._poller.start()
            if self.notices is not None:
                self.notices.add(self.topic, self)

    def notify(self) -> None:
        """Look at the retry schedule now: a worker's due scan found records due on this topic."""
        self._wake.set()

    @property
    def loop(self) -> Supervised | None:
        """The supervised poller, once started."""
        return self._poller

    def stop(self) -> None:
        """Claim nothing more for this stream (it is closing: what it claimed now would be dropped
        with its buffer and wait out processingTimeout); close() finishes the job."""
        self._closed = True
        if self.notices is not None:
            self.notices.discard(self.topic, self)
        if self._poller is not None:
            # Our stop flag (delayed_middleware.liveness): the poller ending now is no failure.
            self._poller.stop_flag.set()
        self._wake.set()

    async def close(self) -> None:
        """Stop the poller; records stay in Redis for the next stream of the group."""
        self.stop()
        if self._poller is not None:
            await self._poller.stop()

    async def on_nack(self, entry_id: str, error: str, attempt: int = 0) -> None:
        """Record when `entry_id` may come back, or dead-letter it after its last attempt.

        `attempt` is the delivery the subscriber failed (0: unknown). If another
        stream of the group has delivered the entry again since (the app took
        longer than processingTimeout), that delivery is the retry and this
        nack changes nothing.
        """
        sent = attempt
        attempt, fields = await self._retrying("hold nacked entry", lambda: self._hold(entry_id, sent))
        if fields is None:
            if sent and attempt > sent:
                log.info(
                    "%s on %s: nack of delivery %d ignored, delivered again (%d) meanwhile",
                    entry_id,
                    self.topic,
                    sent,
                    attempt,
                )
            return  # acked elsewhere, deleted or trimmed, or redelivered: nothing to retry here
        entry = decode_entry(fields)
        decision = self.policy.on_nack(attempt, error)
        if isinstance(decision, DeadLetter):
            await self._dead_letter(entry_id, entry, decision, held_as=attempt)
            return
        now = self.clock.now_ms()
        due_ms = now + int(decision.after_s * 1000)
        record = self._history_fields(
            history.RETRIED, entry_id, entry, due_ms=due_ms, attempt=attempt, reason=error, at_ms=now
        )
        await self._retrying("record retry", lambda: self._record(entry_id, due_ms, attempt, record))
        self.metrics.retried.inc()
        log.info(
            "%s on %s: delivery %d failed; next in %.3fs",
            entry_id,
            self.topic,
            attempt,
            decision.after_s,
        )
        self._wake.set()

    async def hold_back(self, ids: Sequence[str], limit: int) -> tuple[list[str], int]:
        """Of `ids` (in PEL order), up to `limit` that may be delivered now: those without a
        retry record still in the future; and how many of `ids` were looked at to find them.

        Entries waiting out a backoff are skipped without counting against `limit`, so a
        reclaim pass is not used up by them. A record whose time has come is consumed
        here (ZREM as the token), so exactly one stream delivers it; only as many are
        taken as `limit` allows (a taken record is a promise to claim).
        """
        if not ids or limit <= 0:
            return [], 0
        scores = await self._retrying("ZMSCORE", lambda: self.client.zmscore(self._key, list(ids)))
        now = self.clock.now_ms()
        chosen: list[tuple[str, float | None]] = []
        seen = len(ids)
        for n, (i, score) in enumerate(zip(ids, scores, strict=True)):
            if score is not None and score > now:
                continue  # waits out its backoff
            chosen.append((i, score))
            if len(chosen) == limit:
                seen = n + 1
                break
        due = [i for i, score in chosen if score is not None]
        taken = await self._retrying("take retry records", lambda: self._take(due, now)) if due else {}
        allowed = [i for i, score in chosen if score is None or taken.get(i, _NOT_TAKEN) != _NOT_TAKEN]
        return allowed, seen

    async def give_up(self, claimed: Claimed, reason: str) -> None:
        """Dead-letter (or drop, without deadLetterTopic) an entry claim_unchanged claimed
        `given_up`: its last delivery went unanswered past processingTimeout, and every
        delivery counts toward maxDeliveryAttempts, however it ended."""
        attempts = claimed.attempt - 1
        topic = self.policy.dead_letter_topic
        decision = DeadLetter(reason=reason, attempts=attempts, topic=topic)
        await self._dead_letter(claimed.id, decode_entry(claimed.fields), decision, held_as=claimed.attempt)

    def room_freed(self) -> None:
        """The stream's window has room again: a poller that left due retries for want of it
        looks again now, instead of after its longest sleep."""
        if self._starved:
            self._starved = False
            self._wake.set()

    # --- Redis ----------------------------------------------------------------

    async def _hold(self, entry_id: str, sent: int) -> tuple[int, Any]:
        return await nack_hold(self.client, self.topic, self.group, self.consumer, entry_id, sent)

    async def _record(self, entry_id: str, due_ms: int, attempt: int, record: dict[str, str]) -> None:
        """The retry record (due time and the delivery count `attempt` it is about) and the
        history entry, in one round trip (NACK_HOLD reset the idle time)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.eval(RETRY_RECORD, 2, self._key, self._counts, entry_id, due_ms, attempt)
        # So operators find the waiting retries knowing only the app id.
        pipe.sadd(retry_topics_key(self.group), self.topic)
        self._retention.append(pipe, self._history_key, record, self.clock.now_ms())
        zadd, sadd, *hist = await pipe.execute(raise_on_error=False)
        for result in (zadd, sadd):
            if isinstance(result, Exception):
                raise result  # retried whole: both steps are idempotent
        failed = next((r for r in hist if isinstance(r, Exception)), None)
        if failed is not None:
            # History is for people; the retry itself is durable.
            self.metrics.redis_errors.inc()
            log.warning("history of %s not written: %s", entry_id, failed)

    async def _take(self, ids: Sequence[str], now_ms: int) -> dict[str, int]:
        """Take the records of `ids` still due at `now_ms` (RETRY_TAKE): id -> the delivery
        count its record is about (0: unknown, an older version's record), or _NOT_TAKEN."""
        reply: Any = await self.client.eval(RETRY_TAKE, 2, self._key, self._counts, now_ms, *ids)
        return {i: int(n) for i, n in zip(ids, reply, strict=True)}

    async def _dead_letter(
        self, entry_id: str, entry: StreamEntry, decision: DeadLetter, held_as: int
    ) -> None:
        """Dead-letter `entry_id`, which this stream holds under delivery count `held_as`."""
        topic = decision.topic
        if topic:
            why = GaveUp(decision.reason, decision.attempts, self.topic, self.group, self.clock.now_ms())

            async def write() -> bool:
                # Each try first holds the entry again under its count (NACK_HOLD, which resets
                # its idle time): a write retried past processingTimeout (a dead-letter topic that
                # refuses writes) must not race another stream that gave the entry up meanwhile.
                _, fields = await self._hold(entry_id, held_as)
                if fields is None:
                    return False
                await write_dead_letter(self.client, self.group, topic, entry, why)
                return True

            # Appended before the XACK: a crash in between dead-letters twice, never zero times.
            if not await self._retrying("dead letter XADD", write):
                log.info(
                    "%s on %s: given up or acked elsewhere meanwhile; not dead-lettered here",
                    entry_id,
                    self.topic,
                )
                return
        await self._retrying("XACK", lambda: self.client.xack(self.topic, self.group, entry_id))
        (self.metrics.dead_lettered if topic else self.metrics.dropped).inc()
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
            self.topic,
            decision.attempts,
            f"dead-lettered to {topic!r}" if topic else "dropped (no deadLetterTopic)",
        )

    async def _append_history(self, entry_id: str, fields: dict[str, str]) -> None:
        if not self._retention.enabled:
            return
        try:
            async with asyncio.timeout(self.call_timeout):
                pipe = self.client.pipeline(transaction=False)
                self._retention.append(pipe, self._history_key, fields, self.clock.now_ms())
                await pipe.execute()
        except _RETRIED as e:
            # History is for people; the decision itself is already carried out.
            self.metrics.redis_errors.inc()
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
            "at": str(self.clock.now_ms() if at_ms is None else at_ms),
            "id": scheduler or entry_id,
            "sid": scheduler if scheduler and not is_stream_id(scheduler) else "",
            "topic": self.topic,
            "kind": Kind.RETRY.label,
            "due": "" if due_ms is None else str(due_ms),
            "size": str(len(entry.data)),
            "attempt": str(attempt),
            "reason": reason[:200],
        }

    async def _poll(self, push: Push, give_up: GiveUp, stop: asyncio.Event) -> None:
        backoff = REDIS_RECONNECT.backoff()
        while not self._closed and not stop.is_set():
            # Cleared before looking, not before sleeping: a nack (or a notice) that lands
            # while this pass is under way was not seen by it, and must cut the sleep short.
            self._wake.clear()
            try:
                next_ms = await self._redeliver_due(push, give_up)
                backoff.reset()
            except _RETRIED as e:
                self.metrics.redis_errors.inc()
                log.warning("retry poller on %s: %s", self._key, e)
                await self.clock.sleep(backoff.next())
                continue
            except Exception:
                # Must not die: its records would then wait for another stream.
                log.exception("retry poller on %s failed; going on", self._key)
                await self.clock.sleep(backoff.next())
                continue
            if stop.is_set():
                return
            wait = self._cap_s
            if next_ms is not None:
                wait = min(wait, max(0.0, (next_ms - self.clock.now_ms()) / 1000))
            if wait > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait):
                        await self._wake.wait()

    async def _redeliver_due(self, push: Push, give_up: GiveUp) -> int | None:
        """Redeliver what is due, in four round trips per batch; returns the next record's time (ms) or None.

        A record taken whose claim then fails (Redis gone, this process killed)
        leaves its entry pending with no record: any stream's reclaim pass
        delivers it after processingTimeout.
        """
        # Claimed only as many as the window takes: a claimed entry waiting in the buffer
        # sits in our PEL going idle, and past processingTimeout another stream's reclaim
        # pass would deliver it while our copy is still handed out. The rest wait in
        # Redis, for a later poll or another stream of the group.
        limit = POLL_BATCH if self.room is None else min(POLL_BATCH, self.room())
        if limit <= 0:
            self._starved = self.wants_room = True
            return None
        self.wants_room = False
        now = self.clock.now_ms()
        pipe = self.client.pipeline(transaction=False)
        pipe.zrangebyscore(self._key, "-inf", now, start=0, num=limit)
        pipe.zrangebyscore(self._key, f"({now}", "+inf", start=0, num=1, withscores=True)
        pipe.eval(RETRY_SWEEP, 2, self._key, self._counts, self._sweep_cursor, SWEEP_STEP)
        async with asyncio.timeout(self.call_timeout):
            due, later, swept = await pipe.execute()
        self._sweep_cursor = text(swept)
        if due and self._closed:
            # Claimed now, they would be dropped with the stream's buffer and wait out
            # processingTimeout; their records stay for the other streams of the group.
            return None
        if due:
            ids = [text(raw) for raw in due]
            async with asyncio.timeout(self.call_timeout):
                # Read before the token is taken: for a record of an older version (no
                # count in it), a reclaim pass that finds no record from here on can only
                # have listed the entry under this same count.
                counts = await self._attempts(ids)
                # Taking the record is the token: of racing pollers, one redelivers. An id
                # no longer pending (acked, deleted) loses its record and nothing else.
                taken = await self._take(ids, now)
            # Claimed under the count the nack was about: if it was delivered again since,
            # that delivery was the retry, and the record (already taken) is dropped.
            mine = {i: n or counts[i] for i, n in taken.items() if n > 0 or (n == 0 and i in counts)}
            # Retried until it lands; a repeat after a lost reply hands back what the
            # first run claimed (the memo), and claims nothing twice.
            nonce = uuid.uuid4().hex
            live = await self._retrying(
                "XCLAIM",
                lambda: claim_unchanged(
                    self.client,
                    self.topic,
                    self.group,
                    self.consumer,
                    mine,
                    nonce=nonce,
                    max_attempts=self.policy.max_attempts,
                ),
            )
            for claimed in live:
                if claimed.given_up:
                    give_up(claimed)
                else:
                    push(claimed.id, claimed.fields, claimed.attempt)
            if len(due) == limit:
                return now  # maybe more: the next poll at once (it finds the room left)
        return int(later[0][1]) if later else None

    async def _attempts(self, ids: Sequence[str]) -> dict[str, int]:
        return await delivery_counts(self.client, self.topic, self.group, ids)

    async def _retrying(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """Run `call` until it works; gives up (CancelledError) once closed."""

        async def count(e: BaseException) -> None:
            self.metrics.redis_errors.inc()
            log.warning("%s on %s: %s; retrying", what, self.topic, e)

        return await retrying(
            call,
            retried=_RETRIED,
            on_error=count,
            stopped=lambda: self._closed,
            sleep=self.clock.sleep,
            backoff=REDIS_RECONNECT.backoff(),
            call_timeout=self.call_timeout,
        )
