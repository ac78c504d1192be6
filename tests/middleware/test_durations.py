"""Go durations: the grammar of time.ParseDuration, the value in ms rounded up, and String()."""

from __future__ import annotations

import re
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from delayed_middleware.durations import format_go_duration, parse_duration_or_seconds, parse_go_duration

NS_PER = {
    "ns": 1,
    "us": 1_000,
    "µs": 1_000,  # U+00B5 MICRO SIGN
    "μs": 1_000,  # U+03BC GREEK SMALL LETTER MU
    "ms": 1_000_000,
    "s": 1_000_000_000,
    "m": 60 * 1_000_000_000,
    "h": 3600 * 1_000_000_000,
}
MAX_NS = 2**63 - 1
# Go's Duration is int64 ns; these are the ms bounds of what parse can return.
MAX_MS = -(-MAX_NS // 1_000_000)
MIN_MS = -(2**63) // 1_000_000


def ceil_ms(ns: int) -> int:
    """The magnitude rounded up to whole ms, keeping the sign."""
    magnitude = -(-abs(ns) // 1_000_000)
    return -magnitude if ns < 0 else magnitude


@pytest.mark.parametrize(
    ("text", "ms"),
    [
        ("0", 0),
        ("+0", 0),
        ("-0", 0),
        ("0s", 0),
        ("0.s", 0),
        ("1ns", 1),
        ("1000000ns", 1),
        ("1000001ns", 2),
        ("1us", 1),
        ("1\u00b5s", 1),
        ("1\u03bcs", 1),
        ("999us", 1),
        ("1000us", 1),
        ("1001us", 2),
        ("1ms", 1),
        ("1.5ms", 2),
        ("1.0000001ms", 1),  # 1000000.1ns: Go truncates to whole ns first, so exactly 1ms
        ("1.000001ms", 2),  # 1000001ns: a real remainder rounds up
        ("1s", 1000),
        (".5s", 500),
        ("1.s", 1000),
        ("1.0s", 1000),
        ("0.001s", 1),
        ("0.0001s", 1),
        ("1.000000001s", 1001),
        ("90s", 90_000),
        ("1m", 60_000),
        ("1.5m", 90_000),
        ("1h", 3_600_000),
        ("1.5h", 5_400_000),
        ("1h30m", 5_400_000),
        ("1h30m0s", 5_400_000),
        ("2h45m30.5s", 9_930_500),
        ("1s1s", 2000),  # Go allows repeated and unordered units
        ("1ms1h", 3_600_001),
        ("+90s", 90_000),
        ("-1.5s", -1500),
        ("-1.5ms", -2),  # the magnitude rounds up: never towards zero
        ("-1ns", -1),
        ("000001s", 1000),
        ("1.50000000000000000000000000000000000000000000001s", 1500),
        ("2562047h47m16.854775807s", MAX_MS),
        ("9223372036854775807ns", MAX_MS),
        ("-2562047h47m16.854775808s", MIN_MS),
        ("-9223372036854775808ns", MIN_MS),
    ],
)
def test_parse_go_duration_valid(text: str, ms: int) -> None:
    assert parse_go_duration(text) == ms


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "nothing to read"),
        ("+", "nothing to read"),
        ("-", "nothing to read"),
        ("1", "missing unit"),
        ("00", "missing unit"),
        ("0.0", "missing unit"),
        ("1.5", "missing unit"),
        ("1h30", "missing unit"),
        ("1d", "unknown unit 'd'"),
        ("1S", "unknown unit 'S'"),
        ("1sec", "unknown unit 'sec'"),
        ("1e3s", "unknown unit 'e'"),
        ("1h 30m", "unknown unit 'h '"),
        ("1 s", "unknown unit ' s'"),
        ("1s ", "unknown unit 's '"),
        ("1s\n", "unknown unit"),
        ("1h-30m", "unknown unit 'h-'"),
        ("1_000s", "unknown unit '_'"),
        ("0x10s", "unknown unit 'x'"),
        ("1.2.3s", "missing unit"),
        (".s", "expected a number"),
        ("-.s", "expected a number"),
        ("s", "expected a number"),
        (" 1s", "expected a number"),
        ("--1s", "expected a number"),
        ("+-1s", "expected a number"),
        ("1s.", "expected a number"),
        ("NaN", "expected a number"),
        ("infs", "expected a number"),
        ("\u0661s", "expected a number"),  # ARABIC-INDIC DIGIT ONE: Go reads ASCII digits only
        ("2562047h47m16.854775808s", "too long"),
        ("9223372036854775808ns", "too long"),
        ("-9223372036854775809ns", "too long"),
        ("3000000h", "too long"),
        ("1" + "0" * 30 + "ns", "too long"),
        ("1" * 5000 + "s", "too long"),
    ],
)
def test_parse_go_duration_invalid(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=re.escape(reason)):
        parse_go_duration(text)


