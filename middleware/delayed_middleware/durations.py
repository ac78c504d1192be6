"""Durations as Dapr users write them: Go's `time.ParseDuration` syntax, in milliseconds.

Dapr's own components parse durations with Go's `time.ParseDuration`, so users
already write `90s`, `1h30m` or `1.5h`; accepting exactly the strings Go accepts
(no more, no less) means a value that works with `pubsub.redis` works here too.

Everything is returned in whole milliseconds, the resolution of the delay engine.
A sub-millisecond remainder rounds *up*: a delay may end a fraction of a
millisecond late, never early.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final

_NS_PER_MS: Final = 1_000_000

# The unit table of Go's time package. Both spellings of "micro" are there
# because Go accepts U+00B5 (MICRO SIGN) and U+03BC (GREEK SMALL LETTER MU).
_UNIT_NS: Final[Mapping[str, int]] = {
    "ns": 1,
    "us": 1_000,
    "\u00b5s": 1_000,
    "\u03bcs": 1_000,
    "ms": _NS_PER_MS,
    "s": 1_000_000_000,
    "m": 60_000_000_000,
    "h": 3_600_000_000_000,
}

# A Go Duration is an int64 count of nanoseconds: the magnitude may reach 2**63
# only when negative.
_MAX_POSITIVE_NS: Final = 2**63 - 1
_MAX_NEGATIVE_NS: Final = 2**63

# One "<number><unit>" piece. The unit is greedy up to the next digit or dot,
# as in Go, so "1h 30m" yields the unit "h " and is refused rather than split.
# [0-9] rather than \d: Python's \d also matches non-ASCII digits, Go's grammar does not.
_COMPONENT: Final = re.compile(r"(?P<whole>[0-9]*)(?:\.(?P<fraction>[0-9]*))?(?P<unit>[^0-9.]*)")
_WHOLE_SECONDS: Final = re.compile(r"[-+]?[0-9]+")

# Whole parts longer than this overflow any unit; checking the length first
# keeps absurd inputs away from int()'s own digit limit.
_MAX_WHOLE_DIGITS: Final = 20
# Go stops reading fraction digits once its 64-bit accumulator is full (~19
# digits); 40 keeps us exact to the nanosecond for every realistic input while
# bounding the arithmetic. Digits past it are still validated, just not summed.
_MAX_FRACTION_DIGITS: Final = 40

_UNITS_HINT: Final = "units are ns, us, µs, ms, s, m, h; e.g. 90s, 1h30m, 1.5h"


def parse_go_duration(text: str) -> int:
    """Parse a Go duration string and return it in milliseconds, rounded up.

    Accepts exactly what Go's ``time.ParseDuration`` accepts: an optional sign,
    then one or more ``<decimal><unit>`` pieces (``1h30m``, ``.5s``, ``1.s``,
    ``-1.5h``), or a bare ``0``. The value is the nanosecond count Go would
    return (each piece's fraction truncated to whole nanoseconds, as Go does,
    but computed with exact integers where Go uses float64), with its magnitude
    rounded up to the next whole millisecond: ``1ns`` is 1 ms and ``-1ns`` is
    -1 ms, so no non-zero duration reads as zero or shorter than written.

    Raises:
        ValueError: the text is not a Go duration, or lies beyond the ~292-year
            range of Go's int64 nanoseconds.
    """
    rest = text
    negative = False
    if rest[:1] in ("+", "-"):
        negative = rest[0] == "-"
        rest = rest[1:]
    if rest == "0":
        return 0
    if not rest:
        raise ValueError(f"not a duration: nothing to read ({_UNITS_HINT})")

    total_ns = 0
    pos = 0
    while pos < len(rest):
        match = _COMPONENT.match(rest, pos)
        # The pattern can match the empty string, but never here: rest[pos] is a
        # digit, a dot or a unit character, and each of those is consumed. The
        # check stays (not an assert) so no input can ever spin this loop.
        if match is None or match.end() == pos:
            raise ValueError(f"not a duration ({_UNITS_HINT})")
        pos = match.end()
        whole, fraction, unit = match["whole"], match["fraction"], match["unit"]
        if not whole and not fraction:
            raise ValueError(f"not a duration: expected a number before {unit or '.'!r} ({_UNITS_HINT})")
        if not unit:
            raise ValueError(f"not a duration: missing unit after a number ({_UNITS_HINT})")
        unit_ns = _UNIT_NS.get(unit)
        if unit_ns is None:
            raise ValueError(f"not a duration: unknown unit {unit!r} ({_UNITS_HINT})")

        whole = whole.lstrip("0")
        if len(whole) > _MAX_WHOLE_DIGITS:
            raise ValueError("duration too long: beyond ~292 years, the range of a Go duration")
        piece_ns = int(whole or "0") * unit_ns
        if fraction:
            digits = fraction[:_MAX_FRACTION_DIGITS]
            piece_ns += int(digits) * unit_ns // 10 ** len(digits)
        total_ns += piece_ns

    if total_ns > (_MAX_NEGATIVE_NS if negative else _MAX_POSITIVE_NS):
        raise ValueError("duration too long: beyond ~292 years, the range of a Go duration")
    # Round the magnitude up, whatever the sign: "-1ns" stays negative (so callers
    # that refuse negative delays still see it) rather than becoming zero.
    magnitude_ms = -(-total_ns // _NS_PER_MS)
    return -magnitude_ms if negative else magnitude_ms


def parse_duration_or_seconds(text: str) -> int:
    """Parse a whole number of seconds (``90``) or a Go duration (``1h30m``) into milliseconds.

    The bare-integer form is what Dapr's ``ttlInSeconds`` uses; the duration form
    is what ``ttl`` and Dapr's component settings use. A sign is accepted on
    either form (the caller decides whether negative makes sense).

    Raises:
        ValueError: neither form, or beyond the range of a Go duration.
    """
    if _WHOLE_SECONDS.fullmatch(text):
        digits = text.lstrip("+-").lstrip("0")
        # Same range as the duration form, so "N" and "Ns" agree on what is too long.
        if len(digits) > _MAX_WHOLE_DIGITS or int(digits or "0") * 1_000_000_000 > _MAX_POSITIVE_NS:
            raise ValueError("duration too long: beyond ~292 years, the range of a Go duration")
        return int(text) * 1000
    try:
        return parse_go_duration(text)
    except ValueError as exc:
        raise ValueError(f"{exc}; or give a whole number of seconds") from None


def format_go_duration(ms: int) -> str:
    """Format milliseconds as Go's ``Duration.String()`` would: ``1h30m0s``, ``1.5s``, ``250ms``, ``0s``.

    Used in messages and logs, so users see durations in the syntax they write.
    ``parse_go_duration(format_go_duration(ms)) == ms`` within a Go duration's range.
    """
    if ms == 0:
        return "0s"
    sign = "-" if ms < 0 else ""
    magnitude = abs(ms)
    if magnitude < 1000:
        return f"{sign}{magnitude}ms"
    hours, rem = divmod(magnitude, 3_600_000)
    minutes, rem = divmod(rem, 60_000)
    seconds, millis = divmod(rem, 1000)
    secs = f"{seconds}.{millis:03d}".rstrip("0") if millis else str(seconds)
    if hours:
        return f"{sign}{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{sign}{minutes}m{secs}s"
    return f"{sign}{secs}s"
