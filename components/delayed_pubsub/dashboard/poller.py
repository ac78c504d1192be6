"""One poller per dashboard process: it reads Redis, every browser is served from its snapshot.

However many browsers are open, Redis sees one census (the scan
`delayed-pubsub pending` makes) per poll, and polls never follow each other
faster than `interval_s`, nor faster than the last poll took (a census of 1M
pending takes seconds: the dashboard then spends at most half its time
scanning). Nobody watching (no live page open, no page served for a while):
no polls at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from delayed_middleware.history import FIRED, HistoryRecord
from delayed_pubsub.connection import REDIS_ERRORS
from delayed_pubsub.dashboard.source import Census, Source

log = logging.getLogger(__name__)

# Lateness histogram buckets: upper bound in ms (None: open), label.
LATENESS_BUCKETS: tuple[tuple[int | None, str], ...] = (
    (10, "≤ 10 ms"),
    (100, "≤ 100 ms"),
    (1_000, "≤ 1 s"),
    (10_000, "≤ 10 s"),
    (60_000, "≤ 1 min"),
    (None, "> 1 min"),
)
# Fires per minute are shown for this many whole minutes back.
FIRE_MINUTES = 10
# A page view keeps the poller going this many intervals without a live page open.
IDLE_INTERVALS = 3
# While Redis fails, polls back off (doubling from the interval) up to this: a dashboard notices
# Redis's return within seconds, and a failing poll costs next to nothing.
MAX_BACKOFF_S = 10.0


@dataclass(frozen=True)
class Lateness:
    """Lateness of the fires among the newest history records (ms)."""

    count: int
    p50: int | None
    p99: int | None
    max: int | None
    buckets: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Snapshot:
    """What the dashboard shows at one poll."""

    version: int
    at_ms: int
    census: Census
    fires_per_minute: tuple[tuple[int, int], ...]
    lateness: Lateness
    history_records: int
    dead_letters: int
    dead_by_topic: Mapping[str, int]
    poll_ms: float
    error: str = ""
    # Fragments of the live pages, rendered once per poll (not per browser): id -> HTML.
    parts: Mapping[str, str] = field(default_factory=dict)


def percentile(sorted_values: Sequence[int], q: float) -> int | None:
    """Nearest-rank percentile of ascending values (None when empty)."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


def lateness_of(records: Sequence[HistoryRecord]) -> Lateness:
    late = sorted(max(0, r.lateness_ms) for r in records if r.event == FIRED and r.lateness_ms is not None)
    counts: Counter[str] = Counter()
    for ms in late:
        for bound, label in LATENESS_BUCKETS:
            if bound is None or ms <= bound:
                counts[label] += 1
                break
    return Lateness(
        count=len(late),
        p50=percentile(late, 0.50),
        p99=percentile(late, 0.99),
        max=late[-1] if late else None,
        buckets=tuple((label, counts.get(label, 0)) for _, label in LATENESS_BUCKETS),
    )


def fires_per_minute(records: Sequence[HistoryRecord], now_ms: int) -> tuple[tuple[int, int], ...]:
    """(minute start ms, fires) for the last FIRE_MINUTES whole minutes and the current one."""
    current = now_ms - now_ms % 60_000
    minutes = [current - 60_000 * n for n in range(FIRE_MINUTES, -1, -1)]
    counts: Counter[int] = Counter()
    for r in records:
        if r.event == FIRED:
            counts[r.at_ms - r.at_ms % 60_000] += 1
    return tuple((m, counts.get(m, 0)) for m in minutes)


