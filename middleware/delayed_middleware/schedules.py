"""Schedules as publishers write them (``schedule`` metadata), and the one pure "next fire after t".

The grammar is the NATS message scheduler's (ADR-51), in UTC unless a cron or
predefined schedule names a time zone (``scheduleTimeZone`` or a ``CRON_TZ=``
prefix; zones.py has the wall-clock and daylight-saving rules). A recurring
schedule may also carry bounds and jitter (``with_bounds``: ``scheduleStart``,
``scheduleEnd``, ``scheduleLimit``, ``scheduleJitter``); they are kept in the
envelope's stored expression as ``; name=value`` options
(``parse_stored_schedule``), so the next fire stays a pure function of the
envelope and every replica computes the same one:

- ``@at <RFC3339>``: one-shot, the same instant ``scheduledSendTime`` takes; a
  past instant fires at once.
- ``@every <Go duration>``: a fixed interval counted from the moment the
  schedule was accepted (``start_ms``): fires at ``start + k * interval`` for
  k = 1, 2, ..., so no drift accumulates however late single fires are. At
  least one second, as in NATS: a faster "schedule" is a flood, not a schedule.
- ``@yearly`` / ``@annually``, ``@monthly``, ``@weekly``, ``@daily`` /
  ``@midnight``, ``@hourly``: the usual cron shorthands (at second 0).
- six-field cron, seconds first: ``sec min hour day-of-month month day-of-week``
  with ``*``, ``?`` (day fields only, = ``*``), values, ranges ``a-b``, lists
  ``a,b``, steps ``*/n``, ``a-b/n`` and ``a/n`` (= ``a-<last>/n``), month and
  weekday names (``jan``, ``mon``; any case), Sunday as 0 or 7. When both day
  fields are restricted, either matching fires (crontab(5)); a day field written
  ``*``, ``?`` or ``*/1`` is unrestricted, anything else (``*/2``, ``0-6``) is
  restricted, as in NATS (robfig/cron) and vixie cron. (croniter alone decides
  by the values instead, so the normalised form folds "restricted, but every
  day" into ``* *``; a brute-force oracle test holds the two to the same answers.)

We check the grammar ourselves, strictly (the robfig/NATS rules: exactly six
fields, no backwards ranges, no ``L``/``W``/``#``/``H`` extensions), then hand a
normalised, numbers-only expression to croniter for the calendar arithmetic:
croniter alone is more lenient (it takes 5 or 7 fields, wraps ``fri-mon``, and
has Quartz extensions NATS refuses), and a schedule accepted here must mean the
same to anyone who reads it.

All instants are Unix epoch milliseconds. Nothing here reads a clock: callers
pass ``now_ms`` from the injected Clock, so tests move time instead of sleeping.
"""

from __future__ import annotations

import hashlib
import itertools
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from typing import Final, Literal

from croniter import CroniterError, croniter

from delayed_middleware import publish_values as values
from delayed_middleware.durations import format_go_duration, parse_go_duration
from delayed_middleware.envelope import Envelope
from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.instants import MAX_INSTANT_MS, MIN_INSTANT_MS, format_instant, parse_instant
from delayed_middleware.publish_keys import (
    SCHEDULE,
    SCHEDULE_END,
    SCHEDULE_JITTER,
    SCHEDULE_LIMIT,
    SCHEDULE_START,
    SCHEDULE_TIME_ZONE,
)
from delayed_middleware.zones import (
    cron_instants,
    cron_next_in_zone,
    parse_time_zone,
    stored_zone,
    zone,
)

SCHEDULE_KEY: Final = SCHEDULE
# Dapr Jobs' (and robfig/cron's) form of a zone on the expression itself.
CRON_TZ_PREFIX: Final = "CRON_TZ="
# scheduleLimit's range: an @every schedule's last occurrence is one
# multiplication away; a cron's is found by stepping through its occurrences
# once when it is accepted (~40 us a step), so it is held to fewer.
MAX_LIMIT_EVERY: Final = 1_000_000
MAX_LIMIT_CRON: Final = 10_000
# A cron's jitter must be less than the shortest wall-clock gap between two of
# its occurrences, measured over this many from its start.
JITTER_GAP_SAMPLE: Final = 64

# NATS's floor for @every (and robfig/cron's): one fire per second at most.
MIN_EVERY_MS: Final = 1000
# Long enough for any honest cron (six fields of 60-value lists is ~1 KB),
# short enough that no input makes parsing costly.
MAX_SCHEDULE_LENGTH: Final = 1024

# The value of ``scheduleNext`` on the message of a one-shot: nothing follows
# (the NATS header's value for delayed messages).
PURGE: Final = "purge"

ScheduleKind = Literal["at", "every", "cron"]

_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_MS: Final = timedelta(milliseconds=1)

_PREDEFINED: Final[Mapping[str, str]] = {
    "@yearly": "0 0 0 1 1 *",
    "@annually": "0 0 0 1 1 *",
    "@monthly": "0 0 0 1 * *",
    "@weekly": "0 0 0 * * 0",
    "@daily": "0 0 0 * * *",
    "@midnight": "0 0 0 * * *",
    "@hourly": "0 0 * * * *",
}

_MONTHS: Final[Mapping[str, int]] = {
    name: number
    for number, name in enumerate(
        ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"), start=1
    )
}
_WEEKDAYS: Final[Mapping[str, int]] = {
    name: number for number, name in enumerate(("sun", "mon", "tue", "wed", "thu", "fri", "sat"))
}


@dataclass(frozen=True)
class _Field:
    name: str
    low: int
    high: int
    # Where "a/n" (no end) stops: the field's last value, except for
    # day-of-week, whose 7 is only an alias of Sunday (0), so "1/2" is Mon, Wed, Fri.
    open_high: int
    names: Mapping[str, int]
    # '?' (robfig/NATS: "no specific value") is allowed in the day fields only.
    question: bool = False


_FIELDS: Final[tuple[_Field, ...]] = (
    _Field("second", 0, 59, 59, {}),
    _Field("minute", 0, 59, 59, {}),
    _Field("hour", 0, 23, 23, {}),
    _Field("day-of-month", 1, 31, 31, {}, question=True),
    _Field("month", 1, 12, 12, _MONTHS),
    _Field("day-of-week", 0, 7, 6, _WEEKDAYS, question=True),
)

