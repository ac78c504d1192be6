"""Wall-clock choices for tests that run a real component on the real clock.

Such a test cannot move time, so what it publishes must not meet a calendar boundary while it
runs: a daily cron at a fixed hour fires during the run once a day at that hour, and a cron in a
zone with daylight saving stops for an hour after a fall-back (the repeated wall-clock hour fires
nothing: docs/publish-metadata.md, daylight saving). These pick values away from both, from the
real clock of the moment the test asks.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo


def _now() -> datetime:
    return datetime.fromtimestamp(time.time(), UTC)


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


HOUR_MS = 3_600_000


@dataclass(frozen=True)
class Hourly:
    """An hourly cron whose minute is half an hour away from now, for tests that publish a schedule on
    the real clock and then work on its past occurrences. Its own next fire is half an hour off, so it
    cannot go out during the test (a `0 0 * * * *` one did, in a run that crossed the top of the hour)."""

    minute: int

    @classmethod
    def away_from_now(cls) -> Hourly:
        return cls((_now_ms() // 60_000 + 30) % 60)

    @property
    def cron(self) -> str:
        return f"0 {self.minute} * * * *"

    def last(self) -> int:
        """Its latest occurrence before now, in ms."""
        offset = self.minute * 60_000
        return (_now_ms() - offset) // HOUR_MS * HOUR_MS + offset

    def window(self, n: int) -> tuple[int, int, list[int]]:
        """[start, end) around its last `n` occurrences, and those occurrences (oldest first)."""
        end = self.last()
        return end - n * HOUR_MS, end, [end - k * HOUR_MS for k in range(n, 0, -1)]


def hour_away(zone: str = "UTC", hours: int = 12) -> int:
    """The hour of the day in `zone` that `hours` hours from now falls in: a daily cron at that
    hour (`0 0 H * * *`) is next due more than `hours - 2` hours ahead (the hour began less than
    one before that instant; a daylight-saving change in between moves it by one), not during a
    test."""
    return (_now() + timedelta(hours=hours)).astimezone(ZoneInfo(zone)).hour


def steady_zones(zones: Iterable[str], margin_h: int = 3) -> list[str]:
    """Those of `zones` whose offset from UTC is the same `margin_h` hours before and after now:
    none of them changes its clocks during a test, so a cron in each fires as on any other day."""
    now = _now()
    before, after = now - timedelta(hours=margin_h), now + timedelta(hours=margin_h)
    return [
        z
        for z in zones
        if before.astimezone(ZoneInfo(z)).utcoffset() == after.astimezone(ZoneInfo(z)).utcoffset()
    ]