class Poller:
    """Keeps one Snapshot fresh while anyone looks; browsers wait on `updates()`."""

    def __init__(
        self,
        source: Source,
        *,
        interval_s: float,
        history_records: int,
        render: Callable[[Snapshot], Mapping[str, str]],
    ) -> None:
        self._source = source
        self.interval_s = interval_s
        self._history_records = history_records
        self._render = render
        self.snapshot: Snapshot | None = None
        # Polls made (each one census): /healthz shows it, the tests count it.
        self.polls = 0
        self.watchers = 0
        self._changed = asyncio.Condition()
        self._demand = asyncio.Event()
        self._last_view = 0.0
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="dashboard-poller")

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def touch(self) -> None:
        """A page was served: keep polling for a while."""
        self._last_view = time.monotonic()
        self._demand.set()

    async def latest(self) -> Snapshot:
        """The current snapshot, waiting for the first poll if none was made yet."""
        self.touch()
        async with self._changed:
            await self._changed.wait_for(lambda: self.snapshot is not None)
        assert self.snapshot is not None
        return self.snapshot

    async def updates(self) -> AsyncIterator[Snapshot]:
        """The current snapshot, then each new one, for as long as the caller iterates."""
        self.watchers += 1
        self._demand.set()
        try:
            seen = -1
            while True:
                async with self._changed:
                    await self._changed.wait_for(functools.partial(self._newer_than, seen))
                    snap = self.snapshot
                assert snap is not None
                seen = snap.version
                yield snap
        finally:
            self.watchers -= 1

    def _newer_than(self, version: int) -> bool:
        return self.snapshot is not None and self.snapshot.version != version

    def _wanted(self) -> bool:
        return self.watchers > 0 or time.monotonic() - self._last_view < self.interval_s * IDLE_INTERVALS

    async def _run(self) -> None:
        backoff = self.interval_s
        while not self._stopping:
            if not self._wanted():
                self._demand.clear()
                await self._demand.wait()
                continue
            started = time.monotonic()
            try:
                snap = await self._poll()
                backoff = self.interval_s
            except asyncio.CancelledError:
                raise
            except REDIS_ERRORS as e:
                log.error("dashboard poll failed: %s", e)
                snap = self._failed(f"Redis: {e}")
                backoff = min(backoff * 2, max(MAX_BACKOFF_S, self.interval_s))
            except Exception as e:
                # A bug must not end the poller (the pages would freeze): shown, logged, retried.
                log.exception("dashboard poll failed")
                snap = self._failed(f"{type(e).__name__}: {e}")
                backoff = min(backoff * 2, max(MAX_BACKOFF_S, self.interval_s))
            async with self._changed:
                self.snapshot = snap
                self._changed.notify_all()
            took = time.monotonic() - started
            await asyncio.sleep(max(backoff if snap.error else self.interval_s, took))

    def _failed(self, error: str) -> Snapshot:
        """The snapshot a failed poll leaves: the last good one (or an empty one, when none
        succeeded yet) marked with `error`. It never raises: the poller must outlive it, and
        a page waiting for the first snapshot must get one."""
        previous = self.snapshot
        if previous is None:
            empty = Census(0, {}, {}, {}, (), 0, 0, 0)
            now_ms = int(time.time() * 1000)
            base = Snapshot(0, 0, empty, fires_per_minute((), now_ms), lateness_of(()), 0, 0, {}, 0.0)
        else:
            base = previous
        snap = dataclasses.replace(base, version=base.version + 1, error=error)
        try:
            parts = self._render(snap)
        except Exception:
            log.exception("dashboard: the failed poll's page did not render")
            parts = {}
        return dataclasses.replace(snap, parts=parts)

    async def _poll(self) -> Snapshot:
        started = time.perf_counter()
        now = await self._source.now_ms()
        census = await self._source.census(now)
        records = await self._source.newest_history(self._history_records)
        dead = await self._source.dead_letters()
        self.polls += 1
        snap = Snapshot(
            version=(self.snapshot.version + 1) if self.snapshot else 1,
            at_ms=now,
            census=census,
            fires_per_minute=fires_per_minute(records, now),
            lateness=lateness_of(records),
            history_records=len(records),
            dead_letters=len(dead),
            dead_by_topic=dict(Counter(d.source_topic for d in dead)),
            poll_ms=(time.perf_counter() - started) * 1000,
        )
        return dataclasses.replace(snap, parts=self._render(snap))
