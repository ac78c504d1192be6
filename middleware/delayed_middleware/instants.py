"""Instants as publishers write them: RFC 3339 with an explicit offset, in epoch milliseconds.

Parsed by hand rather than with ``datetime.fromisoformat``: that function's
grammar changes between Python versions, stops at microseconds while Dapr users
(Go's ``time.RFC3339Nano``) send nanoseconds, and happily returns naive times,
which on a server would silently mean "the server's time zone".
"""

from __future__ import annotations

import calendar
import re
from datetime import date
from typing import Final

_MS_PER_DAY: Final = 86_400_000
_EPOCH_ORDINAL: Final = date(1970, 1, 1).toordinal()
# The instants format_instant can write, so every parsed value can be shown back.
MIN_INSTANT_MS: Final = (date.min.toordinal() - _EPOCH_ORDINAL) * _MS_PER_DAY
MAX_INSTANT_MS: Final = (date.max.toordinal() + 1 - _EPOCH_ORDINAL) * _MS_PER_DAY - 1

# Date and time of day. Seconds may be left out (ISO 8601 reduced precision:
# "08:15" can only mean 08:15:00); a space may replace the "T" (RFC 3339 §5.6 note).
# [0-9] rather than \d, which would accept non-ASCII digits.
_DATE_TIME: Final = re.compile(
    r"(?P<year>[0-9]{4})-(?P<month>[0-9]{2})-(?P<day>[0-9]{2})[Tt ]"
    r"(?P<hour>[0-9]{2}):(?P<minute>[0-9]{2})"
    r"(?::(?P<second>[0-9]{2})(?:\.(?P<fraction>[0-9]+))?)?"
)
# Z, or an offset as ±HH:MM (RFC 3339), ±HHMM or ±HH (ISO 8601). "-00:00" is UTC.
_OFFSET: Final = re.compile(r"[Zz]|(?P<sign>[-+])(?P<hours>[0-9]{2})(?::?(?P<minutes>[0-9]{2}))?")
# What "+05:30" becomes when a publisher forgets to escape "+" in a URL query.
_PLUS_AS_SPACE: Final = re.compile(r" [0-9]{2}(?::?[0-9]{2})?")

_EXAMPLES: Final = "e.g. 2045-11-05T08:15:30-05:00 or 2026-11-25T10:00:00.123Z"


def parse_instant(text: str) -> int:
    """Parse an RFC 3339 instant with a UTC offset or ``Z`` into Unix epoch milliseconds.

    Accepts ``2045-11-05T08:15:30-05:00``, ``2026-11-25T10:00:00.123456789Z``,
    ``...+05:30``, lower-case ``t``/``z``, and the ISO 8601 offsets ``+0530`` and
    ``+05``. Fractions of any length round *up* to the next millisecond, so a
    message is never delivered before the instant it names.

    Raises:
        ValueError: not such an instant; no offset (a naive time would silently
            mean the server's zone); a field out of range (month 13, Feb 30,
            hour 24, leap second 60); or outside years 0001-9999 in UTC.
    """
    match = _DATE_TIME.match(text)
    if match is None:
        raise ValueError(f"not an RFC 3339 instant ({_EXAMPLES})")
    rest = text[match.end() :]
    offset = _OFFSET.fullmatch(rest)
    if offset is None:
        if not rest:
            raise ValueError(f"needs a UTC offset or Z ({_EXAMPLES})")
        if _PLUS_AS_SPACE.fullmatch(rest):
            raise ValueError(
                "the offset has a space where its sign should be: a '+' in a URL query "
                "means a space, so write it as %2B"
            )
        raise ValueError(f"not an RFC 3339 instant: unexpected {rest!r} ({_EXAMPLES})")

    year, month, day = int(match["year"]), int(match["month"]), int(match["day"])
    hour, minute = int(match["hour"]), int(match["minute"])
    second = int(match["second"] or "0")
    if year < 1:
        raise ValueError("year 0000 is out of range (0001-9999)")
    if not 1 <= month <= 12:
        raise ValueError(f"month {month} is out of range")
    if not 1 <= day <= calendar.monthrange(year, month)[1]:
        raise ValueError(f"day {day} is out of range for {year:04d}-{month:02d}")
    if hour > 23:
        raise ValueError(f"hour {hour} is out of range (00-23)")
    if minute > 59:
        raise ValueError(f"minute {minute} is out of range (00-59)")
    if second > 59:
        raise ValueError(f"second {second} is out of range (00-59; leap seconds are not supported)")

    offset_minutes = 0
    if offset["sign"] is not None:
        offset_hours, offset_mins = int(offset["hours"]), int(offset["minutes"] or "0")
        if offset_hours > 23 or offset_mins > 59:
            raise ValueError(f"UTC offset {rest} is out of range (-23:59 to +23:59)")
        offset_minutes = (offset_hours * 60 + offset_mins) * (-1 if offset["sign"] == "-" else 1)

    days = date(year, month, day).toordinal() - _EPOCH_ORDINAL
    seconds = days * 86_400 + hour * 3600 + minute * 60 + second - offset_minutes * 60
    result = seconds * 1000 + _fraction_ms_ceil(match["fraction"] or "")
    if not MIN_INSTANT_MS <= result <= MAX_INSTANT_MS:
        raise ValueError("instant falls outside years 0001-9999 in UTC")
    return result


def _fraction_ms_ceil(digits: str) -> int:
    """Milliseconds in a decimal fraction of a second, rounded up (0-1000).

    Works on the digit string, so a fraction of any length costs no big-number
    arithmetic: the first three digits are whole milliseconds, and any non-zero
    digit after them is a remainder that rounds up.
    """
    millis = int(digits[:3].ljust(3, "0"))
    if digits[3:].strip("0"):
        millis += 1
    return millis


def display_instant(ms: int | None) -> str:
    """An instant for people to read: ``format_instant(ms)``, ``""`` for none, and the bare
    number where it falls outside what RFC 3339 can write (a corrupt score must still show)."""
    if ms is None:
        return ""
    try:
        return format_instant(ms)
    except ValueError:
        return str(ms)


def format_instant(ms: int) -> str:
    """Format Unix epoch milliseconds as RFC 3339 UTC with milliseconds: ``2026-11-25T10:00:00.123Z``.

    ``parse_instant(format_instant(ms)) == ms`` for every ms in
    [MIN_INSTANT_MS, MAX_INSTANT_MS].

    Raises:
        ValueError: outside years 0001-9999.
    """
    if not MIN_INSTANT_MS <= ms <= MAX_INSTANT_MS:
        raise ValueError(f"{ms} ms since the epoch falls outside years 0001-9999")
    days, ms_of_day = divmod(ms, _MS_PER_DAY)
    day = date.fromordinal(days + _EPOCH_ORDINAL)
    seconds_of_day, millis = divmod(ms_of_day, 1000)
    hour, rem = divmod(seconds_of_day, 3600)
    minute, second = divmod(rem, 60)
    return f"{day.isoformat()}T{hour:02d}:{minute:02d}:{second:02d}.{millis:03d}Z"