# One list item: '*' or '?' or a value or a range, then an optional step.
# Values are ASCII digits or letters (names); their meaning is checked after.
_ITEM: Final = re.compile(
    r"(?:(?P<star>[*?])|(?P<start>[0-9]+|[a-z]+)(?:-(?P<end>[0-9]+|[a-z]+))?)(?:/(?P<step>[0-9]+))?"
)
# More digits than any field value or step could need; checked before int()
# so a 5000-digit "value" costs nothing.
_MAX_DIGITS: Final = 3

_FORMS: Final = (
    "@at <RFC3339>, @every <Go duration>, @yearly, @annually, @monthly, @weekly, @daily, @midnight, "
    "@hourly, or 6-field cron 'sec min hour day-of-month month day-of-week' (e.g. '0 */5 * * * *')"
)


@dataclass(frozen=True)
class Schedule:
    """A parsed ``schedule`` value.

    Attributes:
        kind: ``at`` (one-shot), ``every`` (fixed interval) or ``cron``
            (calendar: six-field cron and the ``@daily``-style shorthands).
        expr: the normalised expression, which parses back to an equal
            Schedule: store this, not the publisher's spelling (``@every 90s``
            becomes ``@every 1m30s``; cron names become numbers).
        at_ms: for ``at``, the instant (epoch ms) it names, possibly past.
        interval_ms: for ``every``, the interval in ms (>= MIN_EVERY_MS).
        cron: for ``cron``, the six-field numeric expression croniter is given
            (a shorthand's equivalent, e.g. ``0 0 0 * * *`` for ``@daily``).
    """

    kind: ScheduleKind
    expr: str
    at_ms: int | None = None
    interval_ms: int | None = None
    cron: str | None = None
    # The IANA zone a cron's wall-clock times are in ('' = UTC).
    tz: str = ""
    # Bounds and jitter (with_bounds); None / 0 = none. ``last_ms`` is the
    # nominal time of the scheduleLimit-th occurrence, fixed when accepted.
    start_ms: int | None = None
    end_ms: int | None = None
    limit: int | None = None
    last_ms: int | None = None
    jitter_ms: int = 0
    # What the jitter offsets hash when the schedule has no scheduleId.
    seed: str = ""

    @property
    def recurring(self) -> bool:
        """True for ``every`` and ``cron``: the schedule stays after a fire."""
        return self.kind != "at"

    @property
    def plain(self) -> bool:
        """No zone, bounds or jitter: an ``@every`` the fire script can advance on its own."""
        return (
            not (self.tz or self.start_ms is not None or self.end_ms is not None or self.last_ms is not None)
            and not self.jitter_ms
        )


def parse_schedule(expr: str, *, now_ms: int, time_zone: str | None = None, stored: bool = False) -> Schedule:
    """Parse a ``schedule`` metadata value.

    Args:
        expr: the value as published (surrounding whitespace is ignored, runs
            of blanks count as one, keywords and names are case-insensitive).
            A cron or predefined schedule may start with ``CRON_TZ=<zone> ``.
        now_ms: the server's current time. Used only to refuse a recurring
            schedule that would never fire again before the year 10000, so
            re-parsing a stored ``expr`` later gives the same Schedule.
        time_zone: the ``scheduleTimeZone`` value, if given: the IANA zone of
            a cron's wall-clock times. With a ``CRON_TZ=`` prefix too, the two
            must name the same zone.
        stored: the expression is read back from an envelope: a ``CRON_TZ=``
            zone an earlier version accepted that is no tzdata name
            (``localtime``) is read from the host rather than refused, so
            that schedule keeps firing (zones.stored_zone).

    Raises:
        InvalidArgumentError: key ``schedule``, naming the value and what is
            wrong (unknown form, bad field, backwards range, @every under 1s or
            not a Go duration, an instant outside 0001-9999, a cron that no
            date matches such as ``0 0 0 30 2 *``).
    """
    if len(expr) > MAX_SCHEDULE_LENGTH:
        raise InvalidArgumentError(
            SCHEDULE_KEY, expr, f"{len(expr)} characters, longer than the maximum of {MAX_SCHEDULE_LENGTH}"
        )
    tz, text = _zone_and_text(expr, time_zone, stored)
    if not text:
        raise InvalidArgumentError(SCHEDULE_KEY, expr, f"empty: give one of {_FORMS}")
    schedule, keyword = _parse_form(expr, text)

    if tz:
        if schedule.kind != "cron":
            key, value = (SCHEDULE_TIME_ZONE, time_zone) if time_zone is not None else (SCHEDULE_KEY, expr)
            raise InvalidArgumentError(
                key,
                value,
                f"a time zone applies to cron and the predefined schedules (@daily, ...), not to "
                f"{keyword}: {keyword} names an instant or an interval, the same in every zone",
            )
        schedule = replace(schedule, expr=f"{CRON_TZ_PREFIX}{tz} {schedule.expr}", tz=tz)

    if schedule.recurring and first_fire(schedule, now_ms=now_ms) is None:
        raise InvalidArgumentError(
            SCHEDULE_KEY, expr, "never fires: no time matches it between now and the end of year 9999"
        )
    return schedule


def _zone_and_text(expr: str, time_zone: str | None, stored: bool) -> tuple[str, str]:
    """The zone of a ``schedule`` ('' = UTC) and its text without a ``CRON_TZ=`` prefix."""
    text = expr.strip()
    tz = ""
    if text.startswith(CRON_TZ_PREFIX):
        words = text[len(CRON_TZ_PREFIX) :].split(maxsplit=1)
        if not words:
            raise InvalidArgumentError(SCHEDULE_KEY, expr, f"{CRON_TZ_PREFIX} names no time zone")
        name, *rest_words = words
        try:
            tz = parse_time_zone(name, key=SCHEDULE_KEY).key
        except InvalidArgumentError as err:
            if not stored or stored_zone(name) is None:
                raise InvalidArgumentError(
                    SCHEDULE_KEY, expr, f"{CRON_TZ_PREFIX}{name}: {err.reason}"
                ) from None
            tz = name
        text = rest_words[0].strip() if rest_words else ""
        if time_zone is not None and time_zone != tz:
            raise InvalidArgumentError(
                SCHEDULE_TIME_ZONE,
                time_zone,
                f"disagrees with the schedule's own {CRON_TZ_PREFIX}{tz}: give one zone (or the same in both)",
            )
    elif time_zone is not None:
        tz = parse_time_zone(time_zone).key
    # UTC is the default: stored without a zone, so it stays on the fast UTC path.
    return ("" if tz == "UTC" else tz), text


