"""Jitter never reorders or ends a schedule, in any tzdata zone, over the next ten years.

Pure functions only, so it stays fast: a cron's fires depend on its zone only through the zone's UTC
offsets, so each zone's daylight-saving transitions over the decade are found from its tzdata file
(the explicit transitions it lists, and its POSIX rule for the years after them), zones with the same
rules are walked once (every zone is checked to agree with the one walked for it), and each schedule
is walked through the hours (hourly) or days (daily) around every transition, with the largest jitter
the component accepts. ``@every`` has no zone: it is walked across the whole decade.
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Iterator
from datetime import datetime
from functools import cache
from importlib import resources

import pytest

from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.instants import format_instant, parse_instant
from delayed_middleware.schedules import Schedule, next_fire, parse_schedule, with_bounds
from delayed_middleware.zones import tzdata_names, zone

HOUR = 3_600_000
DAY = 24 * HOUR
FROM = parse_instant("2026-12-01T00:00:00Z")
TO = parse_instant("2036-12-01T00:00:00Z")
WEEK_S = 7 * 86_400


def _tzif(name: str) -> tuple[str, tuple[tuple[int, int], ...]]:
    """(POSIX rule footer, explicit (transition s, offset s after it)) of a tzdata zone's TZif file (v2+)."""
    data = resources.files("tzdata.zoneinfo").joinpath(*name.split("/")).read_bytes()
    isut, isstd, leap, timecnt, typecnt, charcnt = struct.unpack(">6l", data[20:44])
    at = 44 + timecnt * 5 + typecnt * 6 + charcnt + leap * 8 + isstd + isut
    isut, isstd, leap, timecnt, typecnt, charcnt = struct.unpack(">6l", data[at + 20 : at + 44])
    at += 44
    times = struct.unpack(f">{timecnt}q", data[at : at + 8 * timecnt])
    at += 8 * timecnt
    kinds = data[at : at + timecnt]
    at += timecnt
    offsets = [struct.unpack(">l", data[at + 6 * i : at + 6 * i + 4])[0] for i in range(typecnt)]
    at += 6 * typecnt + charcnt + leap * 12 + isstd + isut
    return data[at:].strip().decode(), tuple((t, offsets[k]) for t, k in zip(times, kinds, strict=True))


def _offset_s(name: str, seconds: int) -> int:
    offset = datetime.fromtimestamp(seconds, zone(name)).utcoffset()
    assert offset is not None
    return int(offset.total_seconds())


