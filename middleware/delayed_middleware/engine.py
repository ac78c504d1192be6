"""The delay engine: durable scheduling and exactly-once, failure-atomic firing on Redis.

State lives only in Redis (see keys.EngineKeys): the component keeps nothing
per message in memory, so a million pending messages cost Redis memory, not
ours. Firing never polls on a fixed tick: the loop sleeps until the earliest
due time and is woken early through a pub/sub channel when any replica
schedules an earlier one.

Every state change is one Lua script (lua/*.lua, see scripts.py) that also
appends its lifecycle record (history.py) in the same atomic step:
  - SCHEDULE stores envelopes and indexes them; a per-call token makes a
    client's retry after a lost reply a no-op;
  - FIRE moves a bounded batch of due occurrences to their targets; a target
    that cannot take them parks that one envelope, the rest fire;
  - CANCEL withdraws one by scheduleId or envelope id;
  - REFILL gives a recurring envelope its next due time.

Recurring envelopes: cron arithmetic cannot run in Lua, so each recurring
envelope's ids-hash ref holds its current due time and the NEXT one,
precomputed. FIRE delivers the occurrence, re-indexes the envelope at the next
time and marks it for refill; the firing replica then computes the time after
that with the injected `recurrence` function and stores it with REFILL (a
compare-and-set). A crash between the two loses nothing: the refill mark is in
Redis and any replica's loop completes it before that envelope can fire again
(FIRE never fires an occurrence whose successor is unknown). An occurrence
whose successor has passed too (the component or Redis was down across
several fire times) is handed to REFILL with the current time, so it fires
once on recovery and then continues on its schedule.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from delayed_middleware import scripts
from delayed_middleware.backoff import Backoff
from delayed_middleware.clock import Clock
from delayed_middleware.entry import Trim
from delayed_middleware.envelope import Envelope, EnvelopeDecodeError, decode_envelope, encode_envelope
from delayed_middleware.errors import PartiallyStoredError
from delayed_middleware.instants import format_instant
from delayed_middleware.keys import EngineKeys

log = logging.getLogger(__name__)

# The next fire time of a recurring envelope strictly after `after_ms`, or None
# when its schedule has no further fire.
Recurrence = Callable[[Envelope, int], "int | None"]


# Recurring envelopes refilled per round trip, and ids cancelled per script call.
REFILL_BATCH = 200
CANCEL_BATCH = 500
# The metadata key of a marker message (deleteMarkerTTL): why the message will not come.
MARKER_REASON = "markerReason"


@dataclass(frozen=True)
class EngineConfig:
    """Tuning knobs; the defaults suit most deployments."""

    # One fire call's budget: envelopes, work (appended entries, plus one per
    # four metadata pairs: see fire.lua) and envelope bytes (metadata included). Sized
    # so a call stays within ~20 ms of Redis time (bench/delay.py, SLOWLOG).
    batch_size: int = 500
    batch_entries: int = 2000
    batch_bytes: int = 4 << 20
    # ...and Redis time: a batch stops after this long (checked with Redis TIME),
    # so no call holds Redis for more than ~this, however loaded the machine.
    fire_budget_us: int = 10_000
    # Envelopes and bytes per SCHEDULE call: a huge bulk publish is stored in
    # bounded steps (64 MiB in one call held Redis ~200 ms; SLOWLOG).
    schedule_chunk: int = 500
    schedule_chunk_bytes: int = 1 << 20
    # A cap on any one sleep, so a lost wake message (a dropped pub/sub
    # connection) or a stepped clock delays a fire by at most this much.
    max_sleep_s: float = 5.0
    retry_min_s: float = 0.05
    retry_max_s: float = 2.0
    # Bound on one script round trip: a connection that died without a FIN
    # (a partitioned Redis) must not stall the loop forever.
    op_timeout_s: float = 30.0
    # Lifecycle history retention: entries (approximate, 0 = no history) and age.
    history_max_len: int = 1_000_000
    history_max_age_ms: int = 86_400_000
    # How long a schedule call's token is remembered (a client's retry after a
    # lost reply must come within it).
    token_window_ms: int = 120_000
    # deleteMarkerTTL: when a cancel or an expiry removes a message, a marker
    # (markerReason Remove / MaxAge) goes on its topic, living this long; 0 = none.
    marker_ttl_ms: int = 0


@dataclass(frozen=True)
class FireReport:
    """What one fire_due call did, for metrics: handed to the engine's on_batch hook."""

    fired: int
    # now - the earliest due time in the batch (0 when nothing fired).
    max_lateness_ms: int
    # Messages still waiting in the index after the batch.
    pending: int
    parked: int = 0
    entries: int = 0


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
        recurrence: Recurrence | None = None,
        listen_client: aioredis.Redis | None = None,
        pubsub_name: str = "",
    ) -> None:
        self._redis = client
        # The wake listener parks a connection for good: on a client of its own
        # it cannot starve short commands of a bounded pool (poolSize).
        self._listen_redis = listen_client if listen_client is not None else client
        self._keys = keys
        self._clock = clock
        self._trim = trim or Trim()
        self._config = config
        self._schedule = client.register_script(scripts.SCHEDULE)
        self._fire = client.register_script(scripts.FIRE)
        self._cancel = client.register_script(scripts.CANCEL)
        self._refill = client.register_script(scripts.REFILL)
        self._on_batch = on_batch
        self._recurrence = recurrence
        # `trim` applies to messages published through this component only
        # (others sharing the delayed topic have their own); '' = to all.
        self._pubsub_name = pubsub_name
        self._wake = asyncio.Event()
        self._last_history_trim = 0

    @property
    def keys(self) -> EngineKeys:
        return self._keys

    def _history_len(self) -> int:
        return self._config.history_max_len

    async def schedule(
        self, envelopes: Sequence[Envelope], *, token: str | None = None, timeout_s: float | None = None
    ) -> list[str]:
        """Store envelopes durably; returns their ids (scheduleId, else their stream id).

        When this returns, Redis holds them: a crash of this process from here
        on loses nothing. Each SCHEDULE call carries a token the script
        remembers (`<token>/<offset>` per chunk): calling again with the same
        `token` after a lost reply stores nothing twice, so the caller may
        retry. Recurring envelopes must have a `recurrence`.

        Many envelopes are stored in chunks, each bounded by `timeout_s`. When
        a chunk fails after earlier ones were stored, PartiallyStoredError says
        how many envelopes (in order) are stored; a failure before any chunk
        was stored raises the Redis error (or TimeoutError) itself.
        """
        ids: list[str] = []
        encoded = [encode_envelope(env) for env in envelopes]
        for start, end in self._chunks(encoded):
            # A caller's token names each chunk (a retry of the call repeats them all).
            chunk_token = token if token is None or not start else f"{token}/{start}"
            try:
                async with asyncio.timeout(timeout_s):
                    ids += await self._schedule_chunk(envelopes[start:end], encoded[start:end], chunk_token)
            except (RedisError, TimeoutError) as exc:
                if not start:
                    raise
                raise PartiallyStoredError(
                    start,
                    f"scheduling on {self._keys.stream!r}: {start} of {len(envelopes)} stored, then "
                    f"redis: {exc or 'timed out'}",
                ) from exc
        return ids

    def _chunks(self, encoded: Sequence[bytes]) -> list[tuple[int, int]]:
        """[start, end) runs of at most schedule_chunk envelopes and schedule_chunk_bytes
        (one envelope above that is a run of its own)."""
        runs: list[tuple[int, int]] = []
        start, size = 0, 0
        for i, raw in enumerate(encoded):
            full = (
                i - start >= self._config.schedule_chunk
                or size + len(raw) > self._config.schedule_chunk_bytes
            )
            if i > start and full:
                runs.append((start, i))
                start, size = i, 0
            size += len(raw)
        if start < len(encoded):
            runs.append((start, len(encoded)))
        return runs

    async def _schedule_chunk(
        self, envelopes: Sequence[Envelope], encoded: Sequence[bytes], token: str | None
    ) -> list[str]:
        if not envelopes:
            return []
        now = self._clock.now_ms()
        args: list[Any] = [
            self._keys.buckets,
            self._keys.wake,
            now,
            token or secrets.token_hex(8),
            self._history_len(),
            self._config.token_window_ms,
            len(envelopes),
        ]
        for env, raw in zip(envelopes, encoded, strict=True):
            nxt, iso = "-", "-"
            if env.is_recurring:
                nxt, iso = self._next_after(env, env.due_ms)
            args += [
                raw,
                env.due_ms,
                env.schedule_id,
                env.kind,
                env.topic,
                env.size,
                env.schedule,
                nxt,
                iso,
            ]
        raw = await self._schedule(keys=self._keys.script_keys, args=args)
        out = [_s(i) for i in raw]
        if out == ["dup"]:
            # Stored by an earlier attempt of this very call.
            return []
        return out

    def _next_after(self, env: Envelope, after_ms: int) -> tuple[str, str]:
        if self._recurrence is None:
            raise ValueError("a recurring envelope needs the engine's recurrence function")
        nxt = self._recurrence(env, after_ms)
        if nxt is None:
            return scripts.PURGE, "-"
        if nxt <= after_ms:
            raise ValueError(f"recurrence gave {nxt}, not after {after_ms}")
        return str(nxt), format_instant(nxt)

    async def cancel(self, id: str, *, reason: str = "Remove") -> bool:
        """Withdraw a pending message or schedule by scheduleId or envelope id; True if one was there."""
        [(found, _)] = await self.cancel_many([id], reason=reason)
        return found

    async def cancel_many(self, ids: Sequence[str], *, reason: str = "Remove") -> list[tuple[bool, str]]:
        """Withdraw many by scheduleId or envelope id, CANCEL_BATCH per script call.

        Returns (cancelled?, the message's topic or '') per id, in order; with
        deleteMarkerTTL set, a `Remove` marker goes on each cancelled topic.
        """
        out: list[tuple[bool, str]] = []
        for start in range(0, len(ids), CANCEL_BATCH):
            part = list(ids[start : start + CANCEL_BATCH])
            raw = await self._cancel(
                keys=self._keys.script_keys,
                args=[
                    self._keys.buckets,
                    self._clock.now_ms(),
                    self._history_len(),
                    reason,
                    len(part),
                    *part,
                ],
            )
            out += [(bool(int(raw[i])), _s(raw[i + 1])) for i in range(0, len(raw), 2)]
        await self._markers("Remove", [(i, t) for i, (found, t) in zip(ids, out, strict=True) if found and t])
        return out

    async def _markers(self, reason: str, cancelled: Sequence[tuple[str, str]]) -> None:
        """Marker messages (deleteMarkerTTL): one per topic whose message was removed.

        Best effort, after the change they report: a marker tells subscribers
        that something they might wait for will not come; losing one to a crash
        loses no data, so it is not worth holding the script across slots.
        """
        ttl = self._config.marker_ttl_ms
        if not ttl or not cancelled:
            return
        expires = str(self._clock.now_ms() + ttl)
        pipe = self._redis.pipeline(transaction=False)
        for sid, topic in cancelled:
            metadata = json.dumps({MARKER_REASON: reason, scripts.SCHEDULER: sid}, separators=(",", ":"))
            pipe.xadd(topic, {"data": b"", "metadata": metadata, "expiresAt": expires})
        for result in await pipe.execute(raise_on_error=False):
            if isinstance(result, Exception):
                log.warning("marker (%s) on %s not written: %s", reason, self._keys.stream, result)

    async def pending(self) -> int:
        """How many messages wait in the index of this delayed topic."""
        return int(await self._redis.get(self._keys.count) or 0)

    async def fire_due(self) -> tuple[int, int | None]:
        """Fire one bounded batch of what is due now, in one atomic script, then
        complete the refills it asked for (and fire again once if that made
        something due: a recurring envelope whose refill was still pending).

        Returns (envelopes fired by this call, earliest due time left or None).
        """
        fired, head, refill = await self._fire_once()
        # Refills in proportion to what this batch fired (each round trip
        # refills REFILL_BATCH), soonest needed first: successors are known
        # long before their time, and firing never queues behind a backlog.
        if refill and await self.refill_pending(limit=max(refill, REFILL_BATCH)) and not fired:
            fired, head, _ = await self._fire_once()
        return fired, head

    async def _fire_once(self) -> tuple[int, int | None, int]:
        now = self._clock.now_ms()
        mode, threshold = self._trim.args(now)
        cfg = self._config
        raw = await self._fire(
            keys=self._keys.script_keys,
            args=[
                self._keys.buckets,
                now,
                cfg.batch_size,
                cfg.batch_entries,
                cfg.batch_bytes,
                mode,
                threshold,
                self._history_len(),
                cfg.fire_budget_us,
                self._pubsub_name,
            ],
        )
        fired, head, first, pending = int(raw[0]), _s(raw[1]), _s(raw[2]), int(raw[3])
        parked, refill, entries = int(raw[4]), int(raw[5]), int(raw[6])
        expired = [(_s(raw[i]), _s(raw[i + 1])) for i in range(8, len(raw) - 1, 2)]
        if expired:
            await self._markers("MaxAge", expired)
        if len(raw) > 7 and int(raw[7]):
            log.error(
                "%d pending message(s) on %s were lost: their envelopes were deleted from the delayed "
                "topic by something other than the delay engine (XTRIM/XDEL, or a MAXLEN publish to it)",
                int(raw[7]),
                self._keys.stream,
            )
        if parked:
            log.error(
                "%d envelope(s) on %s could not be delivered and were parked (listed in %s)",
                parked,
                self._keys.stream,
                self._keys.parked,
            )
        if self._on_batch is not None and (fired or parked):
            # The batch's earliest due time is its latest message.
            late_ms = now - int(first) if first else 0
            self._on_batch(
                FireReport(
                    fired=fired, max_lateness_ms=late_ms, pending=pending, parked=parked, entries=entries
                )
            )
        return fired, (int(float(head)) if head else None), refill

    async def refill_pending(self, limit: int = 10_000, *, until_ms: int | None = None) -> int:
        """Give recurring envelopes waiting for it their next due time; returns how many.

        The refill set is scored by when each envelope next needs its successor
        known: with `until_ms`, only those needed by then (an occurrence held
        back until its successor is known is scored at its own due time).

        In batches of REFILL_BATCH: one read of the refill set, one pipelined
        read of the refs and envelopes, one REFILL script call. (One envelope at
        a time, 10,000 schedules firing each second could not keep up.)
        """
        if self._recurrence is None:
            # This replica cannot compute one (e.g. an older version in a rolling
            # upgrade): leave them, untouched, to a replica that can.
            return 0
        done = 0
        while done < limit:
            top = "+inf" if until_ms is None else until_ms
            members = [
                _s(m)
                for m in await self._redis.zrangebyscore(
                    self._keys.refill, "-inf", top, start=0, num=REFILL_BATCH
                )
            ]
            if not members:
                break
            applied = await self._refill_batch(members)
            done += applied
            if not applied:
                break
        return done

    async def _refill_batch(self, keys: Sequence[str]) -> int:
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.hget(self._keys.ids, key)
        refs = [None if r is None else _s(r) for r in await pipe.execute()]
        gone = [k for k, r in zip(keys, refs, strict=True) if r is None]
        if gone:
            await self._redis.zrem(self._keys.refill, *gone)
        live = [(k, r) for k, r in zip(keys, refs, strict=True) if r is not None]
        if not live:
            return len(gone)
        pipe = self._redis.pipeline(transaction=False)
        for _, ref in live:
            stream_id = ref.split()[0]
            pipe.xrange(self._keys.stream, stream_id, stream_id)
        rows_of = await pipe.execute()
        now = self._clock.now_ms()
        args: list[Any] = [self._keys.buckets, self._keys.wake, 0]
        for (key, ref), rows in zip(live, rows_of, strict=True):
            try:
                due = int(ref.split()[1])
                if not rows:
                    raise EnvelopeDecodeError(f"envelope {ref.split()[0]} is gone")
                raw = dict(rows[0][1] or {}).get(b"data")
                if not isinstance(raw, bytes):
                    raise EnvelopeDecodeError(f"envelope {ref.split()[0]} has no data")
                nxt, iso = self._next_after(decode_envelope(raw), max(due, now))
            except Exception as exc:
                # EnvelopeDecodeError, ValueError (no later time), or whatever else the
                # recurrence raises: one schedule the engine cannot advance must not
                # stop firing for the whole app. It is withdrawn, with its history record.
                log.error(
                    "recurring %r on %s cannot be refilled: %r; cancelling it", key, self._keys.stream, exc
                )
                await self.cancel(key, reason=f"unschedulable: {exc}")
                continue
            args += [key, ref, nxt, iso]
            args[2] += 1
        if not args[2]:
            return len(gone)
        results = await self._refill(keys=self._keys.script_keys, args=args)
        return len(gone) + sum(1 for r in results if int(r) != 0)

    async def _trim_history(self) -> None:
        """Age-based history retention (the length bound rides on every XADD)."""
        max_age = self._config.history_max_age_ms
        now = self._clock.now_ms()
        if not max_age or not self._config.history_max_len or now - self._last_history_trim < 60_000:
            return
        self._last_history_trim = now
        await self._redis.xtrim(self._keys.history, minid=f"{now - max_age}-0", approximate=True)

    async def run(self) -> None:
        """Fire due messages until cancelled; survives Redis outages."""
        listener = asyncio.create_task(self._listen_wake(), name=f"wake:{self._keys.stream}")
        backoff = Backoff(base_s=self._config.retry_min_s, cap_s=self._config.retry_max_s)
        try:
            while True:
                try:
                    # asyncio.timeout, not wait_for: wait_for can swallow a
                    # cancellation that races with completion (Python < 3.12).
                    async with asyncio.timeout(self._config.op_timeout_s):
                        # Refills a dead replica left are reported by FIRE as due
                        # and completed by fire_due, like this replica's own.
                        fired, head = await self.fire_due()
                        await self._trim_history()
                    _honour_swallowed_cancel()
                    backoff.reset()
                except (RedisError, TimeoutError) as exc:
                    delay = backoff.next()
                    log.warning(
                        "delay engine on %s: redis error %s; retrying in %.2fs", self._keys.stream, exc, delay
                    )
                    await asyncio.sleep(delay)
                    continue
                except Exception:
                    # A bug here or in a hook must not end firing for the whole
                    # app (the task would just be gone): log it, back off, go on.
                    delay = backoff.next()
                    log.exception("delay engine on %s failed; retrying in %.2fs", self._keys.stream, delay)
                    await asyncio.sleep(delay)
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
        backoff = Backoff(base_s=self._config.retry_min_s, cap_s=self._config.retry_max_s)
        while True:
            _honour_swallowed_cancel()
            pubsub = self._listen_redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self._keys.wake)
                # A message may have been missed while (re)subscribing.
                self._wake.set()
                backoff.reset()
                while True:
                    # get_message with a timeout, not listen(): an idle channel
                    # must not look like a dead socket to the read timeout.
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    _honour_swallowed_cancel()
                    if msg is not None:
                        self._wake.set()
            except RedisError as exc:
                log.debug("wake listener on %s: %s", self._keys.wake, exc)
                await asyncio.sleep(backoff.next())
            finally:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(1.0):
                        await pubsub.aclose()  # type: ignore[no-untyped-call]


def _s(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode()
    return "" if value is None else str(value)


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
