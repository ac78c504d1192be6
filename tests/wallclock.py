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
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo


def _now() -> datetime:
    return datetime.fromtimestamp(time.time(), UTC)


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
