"""Cron in a time zone: wall-clock arithmetic with explicit daylight-saving rules.

A cron schedule with a time zone (``scheduleTimeZone``, or the ``CRON_TZ=<zone>``
prefix) matches wall-clock times in that zone. croniter walks naive wall-clock
times here, and each match is turned into an instant by ``wall_to_instant``:

- a wall-clock time that does not exist (skipped by a spring-forward, e.g.
  02:30 in New York on the second Sunday of March) fires once, at the first
  instant after the gap (03:00 local); several skipped matches (02:00, 02:15,
  02:30, ...) all land on that one instant and fire once;
- a wall-clock time that exists twice (repeated by a fall-back, e.g. 01:30 in
  New York on the first Sunday of November) fires once, at its first
  occurrence (01:30 daylight time); the repeat is not a second fire.

Zones are the ``tzdata`` package's (a dependency): its zone and link names
(``UTC``, ``Etc/GMT+5``, ``US/Eastern``, ...) and its rules, never the host's
/usr/share/zoneinfo, so every replica and the CLI read a name the same way
whatever host they run on. Names that stand for a host file or a variant of
the data (``localtime``, ``posixrules``, ``Factory``, ``posix/...``,
``right/...``) are refused. A schedule stored with such a name by an earlier
version keeps firing as it did (read from the host, with a warning).
All instants are Unix epoch milliseconds, as in schedules.py.
"""

from __future__ import annotations

import logging
import re
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from importlib import resources
from typing import Final
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterError, croniter

from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.instants import MAX_INSTANT_MS, MIN_INSTANT_MS
from delayed_middleware.publish_keys import SCHEDULE_TIME_ZONE

log = logging.getLogger(__name__)

_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_MS: Final = timedelta(milliseconds=1)
_EPOCH_NAIVE: Final = datetime(1970, 1, 1)
# An IANA name: letters, digits and - _ + / only (no '..', no absolute path:
# zoneinfo would read a file by that name).
_ZONE_NAME: Final = re.compile(r"[A-Za-z][A-Za-z0-9_+\-]*(?:/[A-Za-z0-9_+\-]+)*")
_MAX_ZONE_LENGTH: Final = 64
# A wall-clock walk never needs more steps than a repeated hour of a
# every-second cron (3,600); past this the schedule is treated as ending.
_MAX_STEPS: Final = 10_000


# tzdata lists this one among its zones, but it is a placeholder ("local time
# zone must be set"), not a place: a schedule in it would fire at UTC times.
_NOT_ZONES: Final = frozenset({"Factory"})


@lru_cache(maxsize=1)
def tzdata_names() -> frozenset[str]:
    """The zone and link names the component accepts: the tzdata package's, less ``Factory``."""
    listed = resources.files("tzdata").joinpath("zones").read_text(encoding="utf-8").split()
    return frozenset(listed) - _NOT_ZONES


def parse_time_zone(value: str, *, key: str = SCHEDULE_TIME_ZONE) -> ZoneInfo:
    """The zone a tzdata zone or link name (``America/New_York``, ``US/Eastern``, ``UTC``) names.

    Raises:
        InvalidArgumentError: naming ``key`` and the value, for an empty,
            malformed or unknown name, and for the names that read a host file
            or a variant of the data (``localtime``, ``posixrules``, ``Factory``,
            ``posix/...``, ``right/...``): replicas on different hosts would
            read them differently.
    """
    if not value:
        raise InvalidArgumentError(key, value, "empty: give an IANA time zone name, e.g. America/New_York")
    if len(value) > _MAX_ZONE_LENGTH or not _ZONE_NAME.fullmatch(value):
        raise InvalidArgumentError(key, value, "not an IANA time zone name (e.g. America/New_York, UTC)")
    if value not in tzdata_names():
        if value in ("localtime", "posixrules", *_NOT_ZONES) or value.startswith(("posix/", "right/")):
            raise InvalidArgumentError(
                key,
                value,
                "names a host file or a variant of the zone data, not a time zone: give an IANA name "
                "such as America/New_York or UTC",
            )
        raise InvalidArgumentError(
            key, value, "unknown time zone: give an IANA name such as America/New_York or Europe/London"
        )
    return _zone(value)


# Names of stored schedules read from the host, already warned about (once per process).
_warned: set[str] = set()


