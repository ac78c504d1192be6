"""One shard's state, the one object every part of the engine receives, and the helpers they share.

Invariants: the engine holds nothing per message in memory. What it keeps is
per shard and bounded: its clients, keys, clock and settings; the skew the
last fire step measured between this replica's clock and the shard's Redis
TIME; the envelopes that left the stream since compaction last looked. What
one part keeps for itself (compaction's pass, the time history was last
trimmed, the wake listener) lives in that part. Every state change of a
message is one script call (engine.script_calls), so a crash of this process at
any point leaves Redis consistent: see each part's module for its crash points.

Time: a decision (due? expired? lease ended?) is taken on the shard's Redis
TIME unless the injected clock is authoritative (tests move it). `decide_at`
gives the argument the scripts take; `measured` records the skew a fire step
saw, and `shard_now` is this clock moved onto the shard's time.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from delayed_middleware import lua_scripts as lua
from delayed_middleware.client import RedisClient
from delayed_middleware.clock import Clock
from delayed_middleware.engine.config import MARKER_REASON, EngineConfig, FireReport, Recurrence
from delayed_middleware.engine.replies import Budget
from delayed_middleware.engine.script_calls import EngineScripts
from delayed_middleware.entry import Trim
from delayed_middleware.envelope import Envelope
from delayed_middleware.instants import format_instant
from delayed_middleware.keys import EngineKeys

log = logging.getLogger(__name__)


@dataclass(eq=False)
class ShardState:
    """What one shard's engine parts share: built once by engine.builder, passed to each part."""

    redis: RedisClient
    # The wake listener parks a connection for good: on a client of its own
    # it cannot starve short commands of a bounded pool (poolSize).
    listen_redis: RedisClient
    keys: EngineKeys
    clock: Clock
    config: EngineConfig
    scripts: EngineScripts
    budget: Budget
    trim: Trim = field(default_factory=Trim)
    # Hears a FireReport per fire call that fired or parked.
    on_batch: Callable[[FireReport], None] | None = None
    # The next fire time of a cron envelope (needed to schedule one).
    recurrence: Recurrence | None = None
    # `trim` applies to messages published through this component only
    # (others sharing the delayed topic have their own); '' = to all.
    pubsub_name: str = ""
    # Test hook: awaited at each step of the two-phase fire ("claimed",
    # "appended:<n>", "released"); raising there stops the fire like a crash.
    fault: Callable[[str], Awaitable[None]] | None = None
    # Set to cut the run loop's sleep short (a schedule here, a wake message, more to compact).
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    # How far this replica's clock runs ahead of the shard's Redis TIME, as
    # the last fire measured it (0 with an authoritative clock): the
    # successors computed here are on the shard's time, and the head the
    # fire step returns is moved into this clock's frame for the sleep.
    skew_ms: int = 0
    # Envelopes that left the stream since compaction last checked its density
    # (cancels and fires add to it; engine.compaction reads and resets it).
    left_since_check: int = 0

    @property
    def history_len(self) -> int:
        """The history's approximate length bound, as every script takes it."""
        return self.config.history_max_len

    def next_after(self, env: Envelope, after_ms: int) -> tuple[str, str]:
        """A recurring envelope's next due time after `after_ms`, as SCHEDULE, REFILL and PAUSE take it."""
        nxt = self.next_fire(env, after_ms)
        if nxt is None:
            return lua.PURGE, "-"
        if nxt <= after_ms:
            raise ValueError(f"recurrence gave {nxt}, not after {after_ms}")
        return str(nxt), format_instant(nxt)

    def next_fire(self, env: Envelope, after_ms: int) -> int | None:
        """A recurring envelope's first fire strictly after `after_ms` (None: none left)."""
        if self.recurrence is None:
            raise ValueError("a recurring envelope needs the engine's recurrence function")
        return self.recurrence(env, after_ms)

    def decide_at(self) -> tuple[int, int | str]:
        """This replica's clock now, and the FIRE/CLAIM/RELEASE `now` argument:
        that time from an authoritative (injected) clock, else '' for the
        shard's Redis TIME (see clock.Clock.authoritative)."""
        local = self.clock.now_ms()
        return local, (local if self.clock.authoritative else "")

    def measured(self, local: int, decided: int, head: str) -> int | None:
        """Records the skew a fire step measured; returns its head in this clock's frame."""
        self.skew_ms = local - decided
        at = float(head) if head else math.inf
        # An index entry written by hand at score 'inf' (or '-inf'): no time to wait for, or
        # due now. int() of it raised after every step's script: on Redis Cluster nothing fired.
        if not math.isfinite(at):
            return None if at > 0 else local
        return int(at) + self.skew_ms

    def trim_args(self, local: int) -> tuple[str, str]:
        """The trim FIRE and APPEND apply to target topics (maxLenApprox / streamTTL).

        streamTTL's MINID is compared with stream ids, which the target's Redis
        clock makes. Unless this clock is authoritative, the script takes the
        threshold from its own TIME (mode MINAGE, threshold = the age): a skew
        measured by an earlier fire step is unknown at the first one, and on
        Cluster the target's node is not the shard's."""
        mode, threshold = self.trim.args(local)
        if mode == "MINID" and not self.clock.authoritative:
            return "MINAGE", str(self.trim.max_age_ms)
        return mode, threshold

    def shard_now(self) -> int:
        """The shard's time as of the last fire step's measurement (successors are computed on it)."""
        return self.clock.now_ms() - self.skew_ms

    def report(
        self, now: int, fired: int, first: str, pending: int, parked: int, entries: int, *, lost: int = 0
    ) -> None:
        """Log parked envelopes and hand one fire call's figures to the on_batch hook."""
        if parked:
            log.error(
                "%d envelope(s) on %s could not be delivered and were parked (listed in %s)",
                parked,
                self.keys.stream,
                self.keys.parked,
            )
        if self.on_batch is not None and (fired or parked or lost):
            # The batch's earliest due time is its latest message.
            late_ms = now - int(first) if first else 0
            self.on_batch(
                FireReport(
                    fired=fired,
                    max_lateness_ms=late_ms,
                    pending=pending,
                    parked=parked,
                    entries=entries,
                    lost=lost,
                )
            )

    async def unfired(self, expired: Sequence[tuple[str, str]], gone: int) -> None:
        """What a fire batch (FIRE, or Cluster's CLAIM) took out of the index unfired: a MaxAge
        marker per topic for what expired, and a loud line for what was gone."""
        if expired:
            await self.markers("MaxAge", expired)
        if not gone:
            return
        log.error(
            "%d pending message(s) on %s were lost: their envelopes were deleted from the delayed "
            "topic by something other than the delay engine (XTRIM/XDEL, or a MAXLEN publish to it); "
            "their index entries are removed, each with a 'lost' history record naming its id",
            gone,
            self.keys.stream,
        )

    async def at(self, point: str) -> None:
        """The fault hook's crash point `point` (tests only)."""
        if self.fault is not None:
            await self.fault(point)

    async def markers(self, reason: str, cancelled: Sequence[tuple[str, str]]) -> None:
        """Marker messages (deleteMarkerTTL): one per topic whose message was removed.

        Best effort, after the change they report: a marker tells subscribers
        that something they might wait for will not come; losing one to a crash
        loses no data, so it is not worth holding the script across slots.
        """
        ttl = self.config.marker_ttl_ms
        cancelled = [(sid, topic) for sid, topic in cancelled if topic]  # '': not text (replies.topic)
        if not ttl or not cancelled:
            return
        expires = str(self.clock.now_ms() + ttl)
        pipe = self.redis.pipeline(transaction=False)
        for sid, topic in cancelled:
            metadata = json.dumps({MARKER_REASON: reason, lua.SCHEDULER: sid}, separators=(",", ":"))
            pipe.xadd(topic, {"data": b"", "metadata": metadata, "expiresAt": expires})
        for result in await pipe.execute(raise_on_error=False):
            if isinstance(result, Exception):
                log.warning("marker (%s) on %s not written: %s", reason, self.keys.stream, result)
