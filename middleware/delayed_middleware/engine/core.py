"""The state one shard's engine keeps, and the helpers every concern shares.

Invariants: the engine holds nothing per message in memory. What it keeps is
per shard and bounded: its clients, keys, clock and settings; the skew the
last fire step measured between this replica's clock and the shard's Redis
TIME; compaction's counters; the time history was last trimmed. Every state
change of a message is one script call (engine.scripts), so a crash of this
process at any point leaves Redis consistent: see each concern's module for
its crash points.

Time: a decision (due? expired? lease ended?) is taken on the shard's Redis
TIME unless the injected clock is authoritative (tests move it). `_decide_at`
gives the argument the scripts take; `_measured` records the skew a fire
step saw, and `_shard_now` is this clock moved onto the shard's time.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Sequence

from redis.exceptions import ResponseError

from delayed_middleware import scripts as lua
from delayed_middleware.aio import text
from delayed_middleware.client import RedisClient
from delayed_middleware.clock import Clock
from delayed_middleware.engine.coalesce import ScheduleCoalescer
from delayed_middleware.engine.config import (
    DEFAULT_CONFIG,
    MARKER_REASON,
    EngineConfig,
    FireReport,
    Recurrence,
)
from delayed_middleware.engine.replies import Budget, ScheduleCall, ScheduleResult
from delayed_middleware.engine.scripts import EngineScripts
from delayed_middleware.entry import Trim
from delayed_middleware.envelope import Envelope
from delayed_middleware.history import IndexSweep
from delayed_middleware.instants import format_instant
from delayed_middleware.keys import EngineKeys
from delayed_middleware.liveness import StateHook, Supervised

log = logging.getLogger(__name__)


class EngineCore:
    """One shard's engine state; the concerns (schedule, cancel, fire, ...) are mixed in above it."""

    def __init__(
        self,
        client: RedisClient,
        keys: EngineKeys,
        clock: Clock,
        *,
        trim: Trim | None = None,
        config: EngineConfig = DEFAULT_CONFIG,
        on_batch: Callable[[FireReport], None] | None = None,
        recurrence: Recurrence | None = None,
        listen_client: RedisClient | None = None,
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
        self._scripts = EngineScripts(client, keys, two_phase=config.two_phase)
        self._coalescer = ScheduleCoalescer(
            self._send_schedule_calls,
            max_items=config.schedule_chunk,
            max_bytes=config.schedule_chunk_bytes,
            linger_s=config.schedule_linger_ms / 1000,
        )
        self._budget = Budget(
            config.batch_size, config.batch_entries, config.batch_bytes, config.fire_budget_us
        )
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
        self._index_sweep = IndexSweep(keys.history, keys.history_index)
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
        """This shard's keys."""
        return self._keys

    @property
    def config(self) -> EngineConfig:
        """The engine's settings."""
        return self._config

    def _history_len(self) -> int:
        return self._config.history_max_len

    async def _send_schedule_calls(
        self, calls: Sequence[ScheduleCall]
    ) -> list[ScheduleResult | ResponseError]:
        """One SCHEDULE script call for the coalesced calls (engine/coalesce.py)."""
        return await self._scripts.schedule_calls(
            calls,
            now=self._clock.now_ms(),
            history_len=self._history_len(),
            token_window_ms=self._config.token_window_ms,
        )

    async def has_key(self, key: str) -> bool:
        """True if `key` is a pending scheduleId (or recurring envelope id) here."""
        return bool(await self._redis.hexists(self._keys.ids, key))

    async def holds(self, stream_id: str) -> bool:
        """True if this delayed topic holds the envelope whose id is `stream_id` (wherever compaction put it)."""
        at = await self._redis.hget(self._keys.moved, stream_id)
        stored = stream_id if at is None else text(at)
        return bool(await self._redis.xrange(self._keys.stream, stored, stored))

    async def pending(self) -> int:
        """How many messages wait in the index of this delayed topic."""
        return int(await self._redis.get(self._keys.count) or 0)

    def _next_after(self, env: Envelope, after_ms: int) -> tuple[str, str]:
        """A recurring envelope's next due time after `after_ms`, as SCHEDULE and REFILL take it."""
        if self._recurrence is None:
            raise ValueError("a recurring envelope needs the engine's recurrence function")
        nxt = self._recurrence(env, after_ms)
        if nxt is None:
            return lua.PURGE, "-"
        if nxt <= after_ms:
            raise ValueError(f"recurrence gave {nxt}, not after {after_ms}")
        return str(nxt), format_instant(nxt)

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

    def _report(
        self, now: int, fired: int, first: str, pending: int, parked: int, entries: int, *, lost: int = 0
    ) -> None:
        """Log parked envelopes and hand one fire call's figures to the on_batch hook."""
        if parked:
            log.error(
                "%d envelope(s) on %s could not be delivered and were parked (listed in %s)",
                parked,
                self._keys.stream,
                self._keys.parked,
            )
        if self._on_batch is not None and (fired or parked or lost):
            # The batch's earliest due time is its latest message.
            late_ms = now - int(first) if first else 0
            self._on_batch(
                FireReport(
                    fired=fired,
                    max_lateness_ms=late_ms,
                    pending=pending,
                    parked=parked,
                    entries=entries,
                    lost=lost,
                )
            )

    def _log_gone(self, gone: int) -> None:
        log.error(
            "%d pending message(s) on %s were lost: their envelopes were deleted from the delayed "
            "topic by something other than the delay engine (XTRIM/XDEL, or a MAXLEN publish to it); "
            "their index entries are removed, each with a 'lost' history record naming its id",
            gone,
            self._keys.stream,
        )

    async def _at(self, point: str) -> None:
        if self._fault is not None:
            await self._fault(point)

    async def _markers(self, reason: str, cancelled: Sequence[tuple[str, str]]) -> None:
        """Marker messages (deleteMarkerTTL): one per topic whose message was removed.

        Best effort, after the change they report: a marker tells subscribers
        that something they might wait for will not come; losing one to a crash
        loses no data, so it is not worth holding the script across slots.
        """
        ttl = self._config.marker_ttl_ms
        cancelled = [(sid, topic) for sid, topic in cancelled if topic]  # '': not text (replies.topic)
        if not ttl or not cancelled:
            return
        expires = str(self._clock.now_ms() + ttl)
        pipe = self._redis.pipeline(transaction=False)
        for sid, topic in cancelled:
            metadata = json.dumps({MARKER_REASON: reason, lua.SCHEDULER: sid}, separators=(",", ":"))
            pipe.xadd(topic, {"data": b"", "metadata": metadata, "expiresAt": expires})
        for result in await pipe.execute(raise_on_error=False):
            if isinstance(result, Exception):
                log.warning("marker (%s) on %s not written: %s", reason, self._keys.stream, result)
