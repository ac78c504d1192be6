"""Time as an injected object, so tests can move it instead of sleeping."""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    """Wall-clock milliseconds and a sleep that respects them."""

    @property
    def authoritative(self) -> bool:
        """True when this clock is the time itself (an injected test clock):
        the delay engine decides what is due by it. False for a machine's own
        wall clock, which may run ahead of or behind other replicas': the
        engine then decides what is due, and measures lateness, by the Redis
        server's clock (TIME, per shard on Cluster), the one clock every
        replica shares, and uses this one only to time its sleeps."""
        ...

    def now_ms(self) -> int:
        """Current Unix time in milliseconds (UTC)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Sleep for `seconds` of this clock's time."""
        ...


class SystemClock:
    """The real clock: time.time() and asyncio.sleep()."""

    @property
    def authoritative(self) -> bool:
        # Each replica's system clock is its own: due decisions use Redis TIME.
        return False

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class ManualClock:
    """A clock that only moves when told to; sleepers wake when it passes their deadline."""

    @property
    def authoritative(self) -> bool:
        # Tests move time by hand: the engine must decide by this clock alone.
        return True

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self._now = start_ms
        self._changed = asyncio.Event()

    def now_ms(self) -> int:
        return self._now

    def advance(self, ms: int) -> None:
        self.set(self._now + ms)

    def set(self, now_ms: int) -> None:
        self._now = now_ms
        # Wake every sleeper so each re-checks its own deadline.
        self._changed.set()
        self._changed = asyncio.Event()

    async def sleep(self, seconds: float) -> None:
        deadline = self._now + int(seconds * 1000)
        while self._now < deadline:
            await self._changed.wait()