def stored_zone(name: str) -> ZoneInfo | None:
    """The zone of a name read back from a stored schedule, or None if no zone data has it.

    A tzdata name as parse_time_zone gives it; any other name that an earlier
    version accepted (``localtime``, ``right/...``) from this host's files,
    so such a schedule keeps firing as it did.
    """
    if len(name) > _MAX_ZONE_LENGTH or not _ZONE_NAME.fullmatch(name):
        return None
    try:
        return _zone(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        return None


@lru_cache(maxsize=1024)
def _zone(name: str) -> ZoneInfo:
    if name in tzdata_names():
        path = resources.files("tzdata.zoneinfo").joinpath(*name.split("/"))
        with path.open("rb") as data:
            return ZoneInfo.from_file(data, key=name)
    # Only a schedule stored before such names were refused gets here: it keeps
    # firing as it did (the host's file), and the operator is told once.
    zone_info = ZoneInfo(name)
    if name not in _warned:
        _warned.add(name)
        log.warning(
            "a stored schedule uses the time zone %r, which is not a tzdata zone name and is read from "
            "this host's zone files (other hosts may read it differently); publish it again with an IANA "
            "name such as America/New_York",
            name,
        )
    return zone_info


def zone(name: str) -> ZoneInfo:
    """The ZoneInfo of a stored zone name (cached): tzdata's, else the host's for an older stored name.

    Raises:
        ZoneInfoNotFoundError, ValueError, OSError: for a name neither knows.
    """
    return _zone(name)


def wall_to_instant(wall: datetime, tz: ZoneInfo) -> int:
    """The instant (epoch ms) a naive wall-clock time in ``tz`` fires at, by the DST rules above."""
    early = wall.replace(tzinfo=tz, fold=0)
    late = wall.replace(tzinfo=tz, fold=1)
    first = min(_ms(early), _ms(late))
    if _wall_of(first, tz) == wall:
        # It exists (once, or twice: then ``first`` is its first occurrence).
        return first
    # It does not exist: the gap lies between the two readings; fire at its end,
    # the first instant whose offset is the later one (transitions fall on
    # whole seconds, so a search over seconds finds it exactly).
    lo, hi = min(_ms(early), _ms(late)) // 1000, max(_ms(early), _ms(late)) // 1000
    before = _offset(lo * 1000, tz)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _offset(mid * 1000, tz) == before:
            lo = mid
        else:
            hi = mid
    return hi * 1000


def cron_next_in_zone(cron: str, tz: ZoneInfo, after_ms: int) -> int | None:
    """The first fire of a six-field numeric cron in ``tz`` strictly after ``after_ms``, or None.

    None when no fire is left before the end of year 9999 (or none is found
    within croniter's search window).
    """
    after_s = max(after_ms, MIN_INSTANT_MS) // 1000
    if after_s * 1000 >= MAX_INSTANT_MS:
        return None
    try:
        # The wall-clock time of the last instant already passed. In a repeated
        # hour's second pass this walks that hour's matches again, each mapping to
        # its (earlier) first occurrence and so skipped: the repeat never fires.
        # (East of UTC, the last seconds of year 9999 have no wall-clock time: OverflowError.)
        start = _wall_of(after_s * 1000, tz)
        walk = _walker(cron, start)
        for _ in range(_MAX_STEPS):
            wall = walk.get_next(datetime)
            due = wall_to_instant(wall, tz)
            if due > after_s * 1000 + 999:
                return due if due <= MAX_INSTANT_MS else None
    except (CroniterError, ValueError, OverflowError):
        # No date matches within croniter's window, or the walk ran past year 9999.
        return None
    return None


@lru_cache(maxsize=256)
def _parsed(cron: str) -> croniter:
    return croniter(cron, _EPOCH_NAIVE, second_at_beginning=True)


def _walker(cron: str, start: datetime) -> croniter:
    """A croniter over naive wall-clock times from ``start``: the parsed expression is reused (parsing
    costs ~0.25 ms, a step ~0.04 ms). Callers walk it to completion before anyone else asks,
    as everything here is synchronous."""
    walk = _parsed(cron)
    walk.set_current(start, force=True)
    return walk


def cron_instants(cron: str, tz: ZoneInfo | None, after_ms: int, count: int) -> list[int]:
    """Up to ``count`` successive fires strictly after ``after_ms`` (UTC when ``tz`` is None), in one walk."""
    after_s = max(after_ms, MIN_INSTANT_MS) // 1000
    out: list[int] = []
    try:
        start = _wall_of(after_s * 1000, tz) if tz is not None else _EPOCH_NAIVE + timedelta(seconds=after_s)
        walk = _walker(cron, start)
        for _ in range(count * 4 + _MAX_STEPS):
            if len(out) >= count:
                break
            wall = walk.get_next(datetime)
            due = wall_to_instant(wall, tz) if tz is not None else _ms(wall.replace(tzinfo=UTC))
            if due > max(after_s * 1000 + 999, out[-1] if out else 0) and due <= MAX_INSTANT_MS:
                out.append(due)
    except (CroniterError, ValueError, OverflowError):
        pass
    return out


def local_time(ms: int, tz: ZoneInfo) -> str:
    """An instant as RFC 3339 local time in ``tz`` with its offset, e.g. ``2026-03-08T03:00:00-04:00``."""
    moment = (_EPOCH + ms * _MS).astimezone(tz)
    return moment.isoformat(timespec="milliseconds" if ms % 1000 else "seconds")


def _ms(moment: datetime) -> int:
    return (moment - _EPOCH) // _MS


def _wall_of(ms: int, tz: ZoneInfo) -> datetime:
    return (_EPOCH + ms * _MS).astimezone(tz).replace(tzinfo=None, fold=0)


def _offset(ms: int, tz: ZoneInfo) -> timedelta | None:
    return (_EPOCH + ms * _MS).astimezone(tz).utcoffset()