@pytest.mark.parametrize(
    ("text", "ms"),
    [
        ("0", 0),
        ("90", 90_000),
        ("+90", 90_000),
        ("-5", -5000),
        ("007", 7000),
        ("9223372036", 9_223_372_036_000),  # the largest whole seconds a Go duration holds
        ("1h30m", 5_400_000),
        ("90s", 90_000),
        ("1.5ms", 2),
    ],
)
def test_parse_duration_or_seconds_valid(text: str, ms: int) -> None:
    assert parse_duration_or_seconds(text) == ms


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "nothing to read"),
        ("1.5", "missing unit"),
        ("1d", "unknown unit 'd'"),
        (" 90", "expected a number"),
        ("9223372037", "too long"),
        ("9" * 5000, "too long"),
        ("\u0661", "expected a number"),
    ],
)
def test_parse_duration_or_seconds_invalid(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=re.escape(reason)):
        parse_duration_or_seconds(text)


@pytest.mark.parametrize(
    ("ms", "text"),
    [
        (0, "0s"),
        (1, "1ms"),
        (999, "999ms"),
        (1000, "1s"),
        (1500, "1.5s"),
        (1001, "1.001s"),
        (60_000, "1m0s"),
        (90_000, "1m30s"),
        (3_600_000, "1h0m0s"),
        (5_400_000, "1h30m0s"),
        (3_600_001, "1h0m0.001s"),
        (-1500, "-1.5s"),
        (-1, "-1ms"),
        (MAX_MS - 1, "2562047h47m16.854s"),
    ],
)
def test_format_go_duration(ms: int, text: str) -> None:
    assert format_go_duration(ms) == text


# MAX_MS - 1 is the largest whole-ms magnitude a Go duration holds (either sign).
@given(st.integers(min_value=-(MAX_MS - 1), max_value=MAX_MS - 1))
def test_format_then_parse_round_trips(ms: int) -> None:
    assert parse_go_duration(format_go_duration(ms)) == ms


@given(st.integers(min_value=-(2**63), max_value=MAX_NS))
def test_nanoseconds_round_up_to_ms(ns: int) -> None:
    assert parse_go_duration(f"{ns}ns") == ceil_ms(ns)


@given(st.integers(min_value=-9_223_372_036, max_value=9_223_372_036))
def test_whole_seconds_agree_with_seconds_unit(seconds: int) -> None:
    assert parse_duration_or_seconds(str(seconds)) == seconds * 1000 == parse_go_duration(f"{seconds}s")


# A component as Go writes it: digits before and/or after an optional dot, then a unit.
components = st.tuples(
    st.text("0123456789", max_size=8),
    st.none() | st.text("0123456789", max_size=12),
    st.sampled_from(sorted(NS_PER)),
).filter(lambda c: bool(c[0]) or bool(c[1]))


@given(st.sampled_from(["", "+", "-"]), st.lists(components, min_size=1, max_size=5))
def test_generated_durations_equal_independent_sum(
    sign: str, pieces: list[tuple[str, str | None, str]]
) -> None:
    text = sign + "".join(w + ("" if f is None else "." + f) + u for w, f, u in pieces)
    # Independently: each piece is an exact rational truncated to whole ns, as Go's Duration is.
    total_ns = sum(int(Fraction(f"{w or '0'}.{f or '0'}") * NS_PER[u]) for w, f, u in pieces)
    signed_ns = -total_ns if sign == "-" else total_ns
    if not -(2**63) <= signed_ns <= MAX_NS:
        with pytest.raises(ValueError, match="too long"):
            parse_go_duration(text)
    else:
        assert parse_go_duration(text) == ceil_ms(signed_ns)


@given(st.text())
def test_arbitrary_text_is_a_duration_or_value_error(text: str) -> None:
    try:
        result = parse_duration_or_seconds(text)
    except ValueError:
        return
    assert isinstance(result, int)
    assert MIN_MS <= result <= MAX_MS


@given(st.text(alphabet="0123456789.+-nsuµμmh ", max_size=20))
def test_near_miss_text_is_a_duration_or_value_error(text: str) -> None:
    # Biased towards the grammar's own characters, where the edge cases are.
    try:
        result = parse_go_duration(text)
    except ValueError:
        return
    assert MIN_MS <= result <= MAX_MS