def _parse_form(expr: str, text: str) -> tuple[Schedule, str]:
    """The Schedule a zone-less, non-empty ``schedule`` text names, and its first word lower-cased."""
    # Tabs count as blanks too; partition on " " alone would keep "@every\t1s" whole.
    words = text.split()
    keyword = words[0].lower()
    rest = text[len(words[0]) :].strip()
    if keyword == "@at":
        return _parse_at(expr, rest), keyword
    if keyword == "@every":
        return _parse_every(expr, rest), keyword
    if keyword in _PREDEFINED:
        if rest:
            raise InvalidArgumentError(SCHEDULE_KEY, expr, f"{keyword} takes nothing after it")
        return Schedule(kind="cron", expr=keyword, cron=_PREDEFINED[keyword]), keyword
    if keyword.startswith("@"):
        raise InvalidArgumentError(SCHEDULE_KEY, expr, f"unknown form {words[0]!r}: use {_FORMS}")
    cron = _normalise_cron(expr, words)
    return Schedule(kind="cron", expr=cron, cron=cron), keyword


def _argument(expr: str, rest: str, word: str, parse: Callable[[str], int], needs: str) -> int:
    # The value after `@at` / `@every`: missing, or refused by its parser, names the whole expression.
    if not rest:
        raise InvalidArgumentError(SCHEDULE_KEY, expr, f"{word} needs {needs}")
    try:
        return parse(rest)
    except ValueError as exc:
        raise InvalidArgumentError(SCHEDULE_KEY, expr, f"{word}: {exc}") from None


def _parse_at(expr: str, rest: str) -> Schedule:
    at_ms = _argument(expr, rest, "@at", parse_instant, "an RFC 3339 instant, e.g. @at 2045-11-05T08:15:30Z")
    return Schedule(kind="at", expr=f"@at {format_instant(at_ms)}", at_ms=at_ms)


def _parse_every(expr: str, rest: str) -> Schedule:
    needs = "a Go duration, e.g. @every 30s or @every 1h30m"
    interval_ms = _argument(expr, rest, "@every", parse_go_duration, needs)
    if interval_ms < MIN_EVERY_MS:
        raise InvalidArgumentError(
            SCHEDULE_KEY,
            expr,
            f"@every {format_go_duration(interval_ms)} is shorter than the minimum of "
            f"{format_go_duration(MIN_EVERY_MS)}",
        )
    return Schedule(kind="every", expr=f"@every {format_go_duration(interval_ms)}", interval_ms=interval_ms)


def _normalise_cron(expr: str, words: list[str]) -> str:
    """Check a six-field cron expression and return it with numbers only, one blank apart."""
    if len(words) != len(_FIELDS):
        hint = ""
        if len(words) == len(_FIELDS) - 1:
            hint = f"; seconds come first: for the classic 5-field form write '0 {' '.join(words)}'"
        raise InvalidArgumentError(
            SCHEDULE_KEY,
            expr,
            f"cron needs 6 fields (sec min hour day-of-month month day-of-week), got {len(words)}{hint}",
        )
    fields = [_normalise_field(expr, field, word) for field, word in zip(_FIELDS, words, strict=True)]
    dom, dow = fields[3], fields[5]
    if (
        dom != "*"
        and dow != "*"
        and (_expand(dom) >= set(range(1, 32)) or {v % 7 for v in _expand(dow)} >= set(range(7)))
    ):
        # Both day fields restricted and one of them names every day: by the
        # either rule that is every day. Said as '* *', because croniter reads
        # a day-of-week covering the whole week as unrestricted (and then ANDs).
        fields[3] = fields[5] = "*"
    return " ".join(fields)


def _expand(normalised: str) -> set[int]:
    """The values of a normalised day field other than '*' (numbers, a-b, a-b/n, */n, lists)."""
    values: set[int] = set()
    for item in normalised.split(","):
        span, _, step = item.partition("/")
        if span == "*":
            # Only '*/n' reaches here; its first value is the field's (1 or 0):
            # callers ask "covers everything?", which '*/n' with n > 1 never does.
            continue
        start, _, end = span.partition("-")
        values.update(range(int(start), int(end or start) + 1, int(step or "1")))
    return values


def _normalise_field(expr: str, field: _Field, word: str) -> str:
    items = word.lower().split(",")
    if len(items) > 1 and any(item.startswith(("*", "?")) for item in items):
        raise InvalidArgumentError(
            SCHEDULE_KEY,
            expr,
            f"{field.name} {word!r}: '*' already means every value; it cannot be in a list",
        )
    return ",".join(_normalise_item(expr, field, word, item) for item in items)


def _normalise_item(expr: str, field: _Field, word: str, item: str) -> str:
    match = _ITEM.fullmatch(item)
    if match is None:
        raise InvalidArgumentError(
            SCHEDULE_KEY,
            expr,
            f"{field.name} {word!r}: expected '*', a value, a range a-b, a list a,b or a step */n, a-b/n",
        )
    step = 1
    if match["step"] is not None:
        step = _number(expr, field, word, match["step"], what="step")
        span = field.open_high - field.low + 1
        if not 1 <= step <= span:
            raise InvalidArgumentError(
                SCHEDULE_KEY, expr, f"{field.name} {word!r}: step {step} is outside 1-{span}"
            )
    suffix = f"/{step}" if step > 1 else ""

    if match["star"] is not None:
        if match["star"] == "?" and not field.question:
            raise InvalidArgumentError(
                SCHEDULE_KEY, expr, f"{field.name} {word!r}: '?' is only allowed in the day fields"
            )
        # "*/1" is plain "*": unrestricted for the day-of-month/day-of-week rule, as in NATS.
        return f"*{suffix}"

    start = _value(expr, field, word, match["start"])
    if match["end"] is not None:
        end = _value(expr, field, word, match["end"])
    elif match["step"] is not None:
        # "a/n" = from a to the end of the field, every n (robfig/NATS, croniter).
        end = max(field.open_high, start)
    else:
        end = start
    if start > end:
        raise InvalidArgumentError(
            SCHEDULE_KEY,
            expr,
            f"{field.name} {word!r}: range {match['start']}-{match['end']} runs backwards; "
            "write it as a list (e.g. fri-sat,sun-mon) or two ranges",
        )
    if start == end:
        return str(start)
    return f"{start}-{end}{suffix}"


