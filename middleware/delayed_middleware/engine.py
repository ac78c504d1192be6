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

Recurring envelopes: an @every envelope carries its interval (everyMs), and
FIRE computes each successor itself on the grid `publishedAt + k * interval`
(lua/common.lua's recurring_step): no replica is involved, so 10,000 schedules
firing each second cost Redis only. Cron arithmetic cannot run in Lua, so a
cron envelope's ids-hash ref holds its current due time and the NEXT one,
precomputed. FIRE delivers the occurrence, re-indexes the envelope at the next
time, marks it for refill and returns what the recurrence needs (expression,
acceptance time); the firing replica computes the time after that with the
injected `recurrence` function and stores it with REFILL (a compare-and-set)
in the same fire_due, reading nothing back. A crash between the two loses
nothing: the refill mark is in Redis and any replica's loop completes it
before that envelope can fire again (FIRE never fires an occurrence whose
successor is unknown). An occurrence whose successor has passed too (the
component or Redis was down across several fire times) is handed to REFILL
with the current time, so it fires once on recovery and then continues on
its schedule; an @every one fires once and continues on its grid.

Redis Cluster: the two-phase fire
---------------------------------
A script may only touch keys of one hash slot, and target topics live in
other slots than the delayed topic. So on Cluster (EngineConfig.two_phase)
FIRE's steps run as three scripts, with the same decisions at each step:
  1. CLAIM (the shard's slot) takes a bounded due batch, handles what FIRE
     handles without appending (gone, expired, reserved target, recurring
     waiting for REFILL) and moves the rest from the due index to an in-flight
     sorted set, scored by a lease end (now + lease_ms), recording each
     occurrence's due time in a claims hash; it returns the entries to append.
  2. APPEND (the target's slot), one call per target key: for each envelope,
     `SET <marker> 1 NX PX fire_marker_ttl_ms` and, only if that set it, the XADDs,
     in one script. The marker `{<target's tag>}:<shard stream>}fired:<envelope
     id>:<occurrence due ms>` (keys.fire_marker_prefix) hashes to the target's
     slot and is an engine key (it contains `-delayed}`), so no user can write it.
  3. RELEASE (the shard's slot) finalizes what was appended exactly as FIRE
     does (stream entry, ids hash, history, recurring re-insert and refill
     mark) and parks what APPEND could not write; it acts only on envelopes
     it removes from the in-flight set (ZREM returns 1 once).
CLAIM also takes back in-flight entries whose lease ended, with a new lease,
so a replica that died or stalled is replaced by whichever replica claims
next; each loop sleeps at most until the earliest lease end, so a takeover
comes within the loop's wake-up slack of the lease ending.

Why no crash point loses a message: an occurrence leaves the due index only
into the in-flight set (CLAIM is atomic), and leaves the in-flight set only
in RELEASE, which runs after APPEND wrote it (or parks it, keeping the
envelope). A crash before RELEASE leaves it in flight; its lease ends; the
next CLAIM hands it out again. Why none doubles one: the entries of an
occurrence are appended only by the APPEND call that set its marker (SET NX
and XADD are one atomic script), so a re-run after a crash, a takeover while
the first replica is slow, or two replicas appending at once write it once;
RELEASE acts once (ZREM). Crash points, each tested in
tests/middleware/test_engine_cluster.py: after CLAIM (nothing appended: the
takeover appends all); after APPEND of some targets (the takeover's APPEND
finds those markers and writes only the rest); after every APPEND, before
RELEASE (the takeover writes nothing, then releases); after RELEASE (nothing
left in flight); a replica stalled past its lease while another takes over
(its late APPENDs find markers, its RELEASE finds nothing).
The bound: a marker lives fire_marker_ttl_ms (15 min by default). A claim left in
flight longer than that after its APPEND (every replica down that long
between APPEND and RELEASE) may be appended again on takeover: delivered at
least once, never lost. A replica does not start an APPEND for a claim older
than half that. A cancel that lands while an occurrence is in flight
(between CLAIM and APPEND) sets that occurrence's fire marker itself, after
withdrawing the envelope, so the APPEND writes nothing and RELEASE finds
nothing to record (DelayEngine._stop_in_flight; a cancel after the APPEND
answers False for a one-shot). A replace does the same for the old
envelope's occurrence (best effort: the replace stands if that SET fails).
Left open: the canceller dying between its CANCEL and its SET while the
claiming replica lives (that occurrence may go out; the cancel never
answered). On a single node FIRE has no such window.

Replication (Sentinel and Cluster failover): Redis replicates asynchronously.
Writes a master acknowledged but had not yet sent to the replica that gets
promoted are lost in a failover, for the engine as for any Redis user. What
that means here: a lost SCHEDULE loses that publish; a lost FIRE (Sentinel)
is undone whole, target entry and index change together, so it fires again
(a subscriber that had read the lost entry from the old master sees it
twice); on Cluster, a lost CLAIM or RELEASE whose APPEND survived is handed
out again and the surviving marker stops a second append, while a lost
APPEND whose RELEASE survived (target and shard on different masters) loses
that message. The window is the replication lag, normally milliseconds
(`WAIT` is not used: it would cost a round trip to a replica per call).
After the failover the engine's loop gets
connection errors, backs off (at most retry_max_s), reconnects through
Sentinel or the refreshed cluster slot map, and fires whatever is due.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import json
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from delayed_middleware import pausing, scripts
from delayed_middleware.backoff import Backoff
from delayed_middleware.clock import Clock
from delayed_middleware.entry import Trim
from delayed_middleware.envelope import (
    RECURRING,
    Envelope,
    EnvelopeDecodeError,
    decode_envelope,
    encode_envelope,
)
from delayed_middleware.errors import InvalidArgumentError, PartiallyStoredError
from delayed_middleware.history import IndexSweep
from delayed_middleware.instants import format_instant
from delayed_middleware.keys import (
    EngineKeys,
    fire_marker_prefix,
    is_delayed_topic,
    is_engine_key,
    shard_index,
)
from delayed_middleware.liveness import StateHook, Supervised, run_until_cancelled

log = logging.getLogger(__name__)

# The next fire time of a recurring envelope strictly after `after_ms`, or None
# when its schedule has no further fire.
Recurrence = Callable[[Envelope, int], "int | None"]


# Recurring envelopes refilled per round trip, and ids cancelled per script call.
REFILL_BATCH = 200
CANCEL_BATCH = 500
# Call tokens a ShardedEngine remembers the spread shard of (retries come within seconds).
SPREAD_MEMORY = 4096
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
    # Redis Cluster: fire in three steps (CLAIM, APPEND, RELEASE; see
    # DelayEngine), since target topics live in other hash slots.
    two_phase: bool = False
    # A claimed batch is this replica's for this long; then any replica takes it over.
    lease_ms: int = 5_000
    # How long a fire marker outlives its APPEND: the bound on how long a claim
    # may stay in flight (a stalled replica, or every replica down between
    # APPEND and RELEASE) and still not be appended twice. Costs ~100 B of
    # Redis memory per fired message for this long. (Not marker_ttl_ms above:
    # that is deleteMarkerTTL's marker *messages*; these are idempotency keys.)
    fire_marker_ttl_ms: int = 900_000
    # Compaction (lua/compact.lua): a stream node is freed only when all its
    # entries are deleted, so envelopes that wait long among ones that fired keep
    # whole nodes allocated. The stream's density (live entries per node) is
    # checked once this many envelopes have left it (fired, cancelled) since the
    # last check (0 = never compact); below half of what a pass last achieved (at
    # first: a full node's worth, from its entries' size and Redis's default node
    # size), over at least compact_min_nodes nodes, a pass re-homes the stream's
    # envelopes to its tail, compact_chunk per call within compact_budget_us of
    # Redis time, for up to compact_slice_s per fire step.
    compact_check_every: int = 1_000
    compact_min_nodes: int = 16
    compact_chunk: int = 200
    compact_budget_us: int = 5_000
    compact_slice_s: float = 0.02


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
        fault: Callable[[str], Awaitable[None]] | None = None,
        on_listener_state: StateHook | None = None,
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
        self._claim = client.register_script(scripts.CLAIM)
        self._append = client.register_script(scripts.APPEND)
        self._release = client.register_script(scripts.RELEASE)
        self._uncancel = client.register_script(scripts.UNCANCEL)
        self._compact = client.register_script(scripts.COMPACT)
        self._pause = client.register_script(scripts.PAUSE)
        # Test hook: awaited at each step of the two-phase fire ("claimed",
        # "appended:<n>", "released"); raising there stops the fire like a crash.
        self._fault = fault
        self._on_batch = on_batch
        self._recurrence = recurrence
        # `trim` applies to messages published through this component only
        # (others sharing the delayed topic have their own); '' = to all.
        self._pubsub_name = pubsub_name
        self._wake = asyncio.Event()
        self._last_history_trim = 0
        self._index_sweep = IndexSweep(self._keys.history, self._keys.history_index)
        # How far this replica's clock runs ahead of the shard's Redis TIME, as
        # the last fire measured it (0 with an authoritative clock): the
        # successors computed here are on the shard's time, and the head the
        # fire step returns is moved into this clock's frame for the sleep.
        self._skew_ms = 0
        # Compaction's state (per shard, nothing per message): envelopes that left
        # the stream since its density was last checked, the live entries per node
        # the last pass achieved, and the pass under way: (cursor, end id).
        self._left_since_check = 0
        self._dense: float | None = None
        self._compact_pass: tuple[str, str] | None = None
        # The wake listener of the running loop (supervised), and who hears of its ends.
        self.listener: Supervised | None = None
        self._on_listener_state = on_listener_state

    @property
    def keys(self) -> EngineKeys:
        return self._keys

    @property
    def config(self) -> EngineConfig:
        """The engine's settings."""
        return self._config

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
        retry. Recurring cron envelopes need a `recurrence` (@every ones, with
        every_ms, are advanced by the fire step alone).

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
            # An @every envelope's successors come from the fire step itself.
            if env.is_recurring and not env.every_ms:
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
        two_phase = self._config.two_phase
        raw = await self._schedule(
            keys=self._keys.two_phase_keys if two_phase else self._keys.script_keys, args=args
        )
        out = [_s(i) for i in raw]
        if out == ["dup"]:
            # Stored by an earlier attempt of this very call.
            return []
        ids, replaced = out[: len(envelopes)], out[len(envelopes) :]
        for i in range(0, len(replaced), 3):
            await self._stop_replaced_in_flight(*replaced[i : i + 3])
        return ids

    async def _stop_replaced_in_flight(self, id: str, due: str, target: str) -> None:
        """Two-phase fire: a replaced envelope's occurrence was in flight; stop its APPEND.

        As _stop_in_flight for a cancel, but best effort: the replace is
        stored whatever happens here (failing the publish would make its
        caller retry a stored replace), so a failure is logged, and that one
        occurrence of the old message may still go out, as before this step.
        """
        try:
            if await self._set_fire_marker(id, due, target, "replaced"):
                return
        except RedisError as exc:
            log.warning(
                "replace on %s: the in-flight occurrence of %s may still go out: %s",
                self._keys.stream,
                id,
                exc,
            )
            return
        log.info(
            "replace on %s came after the old envelope %s's occurrence due %s was appended to %s",
            self._keys.stream,
            id,
            due,
            target,
        )

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

        Two-phase fire (Redis Cluster): an occurrence claimed but not yet
        appended when the cancel lands is stopped too: CANCEL names it, and
        this sets its fire marker (see _stop_in_flight) before returning. One
        that was appended first went out before the cancel: a one-shot is then
        reported not cancelled (False).
        """
        out: list[tuple[bool, str]] = []
        # (position in ids, envelope id, claimed due ms, APPEND's target key, kind)
        in_flight: list[tuple[int, str, str, str, int, str]] = []
        keys = self._keys.two_phase_keys if self._config.two_phase else self._keys.script_keys
        for start in range(0, len(ids), CANCEL_BATCH):
            part = list(ids[start : start + CANCEL_BATCH])
            raw = await self._cancel(
                keys=keys,
                args=[
                    self._keys.buckets,
                    self._clock.now_ms(),
                    self._history_len(),
                    reason,
                    len(part),
                    *part,
                ],
            )
            n = 2 * len(part)
            out += [(bool(int(raw[i])), _topic(raw[i + 1])) for i in range(0, n, 2)]
            # Cancelled envelopes left the stream: the next fire step's compaction check counts them.
            self._left_since_check += sum(int(raw[i]) for i in range(0, n, 2))
            for i in range(n, len(raw), 6):
                pos, id, due, target, kind, hid = raw[i : i + 6]
                # A topic that is not text was never appended (its claim parks): nothing to stop.
                if _topic(target):
                    in_flight.append((start + int(pos) - 1, _s(id), _s(due), _s(target), int(kind), _s(hid)))
        if in_flight:
            await self._stop_in_flight(in_flight, out)
        await self._markers("Remove", [(i, t) for i, (found, t) in zip(ids, out, strict=True) if found and t])
        return out

    async def _stop_in_flight(
        self, in_flight: Sequence[tuple[int, str, str, str, int, str]], out: list[tuple[bool, str]]
    ) -> None:
        """Set the fire marker of each cancelled occurrence still in flight, so no APPEND writes it.

        The marker is the one APPEND sets with NX in the target's slot (keys.
        fire_marker_prefix): set here first, APPEND finds it and appends
        nothing, and RELEASE, finding the envelope withdrawn, records nothing
        more (its `cancelled` record stands). Found already set, APPEND got
        there first: the occurrence was delivered before this cancel returned;
        a one-shot's result becomes False, and its `cancelled` history record
        becomes the `fired` one RELEASE can no longer write (UNCANCEL; a
        recurring schedule stays cancelled: its later occurrences are). The window left: this process
        dying (or the target's master failing) between CANCEL and this SET,
        while the claiming replica is alive: that one occurrence may go out,
        and this cancel call has not returned OK.
        """
        # Every marker is tried, even after one fails (its target's master may be
        # down): the first error is raised at the end, so the cancel is not
        # answered OK while some occurrence may still go out.
        failure: BaseException | None = None
        for pos, id, due, target, kind, hid in in_flight:
            try:
                if await self._set_fire_marker(id, due, target, "cancelled"):
                    continue
            except (RedisError, TimeoutError) as exc:
                failure = failure or exc
                continue
            log.warning(
                "cancel of %s on %s came after its occurrence due %s was appended to %s: delivered once",
                id,
                self._keys.stream,
                due,
                target,
            )
            if kind != RECURRING:
                out[pos] = (False, out[pos][1])
                if hid:
                    try:
                        await self._uncancel(
                            keys=[self._keys.history], args=[hid, self._clock.now_ms(), self._history_len()]
                        )
                    except (RedisError, TimeoutError) as exc:
                        failure = failure or exc
        if failure is not None:
            raise failure

    async def _set_fire_marker(self, id: str, due: str, target: str, why: str) -> bool:
        """SET NX the fire marker APPEND would set for envelope `id`'s occurrence `due` on
        `target` (keys.fire_marker_prefix); False when it was set already (appended)."""
        marker = f"{fire_marker_prefix(target, self._keys.stream)}{id}:{due}"
        return bool(await self._redis.set(marker, why, nx=True, px=self._config.fire_marker_ttl_ms))

    async def _markers(self, reason: str, cancelled: Sequence[tuple[str, str]]) -> None:
        """Marker messages (deleteMarkerTTL): one per topic whose message was removed.

        Best effort, after the change they report: a marker tells subscribers
        that something they might wait for will not come; losing one to a crash
        loses no data, so it is not worth holding the script across slots.
        """
        ttl = self._config.marker_ttl_ms
        cancelled = [(sid, topic) for sid, topic in cancelled if topic]  # '': not text (_topic)
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

    # --- pause, resume, cancel by prefix (the logic is in pausing.py) --------

    async def set_paused(self, id: str, *, pause: bool, reason: str = "") -> pausing.PauseResult:
        """Pause (True) or resume (False) one pending message or schedule by id (see pausing)."""
        return await pausing.set_paused(self, id, pause=pause, reason=reason)

    async def cancel_prefix(self, prefix: str, *, reason: str = "Remove") -> int:
        """Cancel every pending message and schedule whose id starts with `prefix`; how many."""
        return await pausing.cancel_prefix(self, prefix, reason=reason)

    async def run_pause_script(self, op: str, id: str, reason: str, extra: Sequence[str]) -> list[Any]:
        """One PAUSE call (lua/pause.lua) with this engine's keys; its raw reply."""
        keys = self._keys.two_phase_keys if self._config.two_phase else self._keys.script_keys
        args: list[str | int] = [
            self._keys.buckets,
            self._clock.now_ms(),
            self._history_len(),
            op,
            id,
            reason,
        ]
        return list(await self._pause(keys=keys, args=[*args, self._keys.wake, *extra]))

    @property
    def redis(self) -> aioredis.Redis:
        """The client this engine writes with."""
        return self._redis

    def shard_now(self) -> int:
        """This shard's time as of the last fire step's measurement."""
        return self._shard_now()

    def next_fire(self, env: Envelope, after_ms: int) -> int | None:
        """A recurring envelope's first fire strictly after `after_ms` (None: none left)."""
        if self._recurrence is None:
            raise ValueError("a recurring envelope needs the engine's recurrence function")
        return self._recurrence(env, after_ms)

    def next_after(self, env: Envelope, after_ms: int) -> tuple[str, str]:
        """As next_fire, as the ref's (ms, RFC 3339) strings, ('purge', '-') when none."""
        return self._next_after(env, after_ms)

    async def has_key(self, key: str) -> bool:
        """True if `key` is a pending scheduleId (or recurring envelope id) here."""
        return bool(await self._redis.hexists(self._keys.ids, key))

    async def holds(self, stream_id: str) -> bool:
        """True if this delayed topic holds the envelope whose id is `stream_id` (wherever compaction put it)."""
        at = await self._redis.hget(self._keys.moved, stream_id)
        stored = stream_id if at is None else _s(at)
        return bool(await self._redis.xrange(self._keys.stream, stored, stored))

    async def pending(self) -> int:
        """How many messages wait in the index of this delayed topic."""
        return int(await self._redis.get(self._keys.count) or 0)

    async def fire_due(self) -> tuple[int, int | None]:
        """Fire one bounded batch of what is due now, in one atomic script, then
        complete the refills it asked for (and fire again once if that made
        something due: a recurring envelope whose refill was still pending).

        Returns (envelopes fired by this call, earliest due time left or None).
        """
        fired, head, refill, quads = await self._fire_once()
        # This batch's cron envelopes: their successors computed here from
        # what the script returned, stored in one REFILL call (no reads).
        await self._advance(quads)
        # Refills overdue (a replica died between its FIRE and its REFILL, or
        # an occurrence whose successor had passed waits for one), soonest first.
        if refill and await self.refill_pending(limit=max(refill, REFILL_BATCH)) and not fired:
            fired, head, _, quads = await self._fire_once()
            await self._advance(quads)
        # Compaction runs only when nothing is due: it never delays a fire batch,
        # and never re-homes envelopes about to fire.
        await self._compact_step(fired, idle=head is None or head > self._clock.now_ms())
        return fired, head

    # --- compaction: free the stream nodes that long-waiting envelopes pin ----

    @property
    def compacting(self) -> bool:
        """True while a compaction pass is under way (fire steps go on with it)."""
        return self._compact_pass is not None

    async def compact(self) -> bool:
        """Check the stream's density now and, if it is sparse, run a whole compaction
        pass (for operators and tests; fire steps do the same in slices). True if a pass ran."""
        if self._compact_pass is None:
            end = await self._sparse_until()
            if end is None:
                return False
            self._compact_pass = ("-", end)
        while self._compact_pass is not None:
            await self._compact_chunk()
        return True

    async def _compact_chunk(self) -> None:
        assert self._compact_pass is not None
        cfg = self._config
        cursor, end = self._compact_pass
        raw = await self._compact(
            keys=self._keys.script_keys, args=[cursor, end, cfg.compact_chunk, cfg.compact_budget_us]
        )
        after = _s(raw[0])
        if after:
            self._compact_pass = (after, end)
        else:
            self._compact_pass = None
            self._dense = await self._density()

    async def _compact_step(self, left: int, *, idle: bool) -> None:
        """Counts envelopes that left the stream; checks its density once enough did,
        and runs a slice of the compaction pass under way (lua/compact.lua).

        A pass walks the stream as it was when it began and re-homes every
        envelope to the tail, so it ends. Passes start only when the density fell
        to half of what the last one achieved: the envelopes re-homed per pass are
        at most about twice those that left the stream since the last pass.
        """
        cfg = self._config
        if not cfg.compact_check_every:
            return
        self._left_since_check += left
        if not idle:
            return
        if self._compact_pass is None:
            if self._left_since_check < cfg.compact_check_every:
                return
            self._left_since_check = 0
            end = await self._sparse_until()
            if end is None:
                return
            self._compact_pass = ("-", end)
            log.info("compacting %s: re-homing envelopes up to %s", self._keys.stream, end)
        # A budget of this process's time, not of the (injected) clock's: the
        # slice bounds how long fires wait behind compaction.
        deadline = time.monotonic() + cfg.compact_slice_s
        while self._compact_pass is not None:
            await self._compact_chunk()
            if time.monotonic() >= deadline:
                break
        if self._compact_pass is not None:
            # More to do: the run loop comes straight back instead of sleeping.
            self._wake.set()

    async def _density(self) -> float | None:
        info = await self._stream_info()
        if info is None:
            return None
        length, nodes = int(info["length"]), int(info["radix-tree-keys"])
        return max(1.0, length / nodes) if nodes else None

    async def _stream_info(self) -> dict[str, Any] | None:
        try:
            info: dict[str, Any] = await self._redis.xinfo_stream(self._keys.stream)
        except ResponseError:
            return None  # no stream (nothing pending)
        return info

    async def _sparse_until(self) -> str | None:
        """The stream's last id if it is sparse enough to compact, else None."""
        info = await self._stream_info()
        if info is None:
            return None
        length, nodes = int(info["length"]), int(info["radix-tree-keys"])
        if nodes < self._config.compact_min_nodes:
            return None
        dense = self._dense or _full_node(info.get("first-entry"))
        if length * 2 >= nodes * dense:
            return None
        return _s(info["last-generated-id"])

    async def _advance(self, quads: Sequence[Any]) -> None:
        """REFILL the cron envelopes a fire step just advanced (common.lua's REFILLS).

        Each quad is (ids key, the ref the script wrote, schedule expression,
        acceptance ms): enough for the recurrence function, so nothing is read
        back. REFILL's compare-and-set makes a race with a replace, a cancel or
        another replica a no-op. One that cannot be computed stays in the refill
        set, where refill_pending (which cancels unschedulable ones) finds it.
        """
        if not quads or self._recurrence is None:
            return
        now = self._shard_now()
        args: list[Any] = [self._keys.buckets, self._keys.wake, 0]
        for i in range(0, len(quads) - 3, 4):
            # All inside the guard: a hand-written envelope's fields (not UTF-8, say)
            # must not stop the rest of the batch's refills.
            try:
                key, ref, expr, published = _s(quads[i]), _s(quads[i + 1]), _s(quads[i + 2]), _s(quads[i + 3])
                stream_id, due_text = ref.split()[:2]
                due = int(due_text)
                sid = "" if key == stream_id else key
                probe = Envelope(
                    id=sid,
                    topic="",
                    due_ms=due,
                    published_at_ms=int(published),
                    schedule_id=sid,
                    kind=RECURRING,
                    schedule=expr,
                )
                nxt, iso = self._next_after(probe, max(due, now))
            except Exception as exc:
                log.warning(
                    "recurring %r on %s: successor not computed now: %r", quads[i], self._keys.stream, exc
                )
                continue
            args += [key, ref, nxt, iso]
            args[2] += 1
        if args[2]:
            await self._refill(keys=self._keys.script_keys, args=args)

    def _report(self, now: int, fired: int, first: str, pending: int, parked: int, entries: int) -> None:
        """Log parked envelopes and hand one fire call's figures to the on_batch hook."""
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

    def _decide_at(self) -> tuple[int, int | str]:
        """This replica's clock now, and the FIRE/CLAIM/RELEASE `now` argument:
        that time from an authoritative (injected) clock, else '' for the
        shard's Redis TIME (see clock.Clock.authoritative)."""
        local = self._clock.now_ms()
        return local, (local if self._clock.authoritative else "")

    def _measured(self, local: int, decided: int, head: str) -> int | None:
        """Records the skew a fire step measured; returns its head in this clock's frame."""
        self._skew_ms = local - decided
        return int(float(head)) + self._skew_ms if head else None

    def _trim_args(self, local: int) -> tuple[str, str]:
        """The trim FIRE and APPEND apply to target topics (maxLenApprox / streamTTL).

        streamTTL's MINID is compared with stream ids, which the target's Redis
        clock makes. Unless this clock is authoritative, the script takes the
        threshold from its own TIME (mode MINAGE, threshold = the age): a skew
        measured by an earlier fire step is unknown at the first one, and on
        Cluster the target's node is not the shard's."""
        mode, threshold = self._trim.args(local)
        if mode == "MINID" and not self._clock.authoritative:
            return "MINAGE", str(self._trim.max_age_ms)
        return mode, threshold

    def _shard_now(self) -> int:
        """The shard's time as of the last fire step's measurement (successors are computed on it)."""
        return self._clock.now_ms() - self._skew_ms

    async def _fire_once(self) -> tuple[int, int | None, int, Sequence[Any]]:
        if self._config.two_phase:
            return await self._fire_two_phase()
        local, now_arg = self._decide_at()
        mode, threshold = self._trim_args(local)
        cfg = self._config
        raw = await self._fire(
            keys=self._keys.script_keys,
            args=[
                self._keys.buckets,
                now_arg,
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
        parked, refill, entries, gone, decided, n_expired = (
            int(raw[4]),
            int(raw[5]),
            int(raw[6]),
            int(raw[7]),
            int(raw[8]),
            int(raw[9]),
        )
        expired = [(_topic(raw[10 + 2 * i]), _topic(raw[11 + 2 * i])) for i in range(n_expired)]
        if expired:
            await self._markers("MaxAge", expired)
        if gone:
            self._log_gone(gone)
        self._report(decided, fired, first, pending, parked, entries)
        return fired, self._measured(local, decided, head), refill, raw[10 + 2 * n_expired :]

    def _log_gone(self, gone: int) -> None:
        log.error(
            "%d pending message(s) on %s were lost: their envelopes were deleted from the delayed "
            "topic by something other than the delay engine (XTRIM/XDEL, or a MAXLEN publish to it)",
            gone,
            self._keys.stream,
        )

    # --- the two-phase fire (Redis Cluster): CLAIM, APPEND, RELEASE ----------

    async def _fire_two_phase(self) -> tuple[int, int | None, int, Sequence[Any]]:
        """FIRE's steps split where the target topics leave the shard's slot.

        CLAIM moves a bounded due batch (and any claim whose lease ended) to
        the in-flight set; APPEND writes each target's envelopes, one call per
        target, guarded by fire markers; RELEASE finalizes what was appended
        and parks what could not be. See the module docstring for why no crash
        point loses or doubles a message.
        """
        now, now_arg = self._decide_at()
        cfg = self._config
        raw = await self._claim(
            keys=self._keys.two_phase_keys,
            args=[
                self._keys.buckets,
                now_arg,
                cfg.batch_size,
                cfg.batch_entries,
                cfg.batch_bytes,
                self._history_len(),
                cfg.fire_budget_us,
                cfg.lease_ms,
                self._pubsub_name,
            ],
        )
        head, pending, parked, refill, first = _s(raw[0]), int(raw[1]), int(raw[2]), int(raw[3]), _s(raw[4])
        gone, decided, n_expired = int(raw[5]), int(raw[6]), int(raw[7])
        expired = [(_topic(raw[8 + 2 * i]), _topic(raw[9 + 2 * i])) for i in range(n_expired)]
        claims = _parse_claims(raw[8 + 2 * n_expired :])
        # As FIRE's: MaxAge markers for what expired unfired, and a loud line for what was deleted.
        if expired:
            await self._markers("MaxAge", expired)
        if gone:
            self._log_gone(gone)
        fired = entries = 0
        quads: Sequence[Any] = ()
        if claims:
            await self._at("claimed")
            outcomes = await self._append_claims(claims, now)
            args: list[Any] = [self._keys.buckets, self._decide_at()[1], self._history_len(), len(claims)]
            for c in claims:
                args += [c.id, outcomes[c.id]]
            done = await self._release(keys=self._keys.two_phase_keys, args=args)
            await self._at("released")
            parked += int(done[1])
            fired = int(done[3])
            head = _s(done[4])
            quads = done[5:]
            entries = sum(len(c.entries) for c in claims if outcomes[c.id] == "ok")
        self._report(decided, fired, first, pending, parked, entries)
        # A batch cut short by its budget leaves more due: say so, so the loop goes on.
        more = len(claims)
        return more, self._measured(now, decided, head), refill, quads

    async def _append_claims(self, claims: Sequence[_Claim], claimed_at: int) -> dict[str, str]:
        """APPEND every claimed envelope, one call per target; outcome per envelope id."""
        cfg = self._config
        outcomes: dict[str, str] = {}
        groups: dict[str, list[_Claim]] = {}
        for c in claims:
            if c.bad:
                outcomes[c.id] = c.bad
            elif c.target:
                groups.setdefault(c.target, []).append(c)
            else:
                outcomes[c.id] = "withdrawn"  # cancelled or replaced while in flight
        mode, threshold = self._trim_args(self._clock.now_ms())
        done = 0

        async def append(target: str, group: list[_Claim]) -> None:
            nonlocal done
            prefix = fire_marker_prefix(target, self._keys.stream)
            outbox = bool(group[0].target_pubsub)
            payloads = [c.entries if not c.source else await self._sampled(c.source, c) for c in group]
            # CLAIM cannot size a scheduleSource's sample (it lives in another
            # slot), so the bytes bound FIRE keeps per call is kept here per
            # APPEND call: a target's claims go in runs of at most batch_bytes
            # (at least one claim each). Each run is atomic on its own markers.
            runs: list[list[int]] = [[]]
            size = 0
            for i, entries in enumerate(payloads):
                n = sum(len(v) for fields in entries for v in fields)
                if runs[-1] and size + n > cfg.batch_bytes:
                    runs.append([])
                    size = 0
                runs[-1].append(i)
                size += n
            for run in runs:
                # A replica that stalled this long may find its markers expired:
                # it must leave the claim to the replica that took its lease over.
                if self._clock.now_ms() - claimed_at > cfg.fire_marker_ttl_ms // 2:
                    raise TimeoutError(
                        f"claim on {self._keys.stream} is {cfg.fire_marker_ttl_ms // 2} ms old; abandoned"
                    )
                args: list[Any] = [cfg.fire_marker_ttl_ms, "" if outbox else mode, threshold, len(run)]
                for i in run:
                    args += [1 if group[i].trim else 0, len(payloads[i])]
                    for fields in payloads[i]:
                        args.append(len(fields) // 2)
                        args += fields
                keys = [target, *(f"{prefix}{group[i].id}:{group[i].due}" for i in run)]
                raw = await self._append(keys=keys, args=args)
                for i, status in zip(run, raw, strict=True):
                    outcomes[group[i].id] = _s(status)
                done += 1
                await self._at(f"appended:{done}")

        # Targets are independent (other slots, often other masters): append
        # to them concurrently, each to its end. A failed APPEND is that
        # target's failed write: what the others wrote stands (their markers
        # keep a takeover from writing it twice), the whole claim stays in
        # flight, and the caller's loop handles the error like any failed
        # write (the lease ends, the claim is taken over). Not a TaskGroup: on
        # Python 3.11 a child's failure leaves a cancellation request on this
        # task, which read as a stop ended firing for good.
        results = await asyncio.gather(
            *(append(target, group) for target, group in groups.items()), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        for error in errors:
            if isinstance(error, Exception):
                raise error
        if errors:
            # A child cancelled while this task was not: a swallowed cancellation
            # inside the client. Still that write's failure, not a stop.
            raise TimeoutError(f"an APPEND of {self._keys.stream} was cancelled")
        return outcomes

    async def _sampled(self, source: str, c: _Claim) -> list[list[str | bytes]]:
        """scheduleSource: the source topic's latest entry, read now (it lives in another slot)."""
        if is_delayed_topic(source) or is_engine_key(source):
            return []
        try:
            rows = await self._redis.xrevrange(source, "+", "-", count=1)
        except ResponseError as exc:
            # A source whose key is not a stream gives nothing, as in FIRE. Raised,
            # the claim was taken over at each lease end and raised again: the
            # shard (and every claim beside it) stopped firing.
            if not str(exc).startswith("WRONGTYPE"):
                raise
            return []
        if not rows:
            return []
        # Anyone writes the source (FIRE compares its field names as bytes): a name
        # that is not UTF-8, or JSON nested past Python's recursion limit, must not
        # raise here, after CLAIM, any more than a WRONGTYPE.
        f = {
            k.decode(errors="replace") if isinstance(k, bytes) else str(k): v
            for k, v in (rows[0][1] or {}).items()
        }
        md: dict[str, Any] = {}
        with contextlib.suppress(ValueError, TypeError, RecursionError):
            loaded = json.loads(f.get("metadata", b"{}"))
            # As FIRE: keep the source's metadata only if it encodes again as
            # strict JSON (1e400 loads as inf), else drop it; the data still goes out.
            if isinstance(loaded, dict) and _strict_json(loaded):
                md = loaded
        md["scheduler"], md["scheduleNext"] = c.scheduler, c.schedule_next
        ct = f.get("contentType", b"")
        return [c.fields(f.get("data", b""), json.dumps(md, separators=(",", ":")), ct)]

    async def _at(self, point: str) -> None:
        if self._fault is not None:
            await self._fault(point)

    async def refill_pending(self, limit: int = 10_000) -> int:
        """Give recurring envelopes waiting for it their next due time; returns how many.

        Soonest needed first (the refill set is scored by when each envelope
        needs its successor known). In batches of REFILL_BATCH: one read of the refill set, one pipelined
        read of the refs and envelopes, one REFILL script call. (One envelope at
        a time, 10,000 schedules firing each second could not keep up.)
        """
        if self._recurrence is None:
            # This replica cannot compute one (e.g. an older version in a rolling
            # upgrade): leave them, untouched, to a replica that can.
            return 0
        done = 0
        while done < limit:
            members = [_s(m) for m in await self._redis.zrange(self._keys.refill, 0, REFILL_BATCH - 1)]
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
        # A paused envelope waits for its resume, not for a refill (pausing.py).
        live = [
            (k, r) for k, r in zip(keys, refs, strict=True) if r is not None and not pausing.is_paused_ref(r)
        ]
        if not live:
            return len(gone)
        # Where each envelope is stored now (compaction may have re-homed it).
        moved = await self._redis.hmget(self._keys.moved, [ref.split()[0] for _, ref in live])
        pipe = self._redis.pipeline(transaction=False)
        for (_, ref), at in zip(live, moved, strict=True):
            stream_id = ref.split()[0] if at is None else _s(at)
            pipe.xrange(self._keys.stream, stream_id, stream_id)
        rows_of = await pipe.execute()
        now = self._shard_now()
        args: list[Any] = [self._keys.buckets, self._keys.wake, 0]
        ending: dict[str, str] = {}  # key -> its topic ('' unknown), for markers
        for (key, ref), rows in zip(live, rows_of, strict=True):
            topic = ""
            try:
                due = int(ref.split()[1])
                if not rows:
                    raise EnvelopeDecodeError(f"envelope {ref.split()[0]} is gone")
                raw = dict(rows[0][1] or {}).get(b"data")
                if not isinstance(raw, bytes):
                    raise EnvelopeDecodeError(f"envelope {ref.split()[0]} has no data")
                env = decode_envelope(raw)
                topic = env.topic
                nxt, iso = self._next_after(env, max(due, now))
            except Exception as exc:
                # EnvelopeDecodeError, ValueError (no later time), or whatever else the
                # recurrence raises: one schedule the engine cannot advance must not
                # stop firing for the whole app. It is withdrawn, with its history
                # record, by REFILL's compare-and-set on the ref read above (not by
                # cancel(key): a replace that landed since then must stand).
                log.error(
                    "recurring %r on %s cannot be refilled: %r; cancelling it", key, self._keys.stream, exc
                )
                nxt, iso = "end", f"unschedulable: {exc}"
                ending[key] = topic
            args += [key, ref, nxt, iso]
            args[2] += 1
        if not args[2]:
            return len(gone)
        args += [self._history_len(), now]
        results = [int(r) for r in await self._refill(keys=self._keys.script_keys, args=args)]
        keys_sent = args[3::4][: args[2]]
        ended = [(k, ending[k]) for k, r in zip(keys_sent, results, strict=True) if r == 2 and ending.get(k)]
        if ended:
            await self._markers("Remove", ended)
        return len(gone) + sum(1 for r in results if r != 0)

    async def _trim_history(self) -> None:
        """Age-based history retention (the length bound rides on every XADD).

        Also with the history off (historyMaxLen 0): records written before it
        was turned off still age out.
        """
        max_age = self._config.history_max_age_ms
        # Record ids come from Redis's clock: the shard's time, not this replica's.
        now = self._shard_now()
        await self._index_sweep.step(self._redis, now)
        if not max_age or now - self._last_history_trim < 60_000:
            return
        self._last_history_trim = now
        await self._redis.xtrim(self._keys.history, minid=f"{now - max_age}-0", approximate=True)

    async def run(self, stop: asyncio.Event | None = None, beat: Callable[[], None] | None = None) -> None:
        """Fire due messages until `stop` is set; survives Redis outages.

        `beat` is called before each pass (liveness.Supervised.beat: a loop
        that stops beating shows as stalled). A cancellation request left on
        the task is not read as a stop: stopping is the stop flag's business
        (see liveness.py). Without `stop`, the loop runs supervised until this
        task is cancelled.
        """
        if stop is None:
            body = functools.partial(self.run, beat=beat)
            await run_until_cancelled([Supervised(f"fire loop of {self._keys.stream}", body)])
            return
        listener = Supervised(
            f"wake listener of {self._keys.stream}", self._listen_wake, on_state=self._on_listener_state
        )
        self.listener = listener
        listener.start()
        backoff = Backoff(base_s=self._config.retry_min_s, cap_s=self._config.retry_max_s)
        try:
            while not stop.is_set():
                if beat is not None:
                    beat()
                try:
                    # Cleared before looking, not before sleeping: a wake-up that
                    # arrives while this batch runs (the listener's first one
                    # after subscribing, a schedule) must cut the next sleep short.
                    self._wake.clear()
                    # asyncio.timeout, not wait_for: wait_for can swallow a
                    # cancellation that races with completion (Python < 3.12).
                    async with asyncio.timeout(self._config.op_timeout_s):
                        # Refills a dead replica left are reported by FIRE as due
                        # and completed by fire_due, like this replica's own.
                        fired, head = await self.fire_due()
                        await self._trim_history()
                    backoff.reset()
                except (RedisError, TimeoutError) as exc:
                    delay = backoff.next()
                    log.warning(
                        "delay engine on %s: redis error %s; retrying in %.2fs", self._keys.stream, exc, delay
                    )
                    await self._sleep_or_stop(stop, delay)
                    continue
                except Exception:
                    # A bug here or in a hook must not end firing for the whole
                    # app (the task would just be gone): log it, back off, go on.
                    delay = backoff.next()
                    log.exception("delay engine on %s failed; retrying in %.2fs", self._keys.stream, delay)
                    await self._sleep_or_stop(stop, delay)
                    continue
                if stop.is_set():
                    break
                if fired or (head is not None and head <= self._clock.now_ms()):
                    continue  # more may be due right now: no sleep between batches
                await self._sleep_until(head, stop)
        finally:
            # Bounded: closing a pub/sub connection to a dead server may hang.
            await listener.stop(timeout_s=1.0)

    async def _sleep_or_stop(self, stop: asyncio.Event, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await stop.wait()

    async def _sleep_until(self, head: int | None, stop: asyncio.Event) -> None:
        timeout = self._config.max_sleep_s
        if head is not None:
            timeout = min(timeout, max(0.0, (head - self._clock.now_ms()) / 1000))
        waker = asyncio.ensure_future(self._wake.wait())
        sleeper = asyncio.ensure_future(self._clock.sleep(timeout))
        stopper = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({waker, sleeper, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (waker, sleeper, stopper):
                t.cancel()

    def wake(self) -> None:
        """Re-check the index now (used by this process after it schedules)."""
        self._wake.set()

    async def _listen_wake(self, stop: asyncio.Event) -> None:
        backoff = Backoff(base_s=self._config.retry_min_s, cap_s=self._config.retry_max_s)
        while not stop.is_set():
            pubsub = self._listen_redis.pubsub(ignore_subscribe_messages=True)
            try:
                # A Redis Cluster client maps the slots on its first command; its
                # pub/sub cannot find the channel's node before that (KeyError).
                await self._listen_redis.ping()
                await pubsub.subscribe(self._keys.wake)
                # A message may have been missed while (re)subscribing.
                self._wake.set()
                backoff.reset()
                while not stop.is_set():
                    # get_message with a timeout, not listen(): an idle channel
                    # must not look like a dead socket to the read timeout.
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if msg is not None:
                        self._wake.set()
            except RedisError as exc:
                log.debug("wake listener on %s: %s", self._keys.wake, exc)
                await self._sleep_or_stop(stop, backoff.next())
            except Exception:
                # Never die silently: a dead listener delays fires by up to max_sleep_s.
                log.warning("wake listener on %s failed; restarting it", self._keys.wake, exc_info=True)
                await self._sleep_or_stop(stop, backoff.next())
            finally:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(1.0):
                        await pubsub.aclose()  # type: ignore[no-untyped-call]


class ShardedEngine:
    """One app's delayed topic over several shard streams (keys.shard_topics), one DelayEngine each.

    On Redis Cluster each shard's keys share one hash slot and the shards
    spread over the masters; on a single node one shard is the plain engine.
    A publish with a scheduleId goes to the shard its id hashes to, so a
    replace or a cancel finds it; the rest go to one shard per call, in turn,
    so a bulk publish without ids is still one atomic SCHEDULE. Every replica
    fires every shard: the shards need no owner and replicas no coordination.
    """

    def __init__(self, engines: Sequence[DelayEngine]) -> None:
        if not engines:
            raise ValueError("a sharded engine needs at least one shard")
        self.engines = list(engines)
        self._turn = secrets.randbelow(len(self.engines))
        # The shard each recent call token's envelopes without a scheduleId
        # went to, so the caller's retry with that token lands there again
        # (its chunks are then recognised as stored); oldest forgotten first.
        self._spread: collections.OrderedDict[str, int] = collections.OrderedDict()
        # The supervised fire loop of each shard, once started.
        self.loops: list[Supervised] = []

    @property
    def keys(self) -> EngineKeys:
        """Shard 0's keys (`<consumerID>-delayed`, the single-node layout)."""
        return self.engines[0].keys

    def shard_of(self, schedule_id: str) -> DelayEngine:
        """The shard a scheduleId lives on."""
        return self.engines[shard_index(schedule_id, len(self.engines))]

    async def schedule(
        self, envelopes: Sequence[Envelope], *, token: str | None = None, timeout_s: float | None = None
    ) -> list[str]:
        """As DelayEngine.schedule; ids in the order given.

        Envelope stream ids are unique per shard stream only (each master
        makes its own), so with several shards an id that is not a scheduleId
        comes back as `<stream id>@<shard>`, which cancel understands.

        Retries: each shard's part carries the token `<token>:<shard>` (and
        DelayEngine adds `/<offset>` per chunk), and envelopes without a
        scheduleId go to the shard this engine picked for that token (one per
        call, in turn), so the same call repeated after a lost reply lands on
        the same shards and stores nothing twice.

        Partial failure: PartiallyStoredError(n) means the first n envelopes are
        stored. The shard without scheduleIds is stored last, so whatever is
        stored beyond n carries a scheduleId (a retry replaces it, never
        doubles it).
        """
        n = len(self.engines)
        if n == 1:
            return await self.engines[0].schedule(envelopes, token=token, timeout_s=timeout_s)
        spread = self._spread.get(token) if token else None
        if spread is None:
            self._turn = (self._turn + 1) % n
            spread = self._turn
            if token:
                self._spread[token] = spread
                if len(self._spread) > SPREAD_MEMORY:
                    self._spread.popitem(last=False)
        groups: dict[int, list[int]] = {}
        for i, e in enumerate(envelopes):
            shard = shard_index(e.schedule_id, n) if e.schedule_id else spread
            groups.setdefault(shard, []).append(i)
        order = sorted(groups, key=lambda sh: (sh == spread, sh))
        ids: list[str] = [""] * len(envelopes)
        stored: set[int] = set()
        for shard in order:
            positions = groups[shard]
            try:
                got = await self.engines[shard].schedule(
                    [envelopes[i] for i in positions],
                    token=f"{token}:{shard}" if token else None,
                    timeout_s=timeout_s,
                )
            except (PartiallyStoredError, RedisError, TimeoutError) as exc:
                done = exc.stored if isinstance(exc, PartiallyStoredError) else 0
                stored.update(positions[:done])
                prefix = next((i for i in range(len(envelopes)) if i not in stored), len(envelopes))
                if not stored:
                    raise
                cause = exc.__cause__ if isinstance(exc, PartiallyStoredError) else exc
                raise PartiallyStoredError(
                    prefix,
                    f"scheduling on {self.keys.stream!r} (shard {shard}): {len(stored)} of "
                    f"{len(envelopes)} stored, then redis: {cause or 'timed out'}",
                ) from cause
            stored.update(positions)
            for i, id in zip(positions, got, strict=False):
                ids[i] = id if envelopes[i].schedule_id else f"{id}@{shard}"
        return ids

    async def _locate(self, id: str) -> tuple[int, str]:
        """(shard, id on that shard) for a scheduleId or an envelope id (see cancel)."""
        m = _SHARD_ID.fullmatch(id)
        if m and int(m.group(2)) < len(self.engines):
            return int(m.group(2)), m.group(1)
        home = shard_index(id, len(self.engines))
        if len(self.engines) == 1 or not _STREAM_ID.fullmatch(id) or await self.engines[home].has_key(id):
            return home, id
        # Stream ids are per shard stream, so two shards may both hold one (two
        # publishes in the same millisecond). A recurring schedule without a
        # scheduleId is keyed by its stream id in its shard's ids hash, and its
        # messages carry that bare id as `scheduler`: the shard that has the
        # key is the one meant.
        keyed = [i for i, e in enumerate(self.engines) if i != home and await e.has_key(id)]
        if len(keyed) == 1:
            return keyed[0], id
        holders = [i for i, e in enumerate(self.engines) if await e.holds(id)]
        if len(holders) > 1:
            raise InvalidArgumentError(
                "id", id, f"on {len(holders)} shards; name one as {id}@<shard> (see keys.shard_topics)"
            )
        return (holders[0] if holders else home), id

    async def cancel(self, id: str, *, reason: str = "Remove") -> bool:
        """As DelayEngine.cancel: a scheduleId on its shard; an envelope id
        (`<stream id>@<shard>`, or a bare stream id held by one shard only) on its shard.

        InvalidArgumentError when a bare stream id names envelopes on several shards.
        """
        [(found, _)] = await self.cancel_many([id], reason=reason)
        return found

    async def cancel_many(self, ids: Sequence[str], *, reason: str = "Remove") -> list[tuple[bool, str]]:
        """As DelayEngine.cancel_many (markers included), each id on its shard (see cancel)."""
        if len(self.engines) == 1:
            return await self.engines[0].cancel_many(ids, reason=reason)
        groups: dict[int, list[tuple[int, str]]] = {}
        for pos, id in enumerate(ids):
            shard, local = await self._locate(id)
            groups.setdefault(shard, []).append((pos, local))
        out: list[tuple[bool, str]] = [(False, "")] * len(ids)
        for shard, items in groups.items():
            got = await self.engines[shard].cancel_many([local for _, local in items], reason=reason)
            for (pos, _), result in zip(items, got, strict=True):
                out[pos] = result
        return out

    async def set_paused(self, id: str, *, pause: bool, reason: str = "") -> pausing.PauseResult:
        """As DelayEngine.set_paused, on the shard that holds `id` (see cancel)."""
        shard, local = await self._locate(id)
        return await self.engines[shard].set_paused(local, pause=pause, reason=reason)

    async def cancel_prefix(self, prefix: str, *, reason: str = "Remove") -> int:
        """As DelayEngine.cancel_prefix, over every shard; the total cancelled."""
        return sum([await e.cancel_prefix(prefix, reason=reason) for e in self.engines])

    async def pending(self) -> int:
        """Messages waiting over every shard."""
        return sum([await e.pending() for e in self.engines])

    async def fire_due(self) -> tuple[int, int | None]:
        """One fire_due on every shard: (fired in all, earliest due time left)."""
        fired, head = 0, None
        for e in self.engines:
            n, h = await e.fire_due()
            fired += n
            if h is not None and (head is None or h < head):
                head = h
        return fired, head

    def start(
        self,
        on_state: Callable[[int, bool, BaseException | None], None] | None = None,
        stall_after_s: float | None = None,
    ) -> list[Supervised]:
        """Start one supervised fire loop per shard (liveness.Supervised); returns them, by shard.

        Each shard's loop is restarted with backoff on its own if it ends for
        any reason but close(): one shard's failure never stops the others.
        `on_state(shard, up, error)` hears each loop start and end; a loop
        without a pass for `stall_after_s` shows as `stalled`.
        """
        if not self.loops:
            for n, e in enumerate(self.engines):
                hook = None if on_state is None else functools.partial(on_state, n)
                loop = Supervised(
                    f"fire loop of {e.keys.stream}",
                    functools.partial(self._run_shard, n),
                    backoff=Backoff(base_s=0.1, cap_s=5.0),
                    on_state=hook,
                    stall_after_s=stall_after_s,
                )
                self.loops.append(loop)
            for loop in self.loops:
                loop.start()
        return self.loops

    async def _run_shard(self, n: int, stop: asyncio.Event) -> None:
        await self.engines[n].run(stop, beat=self.loops[n].beat)

    async def close(self, timeout_s: float = 5.0) -> None:
        """Stop every shard's fire loop (nothing pending is lost: it waits in Redis)."""
        loops, self.loops = self.loops, []
        await asyncio.gather(*(loop.stop(timeout_s) for loop in loops))

    async def run(self) -> None:
        """Fire every shard until cancelled: start(), then close() when cancelled."""
        self.start()
        try:
            await run_until_cancelled([])
        finally:
            await self.close()

    def wake(self) -> None:
        """Re-check every shard's index now."""
        for e in self.engines:
            e.wake()


_STREAM_ID = re.compile(r"\d+-\d+")
_SHARD_ID = re.compile(r"(\d+-\d+)@(\d+)")


@dataclass(frozen=True)
class _Claim:
    """One envelope CLAIM handed out (see lua/claim.lua's reply)."""

    id: str
    due: str
    scheduler: str
    schedule_next: str
    target: str  # the key APPEND writes: the topic, or the outbox
    target_pubsub: str
    topic: str
    bulk: bool
    expires_at: int
    source: str
    # The caller's trim applies (published through this component, or '' = any: FIRE's rule).
    trim: bool
    entries: list[list[str | bytes]]  # XADD field/value lists
    # Why it cannot be appended (RELEASE parks it with this reason), or '': a
    # hand-written envelope whose topic or scheduleId is not UTF-8 text.
    bad: str = ""

    def fields(
        self, data: str | bytes, metadata: str | bytes, content_type: str | bytes
    ) -> list[str | bytes]:
        """One entry's XADD fields, as FIRE writes them."""
        out: list[str | bytes] = ["data", data, "metadata", metadata]
        if content_type:
            out += ["contentType", content_type]
        if self.expires_at > 0:
            out += ["expiresAt", str(self.expires_at)]
        if self.target_pubsub:
            out += ["pubsub", self.target_pubsub, "topic", self.topic, "id", self.scheduler]
            if self.bulk:
                out += ["bulk", self.scheduler]
        return out


# Redis's default stream-node-max-entries and stream-node-max-bytes.
_NODE_ENTRIES, _NODE_BYTES = 100, 4096


def _full_node(first: Any) -> float:
    """Entries a full stream node holds, estimated from one entry's size (an
    envelope's fields; a listpack entry adds a few bytes per field)."""
    if not first or not first[1]:
        return float(_NODE_ENTRIES)
    size = sum(len(k) + len(v) + 4 for k, v in first[1].items())
    return float(max(1, min(_NODE_ENTRIES, _NODE_BYTES // max(1, size))))


def _parse_claims(raw: Sequence[Any]) -> list[_Claim]:
    n, pos, out = int(raw[0]), 1, []
    for _ in range(n):
        head = raw[pos : pos + 12]
        pos += 12
        count = int(head[11])
        try:
            c = _Claim(
                id=_s(head[0]),
                due=_s(head[1]),
                scheduler=_s(head[2]),
                schedule_next=_s(head[3]),
                target=_s(head[4]),
                target_pubsub=_s(head[5]),
                topic=_s(head[6]),
                bulk=_s(head[7]) == "1",
                expires_at=int(head[8]),
                source=_s(head[9]),
                trim=_s(head[10]) == "1",
                entries=[],
            )
        except UnicodeDecodeError as exc:
            # Raising here, after CLAIM committed, left the claim in flight to be
            # taken over (and raise) again at every lease end: the shard stopped firing.
            pos += 3 * count
            why = f"undecodable: not UTF-8: {exc}"
            out.append(_Claim(_s(head[0]), _s(head[1]), "", "", "", "", "", False, 0, "", False, [], why))
            continue
        for _ in range(count):
            data, md, ct = raw[pos], raw[pos + 1], raw[pos + 2]
            pos += 3
            c.entries.append(c.fields(data, md, ct))
        out.append(c)
    return out


def _strict_json(value: object) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (ValueError, TypeError, RecursionError):
        return False
    return True


def _s(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode()
    return "" if value is None else str(value)


def _topic(value: object) -> str:
    """A topic a script returned, for its marker; '' (no marker) when it is not UTF-8 text,
    as in a hand-written envelope: raising would come after the script's writes."""
    try:
        return _s(value)
    except UnicodeDecodeError:
        return ""
