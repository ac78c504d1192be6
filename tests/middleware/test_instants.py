"""RFC 3339 instants: offset required, nanosecond fractions rounded up, epoch ms out and back."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta, timezone
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from delayed_middleware.instants import MAX_INSTANT_MS, MIN_INSTANT_MS, format_instant, parse_instant

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def utc_ms(year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0) -> int:
    """Epoch ms of a UTC wall time, via datetime: an oracle independent of the parser."""
    return (datetime(year, month, day, hour, minute, second, tzinfo=UTC) - EPOCH) // timedelta(milliseconds=1)


@pytest.mark.parametrize(
    ("text", "ms"),
    [
        ("1970-01-01T00:00:00Z", 0),
        ("1970-01-01T00:00:00.000Z", 0),
        ("1970-01-01T00:00:00.001Z", 1),
        ("1970-01-01T00:00:00.0001Z", 1),
        ("1970-01-01T00:00:00.000000001Z", 1),
        ("1970-01-01T00:00:00.999Z", 999),
        ("1970-01-01T00:00:00.9991Z", 1000),
        ("1970-01-01T00:00:00.999999999Z", 1000),
        ("1970-01-01T00:00:00.1000000000000000000000000Z", 100),
        ("1969-12-31T23:59:59.9995Z", 0),  # -0.5ms rounds up to 0
        ("1969-12-31T23:59:59.999Z", -1),
        ("2045-11-05T08:15:30-05:00", utc_ms(2045, 11, 5, 13, 15, 30)),
        ("2045-11-05T08:15:30+05:30", utc_ms(2045, 11, 5, 2, 45, 30)),
        ("2045-11-05T08:15:30+0530", utc_ms(2045, 11, 5, 2, 45, 30)),
        ("2045-11-05T08:15:30+05", utc_ms(2045, 11, 5, 3, 15, 30)),
        ("2045-11-05T08:15:30-00:00", utc_ms(2045, 11, 5, 8, 15, 30)),
        ("2045-11-05T08:15:30+00:00", utc_ms(2045, 11, 5, 8, 15, 30)),
        ("2045-11-05t08:15:30z", utc_ms(2045, 11, 5, 8, 15, 30)),
        ("2045-11-05 08:15:30Z", utc_ms(2045, 11, 5, 8, 15, 30)),
        ("2045-11-05T08:15Z", utc_ms(2045, 11, 5, 8, 15)),
        ("2026-11-25T10:00:00.123456789Z", utc_ms(2026, 11, 25, 10) + 124),
        ("2026-11-25T10:00:00.123Z", utc_ms(2026, 11, 25, 10) + 123),
        ("2024-02-29T12:00:00Z", utc_ms(2024, 2, 29, 12)),
        ("2000-02-29T00:00:00Z", utc_ms(2000, 2, 29)),
        ("2045-12-31T23:30:00-01:00", utc_ms(2046, 1, 1, 0, 30)),
        ("2045-01-01T00:30:00+01:00", utc_ms(2044, 12, 31, 23, 30)),
        ("2045-11-05T08:15:30+23:59", utc_ms(2045, 11, 4, 8, 16, 30)),
        ("0001-01-01T00:00:00Z", MIN_INSTANT_MS),
        ("9999-12-31T23:59:59.999Z", MAX_INSTANT_MS),
        ("9999-12-31T23:59:59.9989Z", MAX_INSTANT_MS),
    ],
)
def test_parse_instant_valid(text: str, ms: int) -> None:
    assert parse_instant(text) == ms


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "not an RFC 3339 instant"),
        ("2045-11-05", "not an RFC 3339 instant"),
        ("1731000000", "not an RFC 3339 instant"),
        ("2045-11-05T8:15:30Z", "not an RFC 3339 instant"),
        ("45-11-05T08:15:30Z", "not an RFC 3339 instant"),
        ("2045/11/05T08:15:30Z", "not an RFC 3339 instant"),
        ("2045-11-05X08:15:30Z", "not an RFC 3339 instant"),
        (" 2045-11-05T08:15:30Z", "not an RFC 3339 instant"),
        ("\u0662045-11-05T08:15:30Z", "not an RFC 3339 instant"),
        ("10000-01-01T00:00:00Z", "not an RFC 3339 instant"),
        ("2045-11-05T08:15:30", "needs a UTC offset or Z"),
        ("2045-11-05T08:15:30.123456789", "needs a UTC offset or Z"),
        ("2045-11-05T08:15", "needs a UTC offset or Z"),
        ("2045-11-05T08:15:30 05:00", "%2B"),
        ("2045-11-05T08:15:30 0530", "%2B"),
        ("2045-11-05T08:15:30.Z", "unexpected '.Z'"),
        ("2045-11-05T08:15:30,5Z", "unexpected ',5Z'"),
        ("2045-11-05T08:15:30Z ", "unexpected 'Z '"),
        ("2045-11-05T08:15:30Z\n", "unexpected"),
        ("2045-11-05T08:15:30+5:00", "unexpected"),
        ("2045-11-05T08:15:30+05:0", "unexpected"),
        ("2045-11-05T08:15:30UTC", "unexpected 'UTC'"),
        ("2045-11-05T08:15:30+05:30[Asia/Kolkata]", "unexpected"),
        ("0000-01-01T00:00:00Z", "year 0000"),
        ("2045-00-05T08:15:30Z", "month 0"),
        ("2045-13-05T08:15:30Z", "month 13"),
        ("2045-11-00T08:15:30Z", "day 0"),
        ("2045-11-31T08:15:30Z", "day 31 is out of range for 2045-11"),
        ("2023-02-29T08:15:30Z", "day 29 is out of range for 2023-02"),
        ("1900-02-29T08:15:30Z", "day 29"),
        ("2045-11-05T24:00:00Z", "hour 24"),
        ("2045-11-05T08:60:00Z", "minute 60"),
        ("2045-11-05T08:15:60Z", "second 60"),
        ("2045-11-05T08:15:30+24:00", "UTC offset +24:00"),
        ("2045-11-05T08:15:30-05:60", "UTC offset -05:60"),
        ("0001-01-01T00:00:00+00:01", "outside years 0001-9999"),
        ("9999-12-31T23:59:59-00:01", "outside years 0001-9999"),
        ("9999-12-31T23:59:59.9991Z", "outside years 0001-9999"),
    ],
)
def test_parse_instant_invalid(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=re.escape(reason)):
        parse_instant(text)


@pytest.mark.parametrize(
    ("ms", "text"),
    [
        (0, "1970-01-01T00:00:00.000Z"),
        (-1, "1969-12-31T23:59:59.999Z"),
        (utc_ms(2026, 11, 25, 10) + 123, "2026-11-25T10:00:00.123Z"),
        (MIN_INSTANT_MS, "0001-01-01T00:00:00.000Z"),
        (MAX_INSTANT_MS, "9999-12-31T23:59:59.999Z"),
    ],
)
def test_format_instant(ms: int, text: str) -> None:
    assert format_instant(ms) == text


@pytest.mark.parametrize("ms", [MIN_INSTANT_MS - 1, MAX_INSTANT_MS + 1])
def test_format_instant_out_of_range(ms: int) -> None:
    with pytest.raises(ValueError, match="outside years 0001-9999"):
        format_instant(ms)


@given(st.integers(min_value=MIN_INSTANT_MS, max_value=MAX_INSTANT_MS))
def test_format_then_parse_round_trips(ms: int) -> None:
    assert parse_instant(format_instant(ms)) == ms


# RFC 3339 offsets are whole minutes; keep clear of the year edges, where an
# offset can push the UTC instant outside 0001-9999.
offsets = st.integers(min_value=-(23 * 60 + 59), max_value=23 * 60 + 59).map(
    lambda minutes: timezone(timedelta(minutes=minutes))
)
aware_datetimes = st.datetimes(
    min_value=datetime(2, 1, 1), max_value=datetime(9998, 12, 31), timezones=offsets
)


@given(
    aware_datetimes,
    st.sampled_from(["auto", "seconds", "milliseconds", "microseconds"]),
    st.sampled_from(["T", "t", " "]),
)
def test_isoformat_of_aware_datetimes_parses_to_ceil_ms(dt: datetime, timespec: str, sep: str) -> None:
    text = dt.isoformat(sep=sep, timespec=timespec)
    written = datetime.fromisoformat(text.replace(sep, "T", 1))  # what the text says, after timespec cut it
    expected = -(-(written - EPOCH) // timedelta(microseconds=1) // 1000)
    assert parse_instant(text) == expected


@given(aware_datetimes, st.text("0123456789", min_size=1, max_size=30))
def test_long_fractions_round_up_to_the_next_ms(dt: datetime, fraction: str) -> None:
    whole = dt.replace(microsecond=0)
    text = whole.isoformat(timespec="seconds")
    text = text[:19] + "." + fraction + text[19:]
    exact_ms = Fraction((whole - EPOCH) // timedelta(seconds=1)) * 1000 + Fraction(f"0.{fraction}") * 1000
    expected = -(-exact_ms.numerator // exact_ms.denominator)
    assert parse_instant(text) == expected
    assert parse_instant(text) >= exact_ms  # never early


@given(st.text())
def test_arbitrary_text_is_an_instant_or_value_error(text: str) -> None:
    try:
        result = parse_instant(text)
    except ValueError:
        return
    assert MIN_INSTANT_MS <= result <= MAX_INSTANT_MS


@given(
    st.from_regex(
        r"\A[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt ][0-9]{2}:[0-9]{2}(:[0-9]{2}(\.[0-9]*)?)?[Zz+-]?[0-9:]{0,6}\Z"
    )
)
def test_near_miss_text_is_an_instant_or_value_error(text: str) -> None:
    # Right shape, random fields: exercises every range check.
    try:
        result = parse_instant(text)
    except ValueError:
        return
    assert format_instant(result).endswith("Z")