def _value(expr: str, field: _Field, word: str, token: str) -> int:
    if token.isdigit():
        number = _number(expr, field, word, token, what="value")
    elif token in field.names:
        number = field.names[token]
    else:
        names = f" or a name ({', '.join(field.names)})" if field.names else ""
        raise InvalidArgumentError(
            SCHEDULE_KEY, expr, f"{field.name} {word!r}: {token!r} is not a number{names}"
        )
    if not field.low <= number <= field.high:
        raise InvalidArgumentError(
            SCHEDULE_KEY, expr, f"{field.name} {word!r}: {number} is outside {field.low}-{field.high}"
        )
    return number


def _number(expr: str, field: _Field, word: str, digits: str, *, what: str) -> int:
    digits = digits.lstrip("0") or "0"
    if len(digits) > _MAX_DIGITS:
        raise InvalidArgumentError(SCHEDULE_KEY, expr, f"{field.name} {word!r}: {what} {digits} is too large")
    return int(digits)


CronNext = Callable[[str, str, int], int | None]


def _cron_any(cron: str, tz: str, after_ms: int) -> int | None:
    """A cron's first fire strictly after ``after_ms``: in UTC, or in zone ``tz``."""
    if tz:
        return cron_next_in_zone(cron, zone(tz), after_ms)
    return _cron_next(cron, after_ms)