@cache
def _zone_groups() -> dict[tuple[str, tuple[tuple[int, int], ...], int], list[str]]:
    """Zones with the same rules over the decade (same POSIX rule, same explicit transitions in it)."""
    groups: dict[tuple[str, tuple[tuple[int, int], ...], int], list[str]] = {}
    for name in sorted(tzdata_names()):
        footer, explicit = _tzif(name)
        later = tuple(t for t in explicit if t[0] >= FROM // 1000 - 366 * 86_400)
        groups.setdefault((footer, later, _offset_s(name, FROM // 1000)), []).append(name)
    return groups


def _transitions(name: str) -> list[int]:
    """The zone's offset changes in [FROM, TO), as epoch seconds (the first second of the new offset).

    The explicit ones are read from the file; under a POSIX rule (two changes a year, months apart) a
    weekly look finds each change and a bisection its second.
    """
    found: list[int] = []
    lo_s, hi_s = FROM // 1000, TO // 1000
    before = _offset_s(name, lo_s)
    at = lo_s
    while at < hi_s:
        step = min(WEEK_S, hi_s - at)
        after = _offset_s(name, at + step)
        if after != before:
            a, b = at, at + step
            while b - a > 1:
                mid = (a + b) // 2
                if _offset_s(name, mid) == before:
                    a = mid
                else:
                    b = mid
            found.append(b)
            # Another change within the same week would be missed: start again from this one.
            at, before = b, _offset_s(name, b)
            continue
        at += step
    return found


def test_the_zone_walk_covers_every_tzdata_zone_and_its_transitions() -> None:
    groups = _zone_groups()
    assert sum(len(names) for names in groups.values()) == len(tzdata_names()) > 590
    for (_, explicit, _), names in groups.items():
        changes = _transitions(names[0])
        # Every explicit transition in the decade is one the walk finds.
        assert {t for t, _ in explicit if FROM // 1000 <= t < TO // 1000} <= set(changes), names[0]
        for other in names[1:]:
            for t in changes:
                assert _offset_s(other, t - 1) == _offset_s(names[0], t - 1), (other, t)
                assert _offset_s(other, t) == _offset_s(names[0], t), (other, t)
    # The calendar has transitions to walk: most of the world's DST rules, each about twice a year.
    assert sum(len(_transitions(names[0])) for names in groups.values()) > 400


def _largest_jitter(expr: str, tz: str, now_ms: int, gap: int) -> tuple[Schedule, int]:
    """The schedule with the largest jitter the component accepts for it (gap - 1 ms), and that jitter."""
    schedule = parse_schedule(expr, now_ms=now_ms, time_zone=tz or None)
    with pytest.raises(InvalidArgumentError):
        with_bounds(schedule, now_ms=now_ms, key="k", jitter=f"{gap}ms")
    return with_bounds(schedule, now_ms=now_ms, key="k", jitter=f"{gap - 1}ms"), gap - 1


def _walk(schedule: Schedule, start_ms: int, until_ms: int, key: str) -> Iterator[int]:
    """Successive fires from start_ms to until_ms, each asked for right after the previous one."""
    cursor = start_ms
    while cursor < until_ms:
        due = next_fire(schedule, start_ms=start_ms, after_ms=cursor, key=key)
        assert due is not None, f"{schedule.expr} withdrawn after {format_instant(cursor)} for {key}"
        assert due > cursor, f"{schedule.expr}: {format_instant(due)} is not after {format_instant(cursor)}"
        yield due
        cursor = due


def assert_one_fire_per_occurrence(fires: list[int], nominal: list[int], jitter: int, what: object) -> None:
    """Each fire lies in [its occurrence's nominal time, + jitter] and before the next occurrence's, and
    the fires take the occurrences one after another: none lost, doubled or swapped."""
    slots = [bisect.bisect_right(nominal, due) - 1 for due in fires]
    assert slots[0] >= 0, what
    assert slots == list(range(slots[0], slots[0] + len(fires))), (what, [format_instant(f) for f in fires])
    for due, slot in zip(fires, slots, strict=True):
        assert nominal[slot] <= due <= nominal[slot] + jitter, (what, format_instant(due))


# Hourly and daily, with wall times on the hour and on the half hour (inside a skipped or repeated hour
# somewhere in the world), each with the largest jitter accepted (just under the gap between fires).
CRONS = (
    ("@hourly", HOUR),
    ("0 30 * * * *", HOUR),
    ("0 45 * * * *", HOUR),
    ("@daily", DAY),
    ("0 30 2 * * *", DAY),
    ("0 0 1 * * *", DAY),
)


def test_jittered_hourly_and_daily_crons_advance_through_every_transition_of_every_zone() -> None:
    walked = 0
    for names in _zone_groups().values():
        name = names[0]
        for t in _transitions(name):
            t_ms = t * 1000
            for expr, gap in CRONS:
                around = 3 * gap if gap == HOUR else 2 * gap
                schedule, jitter = _largest_jitter(expr, name, t_ms - around, gap)
                key = f"{name}|{t}|{expr}"
                fires = list(_walk(schedule, t_ms - around, t_ms + around, key))
                plain = parse_schedule(expr, now_ms=t_ms, time_zone=name)
                nominal = list(_walk(plain, t_ms - around - jitter - 1, fires[-1] + 1, ""))
                assert_one_fire_per_occurrence(fires, nominal, jitter, (name, expr, format_instant(t_ms)))
                walked += 1
    assert walked > 2000


@pytest.mark.parametrize("interval", ["1h", "24h", "1s"])
def test_jittered_every_advances_for_ten_years(interval: str) -> None:
    start = FROM + 12_345
    interval_ms = parse_schedule(f"@every {interval}", now_ms=start).interval_ms or 0
    schedule, jitter = _largest_jitter(f"@every {interval}", "", start, interval_ms)
    until = min(TO, start + 100_000 * interval_ms)
    fires = list(_walk(schedule, start, until, f"every-{interval}"))
    nominal = list(range(start + interval_ms, fires[-1] + interval_ms, interval_ms))
    assert_one_fire_per_occurrence(fires, nominal, jitter, interval)
    assert len(fires) >= (until - start) // interval_ms - 1