def _nominal_after(schedule: Schedule, origin_ms: int, after_ms: int, cron_next: CronNext) -> int | None:
    """The first occurrence strictly after ``after_ms``, before jitter and the end bounds.

    ``@every`` counts its grid from ``scheduleStart`` (fires at the start itself,
    then every interval) or, without one, from ``origin_ms`` (the acceptance
    time, which is not itself a fire). Cron fires at no match before the start.
    """
    if schedule.kind == "at":
        at_ms = schedule.at_ms
        return at_ms if at_ms is not None and at_ms > after_ms else None
    if schedule.kind == "every":
        interval = schedule.interval_ms
        if interval is None or interval <= 0:
            return None
        first_k = 1
        if schedule.start_ms is not None:
            origin_ms, first_k = schedule.start_ms, 0
        # The first k >= first_k with origin + k * interval > after_ms.
        k = max(first_k, (after_ms - origin_ms) // interval + 1)
        due = origin_ms + k * interval
        return due if due <= MAX_INSTANT_MS else None
    if schedule.cron is None:
        return None
    if schedule.start_ms is not None and schedule.start_ms - 1 > after_ms:
        # A match at the start itself counts.
        after_ms = schedule.start_ms - 1
    return cron_next(schedule.cron, schedule.tz, after_ms)


def jitter_offset(schedule: Schedule, nominal_ms: int, key: str, span_ms: int | None = None) -> int:
    """The jitter of the occurrence at ``nominal_ms``: in [0, span), the same for every replica and retry.

    A hash of the schedule's identity (its seed, else ``key``: the scheduleId)
    and the occurrence's nominal time, so it never depends on when or where it
    is computed, and the grid the occurrences hang from does not drift. The
    span is the jitter, or less where the next occurrence is nearer than that
    (``span_ms``: see _jittered).
    """
    span = schedule.jitter_ms if span_ms is None else min(schedule.jitter_ms, span_ms)
    if span <= 0:
        return 0
    digest = hashlib.blake2b(f"{schedule.seed or key}|{nominal_ms}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % span


# How many occurrences _next_occurrence steps through before it stops looking
# for one jittered past ``after_ms``: a jitter the component accepted spans at
# most two; only a hand-written stored form could ask for more.
_MAX_JITTER_STEPS: Final = 64


def _jittered(schedule: Schedule, nominal_ms: int, following_ms: int | None, key: str) -> int:
    """When the occurrence at ``nominal_ms`` is due: jittered, but always before the next nominal time.

    A daylight-saving change can bring two occurrences of a zoned cron closer
    than the jitter (02:05 skipped in Berlin lands on 03:00, five minutes
    before 03:05). Its span is then cut to that gap, so due times keep the
    nominal order: due(n) < nominal(n + 1) <= due(n + 1). Where the gap is at
    least the jitter (every other occurrence) the offset is the unclamped one.
    """
    span = None if following_ms is None else following_ms - nominal_ms
    return nominal_ms + jitter_offset(schedule, nominal_ms, key, span)


def _next_occurrence(
    schedule: Schedule, origin_ms: int, after_ms: int, key: str, cron_next: CronNext
) -> tuple[int, int] | None:
    """(nominal, jittered) of the first occurrence whose jittered time is after ``after_ms``.

    Jittered times keep the nominal order (_jittered), and an occurrence is due
    at most ``jitter`` after its nominal time, so the answer is the first
    occurrence after ``after_ms - jitter`` whose due time is after ``after_ms``:
    the walk stops at the first nominal time past ``after_ms`` at the latest.
    """
    jitter = schedule.jitter_ms
    nominal = _nominal_after(schedule, origin_ms, after_ms - jitter, cron_next)
    if nominal is None:
        return None
    if not jitter:
        return nominal, nominal
    for _ in range(_MAX_JITTER_STEPS):
        following = _nominal_after(schedule, origin_ms, nominal, cron_next)
        due = _jittered(schedule, nominal, following, key)
        if due > after_ms:
            return nominal, due
        if following is None:
            return None
        nominal = following
    # Only a hand-written jitter far larger than the gaps gets here: the
    # occurrences left behind all fall at or before ``after_ms`` anyway.
    nominal = _nominal_after(schedule, origin_ms, after_ms, cron_next)
    if nominal is None:
        return None
    return nominal, _jittered(schedule, nominal, _nominal_after(schedule, origin_ms, nominal, cron_next), key)


def _bounded_next(
    schedule: Schedule, origin_ms: int, after_ms: int, key: str, cron_next: CronNext
) -> int | None:
    found = _within_bounds(schedule, _next_occurrence(schedule, origin_ms, after_ms, key, cron_next))
    return None if found is None else found[1]


def occurrence_after(
    schedule: Schedule, *, start_ms: int, after_ms: int, key: str = "", cron_next: CronNext = _cron_any
) -> tuple[int, int] | None:
    """(nominal, due) of the first occurrence due strictly after ``after_ms``: ``next_fire`` with its nominal time."""
    return _within_bounds(schedule, _next_occurrence(schedule, start_ms, after_ms, key, cron_next))


def occurrence_from(
    schedule: Schedule, *, start_ms: int, after_ms: int, key: str = "", cron_next: CronNext = _cron_any
) -> tuple[int, int] | None:
    """(nominal, due) of the first occurrence whose NOMINAL time is strictly after ``after_ms``.

    The occurrence after the one at nominal time n is ``occurrence_from(after_ms=n)``:
    a catch-up walks occurrences by their nominal times, whatever their jitter.
    """
    nominal = _nominal_after(schedule, start_ms, after_ms, cron_next)
    if nominal is None:
        return None
    following = _nominal_after(schedule, start_ms, nominal, cron_next) if schedule.jitter_ms else None
    return _within_bounds(schedule, (nominal, _jittered(schedule, nominal, following, key)))


def _within_bounds(schedule: Schedule, found: tuple[int, int] | None) -> tuple[int, int] | None:
    """`found` (nominal, due), unless the schedule's limit or end (or year 9999) comes first."""
    if found is None:
        return None
    nominal, due = found
    if schedule.last_ms is not None and nominal > schedule.last_ms:
        return None
    if schedule.end_ms is not None and due > schedule.end_ms:
        return None
    return found if due <= MAX_INSTANT_MS else None


def occurrences(schedule: Schedule, *, origin_ms: int, after_ms: int, key: str = "") -> Iterator[tuple[int, int]]:
    """(nominal, due) of each occurrence whose nominal time is after ``after_ms``, in order, within the
    schedule's bounds (``scheduleStart``, ``scheduleEnd``, ``scheduleLimit``, year 9999).

    The calendar a backfill replays (delayed_middleware.backfill): nominal times
    are the occurrences' identities; ``due`` is when the engine fires each (its
    jitter, cut as _jittered cuts it), which its ``fired`` history records name.
    ``origin_ms`` is the acceptance time (an ``@every`` grid's origin without a
    ``scheduleStart``). Endless for an endless schedule: the caller stops.
    """
    nominal = _nominal_after(schedule, origin_ms, after_ms, _cron_any)
    while nominal is not None:
        if schedule.last_ms is not None and nominal > schedule.last_ms:
            return
        following = _nominal_after(schedule, origin_ms, nominal, _cron_any)
        due = _jittered(schedule, nominal, following, key) if schedule.jitter_ms else nominal
        if (schedule.end_ms is not None and due > schedule.end_ms) or due > MAX_INSTANT_MS:
            return
        yield nominal, due
        nominal = following


def first_fire(schedule: Schedule, *, now_ms: int, key: str = "") -> int | None:
    """When a schedule accepted at ``now_ms`` is first due (epoch ms).

    ``@at``: its instant, or ``now_ms`` if that has passed ("deliver at once",
    like ``scheduledSendTime``). ``@every``: one interval after ``now_ms``, which
    is then the schedule's ``start_ms`` (with ``scheduleStart``: the first grid
    point from that start not before now). Cron: the first matching second
    after ``now_ms`` (and not before the start). Jitter included; ``key`` is the
    scheduleId the jitter hashes. None if nothing fires within the bounds or
    before year 9999 (``parse_schedule`` and ``with_bounds`` refuse those).
    """
    if schedule.kind == "at":
        if schedule.at_ms is None:
            return None
        return max(schedule.at_ms, min(now_ms, MAX_INSTANT_MS))
    return next_fire(schedule, start_ms=now_ms, after_ms=now_ms, key=key)


def next_fire(
    schedule: Schedule,
    *,
    start_ms: int,
    after_ms: int,
    key: str = "",
    cron_next: CronNext = _cron_any,
) -> int | None:
    """The first fire time strictly after ``after_ms`` (epoch ms), or None if there is none.

    Args:
        schedule: a parsed schedule.
        start_ms: when the schedule was accepted (the envelope's publish time).
            ``@every`` fires at ``start_ms + k * interval_ms`` for k >= 1 (from
            ``scheduleStart`` instead, k >= 0, when the schedule has one): fires
            are computed from the start, never from the previous (late) fire,
            so thousands of fires do not drift. Cron and ``@at`` ignore it.
        after_ms: fires at or before this instant are not returned.
        key: the scheduleId, which the jitter offsets hash (see jitter_offset).
        cron_next: how a cron's next match is found (NextFireMemo remembers them).

    Returns:
        The due time (jittered), or None when nothing is left: a one-shot whose
        instant is not after ``after_ms``, a schedule past its end or limit, or
        a recurring schedule whose next fire would fall after year 9999. Never
        raises for any int inputs.

    Missed fires (the component or Redis down across several fire times): the
    engine fires the overdue occurrence ONCE, then continues on the schedule
    from now rather than replaying the backlog; ``following_fire`` computes
    that next due time (``next_fire(after_ms=max(due_ms, now_ms))``) and
    ``missed_fires`` how many occurrences were skipped, for the history. The
    skipped occurrences count towards ``scheduleLimit``: the limit is the
    occurrence, not the delivery, so every replica agrees on the last one.
    """
    return _bounded_next(schedule, start_ms, after_ms, key, cron_next)


def following_fire(
    schedule: Schedule, *, start_ms: int, due_ms: int, now_ms: int, key: str = ""
) -> int | None:
    """The next due time after firing the occurrence due at ``due_ms`` at ``now_ms``: the missed-fires policy.

    On time (``now_ms`` a little after ``due_ms``) this is simply the next
    occurrence. After an outage (``now_ms`` several occurrences past
    ``due_ms``), the occurrences in between are skipped: the overdue one fires
    once (now), and the schedule continues with the first occurrence after
    ``now_ms`` -- never a storm of catch-up fires. ``@every`` stays aligned to
    ``start_ms + k * interval``. None when nothing follows (a one-shot, the
    end or limit reached, or the end of year 9999): the engine then removes
    the schedule.
    """
    return next_fire(schedule, start_ms=start_ms, after_ms=max(due_ms, now_ms), key=key)


def missed_fires(schedule: Schedule, *, start_ms: int, due_ms: int, now_ms: int, limit: int = 1000) -> int:
    """How many occurrences after ``due_ms`` and up to ``now_ms`` ``following_fire`` skips (at most ``limit``).

    For the history and metrics of a late fire: 0 when on time. Exact and O(1)
    for ``@every`` without jitter; otherwise it counts by stepping, so it stops at ``limit``.
    """
    if now_ms <= due_ms or not schedule.recurring:
        return 0
    if schedule.kind == "every" and schedule.interval_ms and schedule.plain:
        first = next_fire(schedule, start_ms=start_ms, after_ms=due_ms)
        if first is None or first > now_ms:
            return 0
        return min(limit, (now_ms - first) // schedule.interval_ms + 1)
    count = 0
    cursor: int | None = due_ms
    while count < limit:
        cursor = next_fire(schedule, start_ms=start_ms, after_ms=cursor) if cursor is not None else None
        if cursor is None or cursor > now_ms:
            break
        count += 1
    return count


def with_bounds(
    schedule: Schedule,
    *,
    now_ms: int,
    key: str,
    seed: str = "",
    start: str | None = None,
    end: str | None = None,
    limit: str | None = None,
    jitter: str | None = None,
) -> Schedule:
    """A recurring schedule with ``scheduleStart``, ``scheduleEnd``, ``scheduleLimit`` and ``scheduleJitter``.

    Args:
        schedule: a recurring schedule from parse_schedule.
        now_ms: the acceptance time.
        key: the scheduleId ('' when none): what the jitter offsets hash.
        seed: what they hash instead when there is no scheduleId (stored with
            the schedule, so every replica computes the same offsets).
        start, end: RFC 3339 instants, as published.
        limit: a positive integer, as published.
        jitter: a Go duration less than the schedule's interval, as published.

    Returns:
        The schedule with the bounds set and ``expr`` extended to the stored
        form (``parse_stored_schedule`` reads it back), with ``last_ms`` the
        nominal time of the limit-th occurrence from the first fire.

    Raises:
        InvalidArgumentError: naming the key and value: a malformed value, an
            end not after the start, a limit out of range, a jitter not less
            than the interval, or bounds within which the schedule never fires.
    """
    given = [
        (k, v)
        for k, v in (
            (SCHEDULE_START, start),
            (SCHEDULE_END, end),
            (SCHEDULE_LIMIT, limit),
            (SCHEDULE_JITTER, jitter),
        )
        if v is not None
    ]
    if not given:
        return schedule
    if not schedule.recurring:
        k, v = given[0]
        raise InvalidArgumentError(
            k, v, "applies to a recurring schedule (@every, cron, @daily, ...), not to a one-shot @at"
        )
    start_ms = None if start is None else _instant(SCHEDULE_START, start)
    end_ms = None if end is None else _instant(SCHEDULE_END, end)
    if start_ms is not None and end_ms is not None and end_ms <= start_ms:
        raise InvalidArgumentError(
            SCHEDULE_END, end or "", f"is not after scheduleStart={start}: the schedule would never fire"
        )
    if end_ms is not None and end_ms <= now_ms:
        raise InvalidArgumentError(SCHEDULE_END, end or "", "has passed: the schedule would never fire")
    count = None if limit is None else _limit(schedule, limit)
    jitter_ms = 0 if jitter is None else _jitter(schedule, jitter, now_ms)
    bounded = replace(
        schedule, start_ms=start_ms, end_ms=end_ms, limit=count, jitter_ms=jitter_ms, seed="" if key else seed
    )
    first = _next_occurrence(bounded, now_ms, now_ms, key, _cron_any)
    if first is None or (end_ms is not None and first[1] > end_ms):
        k, v = (SCHEDULE_END, end or "") if end is not None else given[0]
        raise InvalidArgumentError(k, v, f"{schedule.expr} never fires within these bounds")
    if count is not None:
        last: int | None = first[0]
        if schedule.kind == "every" and schedule.interval_ms:
            last = first[0] + (count - 1) * schedule.interval_ms
        else:
            for _ in range(count - 1):
                last = _nominal_after(bounded, now_ms, last, _cron_any) if last is not None else None
        # A limit that outlasts year 9999 ends there, as every schedule does: the
        # last occurrence is then the last one before that.
        bounded = replace(bounded, last_ms=min(last, MAX_INSTANT_MS) if last is not None else MAX_INSTANT_MS)
    return replace(bounded, expr=_stored_expr(bounded))


def _instant(key: str, value: str) -> int:
    return values.instant(key, value)


def _limit(schedule: Schedule, value: str) -> int:
    most = MAX_LIMIT_EVERY if schedule.kind == "every" else MAX_LIMIT_CRON
    text = value.strip()
    if not text.isascii() or not text.isdigit() or len(text) > 7 or not 1 <= int(text) <= most:
        raise InvalidArgumentError(
            SCHEDULE_LIMIT, value, f"must be a whole number of fires from 1 to {most:,} for {schedule.kind}"
        )
    return int(text)


def _jitter(schedule: Schedule, value: str, now_ms: int) -> int:
    try:
        jitter_ms = parse_go_duration(value)
    except ValueError as exc:
        raise InvalidArgumentError(SCHEDULE_JITTER, value, f"not a Go duration ({exc}), e.g. 5s") from None
    if jitter_ms < 0:
        raise InvalidArgumentError(SCHEDULE_JITTER, value, "must not be negative")
    gap = schedule.interval_ms if schedule.kind == "every" else _shortest_gap(schedule, now_ms)
    if gap is not None and jitter_ms >= gap:
        raise InvalidArgumentError(
            SCHEDULE_JITTER,
            value,
            f"must be less than the time between two fires of {schedule.expr} ({format_go_duration(gap)}), "
            "so that occurrences keep their order",
        )
    return jitter_ms


def _shortest_gap(schedule: Schedule, now_ms: int) -> int | None:
    """The shortest time between two of a cron's next JITTER_GAP_SAMPLE occurrences, on the wall clock.

    Measured on the wall clock (as in UTC) even for a zoned cron: a
    daylight-saving day can bring two fires closer than that (or part them),
    and _jittered keeps those in order by narrowing that one occurrence's
    jitter. So what a zone accepts does not depend on the zone or on whether
    it is published on such a day.
    """
    if schedule.cron is None:
        return None
    # The same for every schedule of one expression published on one day: remembered,
    # so a bulk of 100,000 jittered schedules does not walk the calendar 100,000 times.
    return _cron_gap(schedule.cron, max(now_ms, schedule.start_ms or 0) // 86_400_000)


@lru_cache(maxsize=1024)
def _cron_gap(cron: str, day: int) -> int | None:
    fires = cron_instants(cron, None, min(day * 86_400_000, MAX_INSTANT_MS), JITTER_GAP_SAMPLE + 1)
    gaps = [b - a for a, b in itertools.pairwise(fires)]
    return min(gaps) if gaps else None


# The stored form: the expression, then '; name=value' options. A cron never
# contains ';', so the split is unambiguous; publishers never write this form
# (parse_schedule refuses it), it is only read back from envelopes.
_OPTION_SEPARATOR: Final = "; "


def _stored_expr(schedule: Schedule) -> str:
    base = schedule.expr.split(";", 1)[0]
    options: list[str] = []
    if schedule.start_ms is not None:
        options.append(f"start={format_instant(schedule.start_ms)}")
    if schedule.end_ms is not None:
        options.append(f"end={format_instant(schedule.end_ms)}")
    if schedule.limit is not None and schedule.last_ms is not None:
        options.append(f"limit={schedule.limit}")
        options.append(f"last={format_instant(schedule.last_ms)}")
    if schedule.jitter_ms:
        options.append(f"jitter={format_go_duration(schedule.jitter_ms)}")
    if schedule.seed:
        options.append(f"seed={schedule.seed}")
    return _OPTION_SEPARATOR.join([base, *options])


def parse_stored_schedule(stored: str, *, now_ms: int) -> Schedule:
    """Read back the ``schedule`` field of an envelope: an expression, with its bounds and jitter if any.

    Raises:
        InvalidArgumentError: when the expression or an option does not parse.
    """
    base, *options = stored.split(";")
    schedule = parse_schedule(base, now_ms=now_ms, stored=True)
    if not options:
        return schedule
    fields: dict[str, str] = {}
    for option in options:
        name, sep, value = option.strip().partition("=")
        if not sep or name not in ("start", "end", "limit", "last", "jitter", "seed"):
            raise InvalidArgumentError(SCHEDULE_KEY, stored, f"unknown option {option.strip()!r}")
        fields[name] = value
    try:
        schedule = replace(
            schedule,
            start_ms=parse_instant(fields["start"]) if "start" in fields else None,
            end_ms=parse_instant(fields["end"]) if "end" in fields else None,
            limit=int(fields["limit"]) if "limit" in fields else None,
            last_ms=parse_instant(fields["last"]) if "last" in fields else None,
            jitter_ms=parse_go_duration(fields["jitter"]) if "jitter" in fields else 0,
            seed=fields.get("seed", ""),
        )
    except ValueError as exc:
        raise InvalidArgumentError(SCHEDULE_KEY, stored, f"bad option: {exc}") from None
    return replace(schedule, expr=_stored_expr(schedule))


class NextFireMemo:
    """``next_fire`` / ``following_fire`` with cron results remembered, for an engine firing many at once.

    A cron step costs croniter ~0.1-0.4 ms, ``@every`` well under a microsecond.
    A cron answer depends only on the expression, its zone and the whole
    second it starts from, so when 10,000 envelopes of ``* * * * * *`` fire in
    the same second they share one computation (bounds and jitter are applied
    per envelope around it). One instance per engine (never module-wide);
    bounded: it forgets everything once it holds ``max_entries`` answers.
    """

    def __init__(self, max_entries: int = 4096) -> None:
        self._max_entries = max_entries
        self._cron: dict[tuple[str, str, int], int | None] = {}

    def cron_next(self, cron: str, tz: str, after_ms: int) -> int | None:
        """A cron's first fire strictly after ``after_ms`` (remembered by the whole second)."""
        after_s = max(after_ms, MIN_INSTANT_MS) // 1000
        key = (cron, tz, after_s)
        if key not in self._cron:
            if len(self._cron) >= self._max_entries:
                self._cron.clear()
            self._cron[key] = _cron_any(cron, tz, after_s * 1000)
        return self._cron[key]

    def next_fire(self, schedule: Schedule, *, start_ms: int, after_ms: int, key: str = "") -> int | None:
        """Same answer as the module's ``next_fire``."""
        return next_fire(schedule, start_ms=start_ms, after_ms=after_ms, key=key, cron_next=self.cron_next)

    def following_fire(
        self, schedule: Schedule, *, start_ms: int, due_ms: int, now_ms: int, key: str = ""
    ) -> int | None:
        """Same answer as the module's ``following_fire``."""
        return self.next_fire(schedule, start_ms=start_ms, after_ms=max(due_ms, now_ms), key=key)


class EnvelopeRecurrence:
    """The delay engine's recurrence function: the next fire of a recurring envelope after an instant.

    The envelope stores the expression in its stored form (``schedule``: with
    its zone, bounds and jitter, see parse_stored_schedule) and its acceptance
    time (``published_at_ms``, the start of an ``@every`` grid without
    ``scheduleStart``); its scheduleId is what the jitter hashes. Parsed
    expressions and cron answers are remembered (bounded), because the engine
    asks for every fire. An expression that no longer parses (written by a
    newer version, say) or has no fire left (past its end or limit) answers
    None: the engine then ends that schedule after its current occurrence.
    """

    def __init__(self, max_entries: int = 4096) -> None:
        self._max_entries = max_entries
        self._parsed: dict[str, Schedule | None] = {}
        self._memo = NextFireMemo(max_entries)

    def __call__(self, envelope: Envelope, after_ms: int) -> int | None:
        schedule = self.schedule_of(envelope, after_ms)
        if schedule is None:
            return None
        return self._memo.next_fire(
            schedule, start_ms=envelope.published_at_ms, after_ms=after_ms, key=envelope.schedule_id
        )

    def occurrences(self, envelope: Envelope, now_ms: int) -> Occurrences | None:
        """The envelope's occurrences by nominal time (a catch-up walks them), or None as ``__call__``'s."""
        schedule = self.schedule_of(envelope, now_ms)
        if schedule is None:
            return None
        return Occurrences(schedule, envelope.published_at_ms, envelope.schedule_id, self._memo.cron_next)

    def schedule_of(self, envelope: Envelope, now_ms: int) -> Schedule | None:
        """The envelope's recurring schedule, parsed (remembered), or None: not recurring or unreadable."""
        expr = envelope.schedule
        if expr not in self._parsed:
            if len(self._parsed) >= self._max_entries:
                self._parsed.clear()
            try:
                self._parsed[expr] = parse_stored_schedule(
                    expr, now_ms=min(max(now_ms, MIN_INSTANT_MS), MAX_INSTANT_MS)
                )
            except InvalidArgumentError:
                self._parsed[expr] = None
        schedule = self._parsed[expr]
        if schedule is None or not schedule.recurring:
            return None
        return schedule


@dataclass(frozen=True)
class Occurrences:
    """One recurring envelope's occurrences, as (nominal, due) pairs: what a catch-up (catchup.py) walks."""

    schedule: Schedule
    start_ms: int
    key: str
    cron_next: CronNext

    def due_after(self, after_ms: int) -> tuple[int, int] | None:
        """The first occurrence due strictly after ``after_ms`` (occurrence_after)."""
        return occurrence_after(
            self.schedule, start_ms=self.start_ms, after_ms=after_ms, key=self.key, cron_next=self.cron_next
        )

    def nominal_after(self, after_ms: int) -> tuple[int, int] | None:
        """The first occurrence whose nominal time is strictly after ``after_ms`` (occurrence_from)."""
        return occurrence_from(
            self.schedule, start_ms=self.start_ms, after_ms=after_ms, key=self.key, cron_next=self.cron_next
        )

    def nominal_of(self, due_ms: int) -> int:
        """The nominal time of the occurrence due at ``due_ms``: the last nominal time at or before it
        (an occurrence is due in [nominal, nominal + jitter), before the next nominal time)."""
        if not self.schedule.jitter_ms:
            return due_ms
        found = self.nominal_after(due_ms - self.schedule.jitter_ms - 1)
        nominal = due_ms
        while found is not None and found[0] <= due_ms:
            nominal = found[0]
            found = self.nominal_after(found[0])
        return nominal

    def count(self, from_ms: int, before_ms: int, limit: int, budget_s: float) -> tuple[int, bool]:
        """How many occurrences have nominal times in [from_ms, before_ms), and whether that is all of
        them: a count stops at ``limit``, and a cron's (stepped through, ~80 us a step) once it has
        run for ``budget_s`` (the caller holds an event loop: a month of a per-second cron was 8 s)."""
        s = self.schedule
        if before_ms <= from_ms:
            return 0, True
        if s.kind == "every" and s.interval_ms and s.last_ms is None:
            first = self.nominal_after(from_ms - 1)
            if first is None or first[0] >= before_ms:
                return 0, True
            n = (before_ms - 1 - first[0]) // s.interval_ms + 1
            return min(limit, n), n <= limit
        deadline = time.perf_counter() + budget_s
        n, cursor = 0, from_ms - 1
        while n < limit:
            found = self.nominal_after(cursor)
            if found is None or found[0] >= before_ms:
                return n, True
            n, cursor = n + 1, found[0]
            if n % 16 == 0 and time.perf_counter() > deadline:
                break
        return n, False


def schedule_zone(stored: str) -> str:
    """The IANA zone of a stored schedule expression ('' for UTC or none), without parsing the rest."""
    if not stored.startswith(CRON_TZ_PREFIX):
        return ""
    return stored[len(CRON_TZ_PREFIX) :].split(maxsplit=1)[0] if len(stored) > len(CRON_TZ_PREFIX) else ""


def is_jittered(envelope: Envelope) -> bool:
    """Whether an envelope's stored schedule has scheduleJitter (its due times are not its nominal times)."""
    return any(o.strip().startswith("jitter=") for o in envelope.schedule.split(";")[1:])


def schedule_next_value(next_ms: int | None) -> str:
    """The ``scheduleNext`` metadata a fired message carries: RFC 3339 UTC, or ``purge`` if none follows."""
    return PURGE if next_ms is None else format_instant(next_ms)


def _cron_next(cron: str, after_ms: int) -> int | None:
    # Cron fires on whole seconds: the first one strictly after after_ms is the
    # first one strictly after the whole second containing it.
    after_s = max(after_ms, MIN_INSTANT_MS) // 1000
    if after_s * 1000 >= MAX_INSTANT_MS:
        return None
    start = _EPOCH + timedelta(seconds=after_s)
    try:
        fired = croniter(cron, start, second_at_beginning=True).get_next(datetime)
    except (CroniterError, ValueError, OverflowError):
        # CroniterBadDateError: no date matches within croniter's search window;
        # ValueError/OverflowError: the search ran past datetime's year 9999.
        return None
    due = (fired - _EPOCH) // _MS
    return due if due <= MAX_INSTANT_MS else None
