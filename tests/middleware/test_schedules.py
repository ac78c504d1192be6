"""Schedules: the grammar (tables of accepted and refused values), the cron calendar (a table and an
independent brute-force oracle under hypothesis), @every alignment without drift, and the missed-fires policy."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from delayed_middleware.clock import ManualClock
from delayed_middleware.errors import InvalidArgumentError, echo
from delayed_middleware.instants import MAX_INSTANT_MS, MIN_INSTANT_MS, format_instant, parse_instant
from delayed_middleware.schedules import (
    MIN_EVERY_MS,
    PURGE,
    NextFireMemo,
    Schedule,
    first_fire,
    following_fire,
    missed_fires,
    next_fire,
    parse_schedule,
    schedule_next_value,
)

NOW = parse_instant("2026-11-26T05:00:00Z")  # a Thursday
SECOND = 1000
MINUTE = 60 * SECOND
HOUR = 60 * MINUTE
DAY = 24 * HOUR
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def ms(text: str) -> int:
    return parse_instant(text)


def fires(expr: str, after: str, count: int) -> list[str]:
    """The next `count` fire times of a cron/@-shorthand schedule after `after`, as RFC 3339."""
    schedule = parse_schedule(expr, now_ms=NOW)
    out: list[str] = []
    cursor = ms(after)
    for _ in range(count):
        due = next_fire(schedule, start_ms=NOW, after_ms=cursor)
        assert due is not None
        out.append(format_instant(due))
        cursor = due
    return out


# ---------------------------------------------------------------------------------------------------------
# Grammar: what is accepted, and what it normalises to.


@pytest.mark.parametrize(
    ("expr", "kind", "normalised"),
    [
        ("@at 2045-11-05T08:15:30-05:00", "at", "@at 2045-11-05T13:15:30.000Z"),
        ("@at 2026-11-26T05:00:00.000000001Z", "at", "@at 2026-11-26T05:00:00.001Z"),
        ("@AT 2045-11-05T08:15:30Z", "at", "@at 2045-11-05T08:15:30.000Z"),
        ("@every 2s", "every", "@every 2s"),
        ("@every 90s", "every", "@every 1m30s"),
        ("@every 1h30m", "every", "@every 1h30m0s"),
        ("@every 1.5s", "every", "@every 1.5s"),
        ("@every 1000ms", "every", "@every 1s"),
        ("@every\t2s", "every", "@every 2s"),
        ("  @every   2s  ", "every", "@every 2s"),
        ("@Every 2s", "every", "@every 2s"),
        ("@yearly", "cron", "@yearly"),
        ("@annually", "cron", "@annually"),
        ("@monthly", "cron", "@monthly"),
        ("@weekly", "cron", "@weekly"),
        ("@daily", "cron", "@daily"),
        ("@midnight", "cron", "@midnight"),
        ("@hourly", "cron", "@hourly"),
        ("@HOURLY", "cron", "@hourly"),
        ("* * * * * *", "cron", "* * * * * *"),
        ("0 */5 * * * *", "cron", "0 */5 * * * *"),
        ("*/1 * * * * *", "cron", "* * * * * *"),  # */1 is plain *
        ("0 0 0-23/2 * * *", "cron", "0 0 0-23/2 * * *"),
        ("0 0 1/6 * * *", "cron", "0 0 1-23/6 * * *"),  # a/n = a-last/n
        ("0 0 0 * * 1/2", "cron", "0 0 0 * * 1-6/2"),  # day-of-week's last is 6 (7 is only an alias)
        ("0 0 0 * * 7/2", "cron", "0 0 0 * * 7"),
        ("0 0 0 1,15 * *", "cron", "0 0 0 1,15 * *"),
        ("0 0 0 1-5,10-12/2 * *", "cron", "0 0 0 1-5,10-12/2 * *"),
        ("0 0 0 * JAN-Mar mon-FRI", "cron", "0 0 0 * 1-3 1-5"),
        ("0 0 0 * dec sun", "cron", "0 0 0 * 12 0"),
        ("0 0 0 * * 7", "cron", "0 0 0 * * 7"),
        ("0 0 0 ? * mon", "cron", "0 0 0 * * 1"),
        ("0 0 0 1 * ?", "cron", "0 0 0 1 * *"),
        ("00 05 00 01 01 *", "cron", "0 5 0 1 1 *"),
        ("0 0 0 5-5 * *", "cron", "0 0 0 5 * *"),
        ("  0   0\t0 * * *\n", "cron", "0 0 0 * * *"),
        ("59 59 23 31 12 6", "cron", "59 59 23 31 12 6"),
        # both day fields restricted, one of them every day: the either rule makes it every day
        ("0 0 0 */2 * 0-6", "cron", "0 0 0 * * *"),
        ("0 0 0 */2 * sun-sat", "cron", "0 0 0 * * *"),
        ("0 0 0 15 * 1-7", "cron", "0 0 0 * * *"),
        ("0 0 0 1-31 * mon", "cron", "0 0 0 * * *"),
        ("0 0 0 */2 * 0,1,2,3,4,5,6", "cron", "0 0 0 * * *"),
        ("0 0 0 1-31 * *", "cron", "0 0 0 1-31 * *"),  # only one restricted: nothing to fold
        ("0 0 0 */2 * 1-6", "cron", "0 0 0 */2 * 1-6"),
    ],
)
def test_accepted(expr: str, kind: str, normalised: str) -> None:
    schedule = parse_schedule(expr, now_ms=NOW)
    assert (schedule.kind, schedule.expr) == (kind, normalised)
    assert schedule.recurring == (kind != "at")
    # The normalised form is what the engine stores and re-parses at every fire.
    assert parse_schedule(schedule.expr, now_ms=NOW) == schedule


@pytest.mark.parametrize(
    ("expr", "reason"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("@foo", "unknown form '@foo'"),
        ("@reboot", "unknown form"),
        ("@every", "@every needs a Go duration"),
        ("@every 2", "missing unit"),
        ("@every two seconds", "not a duration"),
        ("@every 0", "shorter than the minimum of 1s"),
        ("@every 0s", "shorter than the minimum of 1s"),
        ("@every -5s", "shorter than the minimum of 1s"),
        ("@every 999ms", "shorter than the minimum of 1s"),
        ("@every 1ns", "shorter than the minimum of 1s"),
        ("@every 9223372036854775808ns", "beyond ~292 years"),
        ("@every 99999999999999999999999h", "beyond ~292 years"),
        ("@every 1s 2s", "unknown unit"),
        ("@at", "@at needs an RFC 3339 instant"),
        ("@at tomorrow", "not an RFC 3339 instant"),
        ("@at 2045-11-05T08:15:30", "needs a UTC offset"),
        ("@at 2045-02-30T08:15:30Z", "day 30 is out of range"),
        ("@at 10000-01-01T00:00:00Z", "not an RFC 3339 instant"),
        ("@at 9999-12-31T23:59:59-01:00", "outside years 0001-9999"),
        ("@daily 0", "takes nothing after it"),
        ("* * * * *", "got 5; seconds come first: for the classic 5-field form write '0 * * * * *'"),
        ("* * * * * * *", "got 7"),
        ("0", "got 1"),
        ("60 * * * * *", "second '60': 60 is outside 0-59"),
        ("* 60 * * * *", "minute '60': 60 is outside 0-59"),
        ("* * 24 * * *", "hour '24': 24 is outside 0-23"),
        ("* * * 0 * *", "day-of-month '0': 0 is outside 1-31"),
        ("* * * 32 * *", "day-of-month '32': 32 is outside 1-31"),
        ("* * * * 0 *", "month '0': 0 is outside 1-12"),
        ("* * * * 13 *", "month '13': 13 is outside 1-12"),
        ("* * * * * 8", "day-of-week '8': 8 is outside 0-7"),
        ("-1 * * * * *", "expected '*', a value"),
        ("*/0 * * * * *", "step 0 is outside 1-60"),
        ("*/61 * * * * *", "step 61 is outside 1-60"),
        ("0 0 0 * * */8", "step 8 is outside 1-7"),
        ("5-1 * * * * *", "range 5-1 runs backwards"),
        ("0 0 0 * * fri-mon", "range fri-mon runs backwards"),
        ("0 0 0 * nov-feb *", "range nov-feb runs backwards"),
        ("1-2-3 * * * * *", "expected '*', a value"),
        ("*/2/3 * * * * *", "expected '*', a value"),
        ("1, * * * * *", "expected '*', a value"),
        (",1 * * * * *", "expected '*', a value"),
        ("1,,2 * * * * *", "expected '*', a value"),
        ("** * * * * *", "expected '*', a value"),
        ("*,5 * * * * *", "'*' already means every value"),
        ("? * * * * *", "'?' is only allowed in the day fields"),
        ("0 0 0 * jan *x", "expected '*', a value"),
        ("0 0 0 * * monday", "'monday' is not a number or a name"),
        ("0 0 0 * foo *", "'foo' is not a number or a name"),
        ("0 0 0 mon * *", "'mon' is not a number"),  # names belong to their field only
        ("0 0 0 * * jan", "'jan' is not a number or a name"),
        ("0 0 0 L * *", "'l' is not a number"),  # Quartz extensions are not cron (nor NATS)
        ("0 0 0 15W * *", "expected '*', a value"),
        ("0 0 0 * * 1#2", "expected '*', a value"),
        ("0 0 0 * * 5L", "expected '*', a value"),
        ("H * * * * *", "'h' is not a number"),
        ("0 0 0 \u0661 * *", "expected '*', a value"),  # ARABIC-INDIC DIGIT ONE is not a digit here
        ("1000 * * * * *", "value 1000 is too large"),
        ("9" * 5000 + " * * * * *", "longer than the maximum"),
        ("0 0 0 30 2 *", "never fires"),
        ("0 0 0 31 4,6,9,11 *", "never fires"),
        ("0 0 0 31 2 ?", "never fires"),
    ],
)
def test_refused(expr: str, reason: str) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        parse_schedule(expr, now_ms=NOW)
    assert caught.value.key == "schedule"
    assert caught.value.value == expr
    assert reason in caught.value.reason
    # The message a publisher sees names the key and the value.
    assert str(caught.value).startswith(f"invalid metadata schedule={echo(expr)}: ")


def test_recurring_schedule_that_only_fires_after_year_9999_is_refused() -> None:
    late = ms("9999-12-31T23:59:59Z")
    with pytest.raises(InvalidArgumentError, match="never fires"):
        parse_schedule("0 0 0 1 1 *", now_ms=late)
    with pytest.raises(InvalidArgumentError, match="never fires"):
        parse_schedule("@every 2s", now_ms=late)
    # An @at stays valid whatever the clock says: past means "at once".
    assert parse_schedule("@at 2020-01-01T00:00:00Z", now_ms=late).at_ms == ms("2020-01-01T00:00:00Z")


@pytest.mark.parametrize("text", ["CRON_TZ=", "CRON_TZ= ", " CRON_TZ=\t"])
def test_a_cron_tz_prefix_naming_no_zone_is_an_invalid_argument_saying_so(text: str) -> None:
    # Found by the property below: it escaped as a ValueError (INTERNAL at the gRPC edge).
    with pytest.raises(InvalidArgumentError) as refused:
        parse_schedule(text, now_ms=NOW)
    assert (refused.value.key, refused.value.value) == ("schedule", text)
    assert "CRON_TZ= names no time zone" in str(refused.value)


@given(st.text(max_size=80))
def test_any_text_is_a_schedule_or_an_invalid_argument(text: str) -> None:
    # Nothing a publisher sends may escape as another exception (INTERNAL at the gRPC edge).
    refused: InvalidArgumentError | None = None
    try:
        schedule = parse_schedule(text, now_ms=NOW)
    except InvalidArgumentError as exc:
        refused = exc
    if refused is not None:
        assert (refused.key, refused.value) == ("schedule", text)
    else:
        assert parse_schedule(schedule.expr, now_ms=NOW) == schedule


@given(
    st.lists(
        st.sampled_from(
            ["*", "?", "*/2", "1-5", "mon", "JAN", "0", "7", "59", "1/3", "L", "-", "/", ",", "#"]
        ),
        min_size=1,
        max_size=8,
    ).map(" ".join)
)
def test_cron_shaped_text_is_a_schedule_or_an_invalid_argument(text: str) -> None:
    refused: InvalidArgumentError | None = None
    try:
        schedule = parse_schedule(text, now_ms=NOW)
    except InvalidArgumentError as exc:
        refused = exc
    if refused is not None:
        assert refused.key == "schedule"
    else:
        assert schedule.kind == "cron"
        due = first_fire(schedule, now_ms=NOW)
        assert due is not None
        assert due > NOW


# ---------------------------------------------------------------------------------------------------------
# The cron calendar, as a table. Weekdays checked by hand: 2026-11-26 is a Thursday, 2024-01-01 a Monday.


@pytest.mark.parametrize(
    ("expr", "after", "expected"),
    [
        # every second, every 15 s, every 5 min, the turn of a minute, hour, day, year
        ("* * * * * *", "2026-11-26T05:00:00Z", ["2026-11-26T05:00:01.000Z", "2026-11-26T05:00:02.000Z"]),
        ("* * * * * *", "2026-11-26T05:00:00.999Z", ["2026-11-26T05:00:01.000Z", "2026-11-26T05:00:02.000Z"]),
        (
            "*/15 * * * * *",
            "2026-11-26T05:00:44Z",
            ["2026-11-26T05:00:45.000Z", "2026-11-26T05:01:00.000Z", "2026-11-26T05:01:15.000Z"],
        ),
        (
            "0 */5 * * * *",
            "2026-11-26T05:58:00Z",
            ["2026-11-26T06:00:00.000Z", "2026-11-26T06:05:00.000Z"],
        ),
        ("59 59 23 31 12 *", "2026-12-31T23:59:59Z", ["2027-12-31T23:59:59.000Z"]),
        ("0 0 0 1 1 *", "2026-11-26T05:00:00Z", ["2027-01-01T00:00:00.000Z", "2028-01-01T00:00:00.000Z"]),
        # strictly after: a fire at exactly `after` is not returned
        ("0 0 5 * * *", "2026-11-26T05:00:00Z", ["2026-11-27T05:00:00.000Z"]),
        ("0 0 5 * * *", "2026-11-26T04:59:59.999Z", ["2026-11-26T05:00:00.000Z"]),
        # ranges, lists, steps over a range, a/n, and combinations
        (
            "0 0 0-23/2 * * *",
            "2026-11-26T21:00:00Z",
            ["2026-11-26T22:00:00.000Z", "2026-11-27T00:00:00.000Z", "2026-11-27T02:00:00.000Z"],
        ),
        (
            "0 0 1/6 * * *",
            "2026-11-26T08:00:00Z",
            ["2026-11-26T13:00:00.000Z", "2026-11-26T19:00:00.000Z", "2026-11-27T01:00:00.000Z"],
        ),
        (
            "30 15,45 9-10 * * *",
            "2026-11-26T09:20:00Z",
            ["2026-11-26T09:45:30.000Z", "2026-11-26T10:15:30.000Z", "2026-11-26T10:45:30.000Z"],
        ),
        (
            "0 0 12 1-5,10-14/2 * *",
            "2026-12-04T12:00:00Z",
            ["2026-12-05T12:00:00.000Z", "2026-12-10T12:00:00.000Z", "2026-12-12T12:00:00.000Z"],
        ),
        # month names, any case; a range of months
        (
            "0 0 0 1 JAN-mar *",
            "2026-11-26T05:00:00Z",
            ["2027-01-01T00:00:00.000Z", "2027-02-01T00:00:00.000Z", "2027-03-01T00:00:00.000Z"],
        ),
        # weekdays: names, numbers, 0 and 7 both Sunday (2026-11-29 is a Sunday)
        ("0 0 0 * * sun", "2026-11-26T05:00:00Z", ["2026-11-29T00:00:00.000Z", "2026-12-06T00:00:00.000Z"]),
        ("0 0 0 * * 0", "2026-11-26T05:00:00Z", ["2026-11-29T00:00:00.000Z", "2026-12-06T00:00:00.000Z"]),
        ("0 0 0 * * 7", "2026-11-26T05:00:00Z", ["2026-11-29T00:00:00.000Z", "2026-12-06T00:00:00.000Z"]),
        (
            "0 0 9 * * Mon-Fri",
            "2026-11-27T10:00:00Z",  # a Friday after 09:00: next is Monday
            ["2026-11-30T09:00:00.000Z", "2026-12-01T09:00:00.000Z"],
        ),
        (
            "0 0 0 * * 5-7",
            "2026-11-26T05:00:00Z",
            ["2026-11-27T00:00:00.000Z", "2026-11-28T00:00:00.000Z", "2026-11-29T00:00:00.000Z"],
        ),
        (
            "0 0 0 * * sat,SUN",
            "2026-11-26T05:00:00Z",
            ["2026-11-28T00:00:00.000Z", "2026-11-29T00:00:00.000Z", "2026-12-05T00:00:00.000Z"],
        ),
        # */2 over weekdays is 0,2,4,6: Sun, Tue, Thu, Sat
        (
            "0 0 0 * * */2",
            "2026-11-26T05:00:00Z",
            ["2026-11-28T00:00:00.000Z", "2026-11-29T00:00:00.000Z", "2026-12-01T00:00:00.000Z"],
        ),
        # the crontab(5) rule: both day fields restricted -> either fires (the 13th OR a Friday)
        (
            "0 0 12 13 * 5",
            "2024-01-01T00:00:00Z",
            [
                "2024-01-05T12:00:00.000Z",
                "2024-01-12T12:00:00.000Z",
                "2024-01-13T12:00:00.000Z",
                "2024-01-19T12:00:00.000Z",
            ],
        ),
        # ... the 1st OR a Monday (2024-01-01 is a Monday; Feb 1 a Thursday)
        (
            "0 0 0 1 * mon",
            "2024-01-28T00:00:00Z",
            ["2024-01-29T00:00:00.000Z", "2024-02-01T00:00:00.000Z", "2024-02-05T00:00:00.000Z"],
        ),
        # ... one day field restricted, the other '*' or '?': only the restricted one counts
        ("0 0 0 13 * *", "2024-01-01T00:00:00Z", ["2024-01-13T00:00:00.000Z", "2024-02-13T00:00:00.000Z"]),
        ("0 0 0 13 * ?", "2024-01-01T00:00:00Z", ["2024-01-13T00:00:00.000Z", "2024-02-13T00:00:00.000Z"]),
        ("0 0 0 ? * fri", "2024-01-01T00:00:00Z", ["2024-01-05T00:00:00.000Z", "2024-01-12T00:00:00.000Z"]),
        # ... odd days OR any day of the week (0-6, restricted): every day
        (
            "0 0 0 */2 * 0-6",
            "2024-01-01T00:00:00Z",
            ["2024-01-02T00:00:00.000Z", "2024-01-03T00:00:00.000Z", "2024-01-04T00:00:00.000Z"],
        ),
        # ... */1 is '*' (unrestricted), so this is the 1st of each month only, not every day
        ("0 0 0 1 * */1", "2024-01-01T00:00:00Z", ["2024-02-01T00:00:00.000Z", "2024-03-01T00:00:00.000Z"]),
        # ... */2 in day-of-month is restricted: odd days OR Mondays
        (
            "0 0 0 */2 * mon",
            "2024-01-01T00:00:00Z",
            [
                "2024-01-03T00:00:00.000Z",
                "2024-01-05T00:00:00.000Z",
                "2024-01-07T00:00:00.000Z",
                "2024-01-08T00:00:00.000Z",
                "2024-01-09T00:00:00.000Z",
            ],
        ),
        # month ends: the 31st skips 30-day months and February
        (
            "0 0 0 31 * *",
            "2024-01-31T00:00:00Z",
            [
                "2024-03-31T00:00:00.000Z",
                "2024-05-31T00:00:00.000Z",
                "2024-07-31T00:00:00.000Z",
                "2024-08-31T00:00:00.000Z",
                "2024-10-31T00:00:00.000Z",
                "2024-12-31T00:00:00.000Z",
            ],
        ),
        ("0 0 0 30 * *", "2024-01-30T00:00:00Z", ["2024-03-30T00:00:00.000Z", "2024-04-30T00:00:00.000Z"]),
        ("0 0 0 29 * *", "2023-01-29T00:00:00Z", ["2023-03-29T00:00:00.000Z"]),  # no Feb 29 in 2023
        ("0 0 0 29 * *", "2024-01-29T00:00:00Z", ["2024-02-29T00:00:00.000Z", "2024-03-29T00:00:00.000Z"]),
        # leap years: Feb 29 every 4 years, 2100 is not one (8-year gap), 2000 was
        (
            "0 0 0 29 2 *",
            "2024-02-29T00:00:00Z",
            ["2028-02-29T00:00:00.000Z", "2032-02-29T00:00:00.000Z"],
        ),
        ("0 0 0 29 feb *", "2096-03-01T00:00:00Z", ["2104-02-29T00:00:00.000Z"]),
        ("0 0 0 29 2 *", "1999-01-01T00:00:00Z", ["2000-02-29T00:00:00.000Z", "2004-02-29T00:00:00.000Z"]),
        # Feb 29 OR a Monday: both restricted, so Mondays of February fire in non-leap years
        (
            "0 0 0 29 2 mon",
            "2026-11-26T05:00:00Z",
            ["2027-02-01T00:00:00.000Z", "2027-02-08T00:00:00.000Z"],
        ),
        # the last day of February in and out of leap years, through a list of days
        ("0 0 0 28,29 2 *", "2025-03-01T00:00:00Z", ["2026-02-28T00:00:00.000Z", "2027-02-28T00:00:00.000Z"]),
        ("0 0 0 28,29 2 *", "2027-03-01T00:00:00Z", ["2028-02-28T00:00:00.000Z", "2028-02-29T00:00:00.000Z"]),
        # UTC, no DST: 02:30 exists every day, including the nights clocks change in Europe and the US
        (
            "0 30 2 * * *",
            "2024-03-30T12:00:00Z",
            ["2024-03-31T02:30:00.000Z", "2024-04-01T02:30:00.000Z"],
        ),
        (
            "0 30 1 * * *",
            "2024-10-26T12:00:00Z",
            ["2024-10-27T01:30:00.000Z", "2024-10-28T01:30:00.000Z"],
        ),
        ("0 0 2 10 3 *", "2024-03-01T00:00:00Z", ["2024-03-10T02:00:00.000Z"]),  # US spring-forward night
        # the shorthands
        ("@yearly", "2026-11-26T05:00:00Z", ["2027-01-01T00:00:00.000Z", "2028-01-01T00:00:00.000Z"]),
        ("@annually", "2026-11-26T05:00:00Z", ["2027-01-01T00:00:00.000Z"]),
        ("@monthly", "2026-11-26T05:00:00Z", ["2026-12-01T00:00:00.000Z", "2027-01-01T00:00:00.000Z"]),
        ("@weekly", "2026-11-26T05:00:00Z", ["2026-11-29T00:00:00.000Z", "2026-12-06T00:00:00.000Z"]),
        ("@daily", "2026-11-26T05:00:00Z", ["2026-11-27T00:00:00.000Z", "2026-11-28T00:00:00.000Z"]),
        ("@midnight", "2026-11-26T23:59:59.999Z", ["2026-11-27T00:00:00.000Z"]),
        ("@hourly", "2026-11-26T05:00:00Z", ["2026-11-26T06:00:00.000Z", "2026-11-26T07:00:00.000Z"]),
        # before the epoch works too
        ("0 0 0 1 1 *", "1969-06-01T00:00:00Z", ["1970-01-01T00:00:00.000Z"]),
    ],
)
def test_cron_table(expr: str, after: str, expected: list[str]) -> None:
    assert fires(expr, after, len(expected)) == expected


def test_cron_at_the_end_of_year_9999_has_no_next_fire() -> None:
    schedule = parse_schedule("59 59 23 31 12 *", now_ms=NOW)
    last = ms("9999-12-31T23:59:59Z")
    assert next_fire(schedule, start_ms=NOW, after_ms=last - 1) == last
    assert next_fire(schedule, start_ms=NOW, after_ms=last) is None
    leap = parse_schedule("0 0 0 29 2 *", now_ms=NOW)
    assert next_fire(leap, start_ms=NOW, after_ms=ms("9996-03-01T00:00:00Z")) is None
    every_second = parse_schedule("* * * * * *", now_ms=NOW)
    assert next_fire(every_second, start_ms=NOW, after_ms=MAX_INSTANT_MS) is None
    assert next_fire(every_second, start_ms=NOW, after_ms=2**63) is None


def test_cron_does_not_depend_on_the_servers_time_zone(monkeypatch: pytest.MonkeyPatch) -> None:
    schedule = parse_schedule("0 30 2 * * *", now_ms=NOW)
    after = ms("2024-03-30T12:00:00Z")
    in_utc = next_fire(schedule, start_ms=NOW, after_ms=after)
    for zone in ("Europe/Berlin", "America/New_York", "Asia/Kolkata"):
        monkeypatch.setenv("TZ", zone)
        time.tzset()
        assert next_fire(schedule, start_ms=NOW, after_ms=after) == in_utc == ms("2024-03-31T02:30:00Z")
    monkeypatch.delenv("TZ")
    time.tzset()
    assert "TZ" not in os.environ


# ---------------------------------------------------------------------------------------------------------
# Cron against an independent oracle: field sets drawn by hypothesis, written out in random syntax,
# parsed, and next_fire compared with a brute-force search over the calendar.


@dataclass(frozen=True)
class FieldSpec:
    low: int
    high: int  # highest value a user may write (7 for day-of-week)
    open_high: int  # where '*' and 'a/n' stop (6 for day-of-week)
    names: tuple[str, ...] = ()  # names[i] is the value low + i


SPECS = (
    FieldSpec(0, 59, 59),
    FieldSpec(0, 59, 59),
    FieldSpec(0, 23, 23),
    FieldSpec(1, 31, 31),
    FieldSpec(
        1, 12, 12, ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
    ),
    FieldSpec(0, 7, 6, ("sun", "mon", "tue", "wed", "thu", "fri", "sat")),
)


@dataclass(frozen=True)
class DrawnField:
    text: str
    values: frozenset[int]
    restricted: bool  # not '*' / '?' / '*/1'


@st.composite
def drawn_field(draw: st.DrawFn, spec: FieldSpec, day_field: bool) -> DrawnField:
    def token(value: int) -> str:
        if spec.names and value - spec.low < len(spec.names) and draw(st.booleans()):
            name = spec.names[value - spec.low]
            return draw(st.sampled_from([name, name.upper(), name.capitalize()]))
        return str(value)

    if draw(st.integers(0, 5)) == 0:
        step = draw(st.sampled_from([1, 1, 2, 3, 5, spec.open_high - spec.low + 1]))
        star = draw(st.sampled_from(["*", "?"] if day_field else ["*"]))
        # "*/1" is written out sometimes: it must mean '*', unrestricted.
        text = star if step == 1 and draw(st.booleans()) else f"{star}/{step}"
        return DrawnField(text, frozenset(range(spec.low, spec.open_high + 1, step)), restricted=step != 1)

    items: list[str] = []
    values: set[int] = set()
    for _ in range(draw(st.integers(1, 3))):
        start = draw(st.integers(spec.low, spec.high))
        form = draw(st.sampled_from(["value", "range", "range/step", "open/step"]))
        if form == "value":
            items.append(token(start))
            values.add(start)
        elif form == "range":
            end = draw(st.integers(start, spec.high))
            items.append(f"{token(start)}-{token(end)}")
            values.update(range(start, end + 1))
        elif form == "range/step":
            end = draw(st.integers(start, spec.high))
            step = draw(st.integers(1, spec.open_high - spec.low + 1))
            items.append(f"{token(start)}-{token(end)}/{step}")
            values.update(range(start, end + 1, step))
        else:
            step = draw(st.integers(1, spec.open_high - spec.low + 1))
            items.append(f"{token(start)}/{step}")
            values.update(range(start, max(spec.open_high, start) + 1, step))
    return DrawnField(",".join(items), frozenset(values), restricted=True)


@st.composite
def drawn_cron(draw: st.DrawFn) -> tuple[DrawnField, ...]:
    return tuple(draw(drawn_field(spec, day_field=i in (3, 5))) for i, spec in enumerate(SPECS))


def oracle_next(fields: tuple[DrawnField, ...], after_ms: int) -> int | None:
    """The first second after `after_ms` matching the fields: a plain calendar walk, no croniter."""
    seconds, minutes, hours, doms, months, dows = (f.values for f in fields)
    dows = frozenset(0 if d == 7 else d for d in dows)
    either = fields[3].restricted and fields[5].restricted
    start = EPOCH + timedelta(seconds=after_ms // 1000 + 1)
    day = start.date()
    floor = (start.hour, start.minute, start.second)
    for _ in range(366 * 12):
        dom_ok = day.day in doms
        dow_ok = day.isoweekday() % 7 in dows
        if day.month in months and ((dom_ok or dow_ok) if either else (dom_ok and dow_ok)):
            for h in sorted(hours):
                for m in sorted(minutes):
                    for s in sorted(seconds):
                        if (h, m, s) >= floor:
                            found = datetime(day.year, day.month, day.day, h, m, s, tzinfo=UTC)
                            return (found - EPOCH) // timedelta(milliseconds=1)
        day += timedelta(days=1)
        floor = (0, 0, 0)
    return None


@settings(max_examples=300, deadline=None)
@given(drawn_cron(), st.integers(ms("1990-01-01T00:00:00Z"), ms("2300-01-01T00:00:00Z")))
def test_cron_matches_the_oracle(fields: tuple[DrawnField, ...], after_ms: int) -> None:
    text = " ".join(f.text for f in fields)
    expected = oracle_next(fields, after_ms)
    refused: InvalidArgumentError | None = None
    try:
        schedule = parse_schedule(text, now_ms=after_ms)
    except InvalidArgumentError as exc:
        refused = exc
    if refused is not None:
        # Only refused when nothing ever matches (e.g. Feb 30): the oracle agrees.
        assert "never fires" in refused.reason, refused
        assert expected is None
        return
    assert schedule.kind == "cron"
    due = next_fire(schedule, start_ms=after_ms, after_ms=after_ms)
    assert due == expected, text
    # And the normalised form means the same.
    renormalised = parse_schedule(schedule.expr, now_ms=after_ms)
    assert next_fire(renormalised, start_ms=after_ms, after_ms=after_ms) == due


CRON_SAMPLES = st.sampled_from(
    [
        "* * * * * *",
        "*/7 * * * * *",
        "0 */5 * * * *",
        "0 0 0-23/2 * * *",
        "0 0 12 13 * 5",
        "0 0 0 31 * *",
        "0 0 0 29 2 *",
        "0 0 9 * * mon-fri",
        "@hourly",
        "@weekly",
        "@monthly",
        "@yearly",
        "0 30 2 * * *",
    ]
)
INSTANTS = st.integers(ms("1971-01-01T00:00:00Z"), ms("2400-01-01T00:00:00Z"))


@settings(deadline=None)
@given(CRON_SAMPLES, INSTANTS, INSTANTS)
def test_cron_next_fire_is_after_aligned_and_monotonic(expr: str, a: int, b: int) -> None:
    schedule = parse_schedule(expr, now_ms=NOW)
    lo, hi = sorted((a, b))
    due_lo = next_fire(schedule, start_ms=NOW, after_ms=lo)
    due_hi = next_fire(schedule, start_ms=NOW, after_ms=hi)
    assert due_lo is not None
    assert due_hi is not None
    assert due_lo > lo
    assert due_hi > hi
    assert due_lo % 1000 == 0  # cron fires on whole seconds
    assert due_lo <= due_hi  # monotonic
    # Nothing is skipped: any instant before the next fire leads to that same fire.
    middle = lo + (due_lo - lo) // 2
    assert next_fire(schedule, start_ms=NOW, after_ms=middle) == due_lo
    assert next_fire(schedule, start_ms=NOW, after_ms=due_lo - 1) == due_lo


@given(st.integers(-(2**64), 2**64), st.integers(-(2**64), 2**64))
def test_next_fire_never_raises_for_any_instant(start: int, after: int) -> None:
    # Values of 2^63 and beyond (and before year 1) answer None or a fire, never an exception.
    for schedule in (
        parse_schedule("* * * * * *", now_ms=NOW),
        parse_schedule("@every 1s", now_ms=NOW),
        parse_schedule("@at 2030-01-01T00:00:00Z", now_ms=NOW),
    ):
        due = next_fire(schedule, start_ms=start, after_ms=after)
        assert due is None or (after < due <= MAX_INSTANT_MS)


# ---------------------------------------------------------------------------------------------------------
# @every: aligned to the acceptance instant, no drift.


def test_every_fires_at_whole_intervals_from_its_start() -> None:
    schedule = parse_schedule("@every 2s", now_ms=NOW)
    assert schedule.interval_ms == 2000
    assert first_fire(schedule, now_ms=NOW) == NOW + 2000
    assert next_fire(schedule, start_ms=NOW, after_ms=NOW) == NOW + 2000
    assert next_fire(schedule, start_ms=NOW, after_ms=NOW + 1999) == NOW + 2000
    assert next_fire(schedule, start_ms=NOW, after_ms=NOW + 2000) == NOW + 4000  # strictly after
    assert next_fire(schedule, start_ms=NOW, after_ms=NOW + 2001) == NOW + 4000
    # Asked before its start, it still answers its first fire, never the start itself.
    assert next_fire(schedule, start_ms=NOW, after_ms=NOW - DAY) == NOW + 2000
    # The start need not be a whole second: the phase is the acceptance instant's.
    assert next_fire(schedule, start_ms=NOW + 123, after_ms=NOW + 5000) == NOW + 6123


def test_every_does_not_drift_over_1000_late_fires() -> None:
    # The engine's loop, with an injected clock: each fire happens late by up to 900 ms (a slow
    # replica, GC, a busy Redis), and the next due time is computed from the late "now". The
    # 1000th fire is still due exactly start + 1000 intervals: lateness never accumulates.
    clock = ManualClock(start_ms=NOW + 7)
    start = clock.now_ms()
    schedule = parse_schedule("@every 1.5s", now_ms=start)
    due = first_fire(schedule, now_ms=start)
    lateness = [0, 1, 899, 450, 900, 3, 777]
    dues: list[int] = []
    for i in range(1000):
        assert due is not None
        clock.set(due + lateness[i % len(lateness)])
        dues.append(due)
        due = following_fire(schedule, start_ms=start, due_ms=due, now_ms=clock.now_ms())
    assert dues[-1] == start + 1000 * 1500
    assert dues == [start + k * 1500 for k in range(1, 1001)]
    assert due == start + 1001 * 1500


@settings(deadline=None)
@given(
    st.integers(MIN_EVERY_MS, 10 * DAY),
    st.integers(ms("1971-01-01T00:00:00Z"), ms("2400-01-01T00:00:00Z")),
    st.integers(0, 10**12),
)
def test_every_next_fire_is_the_first_aligned_instant_after(interval: int, start: int, offset: int) -> None:
    schedule = Schedule(kind="every", expr="@every", interval_ms=interval)
    after = start + offset
    due = next_fire(schedule, start_ms=start, after_ms=after)
    assert due is not None
    assert due > after
    assert (due - start) % interval == 0
    assert due - start >= interval
    assert due - interval <= max(after, start)  # the first such instant


def test_every_at_the_end_of_year_9999() -> None:
    schedule = parse_schedule("@every 1h", now_ms=NOW)
    start = MAX_INSTANT_MS - HOUR - 5
    assert next_fire(schedule, start_ms=start, after_ms=start) == MAX_INSTANT_MS - 5
    assert next_fire(schedule, start_ms=start, after_ms=MAX_INSTANT_MS - 5) is None


# ---------------------------------------------------------------------------------------------------------
# @at: one-shot.


def test_at_fires_once_at_its_instant_or_at_once_if_past() -> None:
    future = parse_schedule("@at 2045-11-05T08:15:30-05:00", now_ms=NOW)
    at = ms("2045-11-05T13:15:30Z")
    assert first_fire(future, now_ms=NOW) == at
    assert next_fire(future, start_ms=NOW, after_ms=NOW) == at
    assert next_fire(future, start_ms=NOW, after_ms=at) is None  # fired: nothing follows
    assert following_fire(future, start_ms=NOW, due_ms=at, now_ms=at + 5) is None
    past = parse_schedule("@at 2001-01-01T00:00:00Z", now_ms=NOW)
    assert first_fire(past, now_ms=NOW) == NOW  # like scheduledSendTime: past means at once
    assert next_fire(past, start_ms=NOW, after_ms=NOW) is None


def test_schedule_next_value() -> None:
    assert schedule_next_value(None) == PURGE == "purge"
    assert schedule_next_value(ms("2026-11-26T05:00:02Z")) == "2026-11-26T05:00:02.000Z"
    # It is an instant a publisher can feed back into scheduledSendTime.
    assert parse_instant(schedule_next_value(NOW + 1)) == NOW + 1


# ---------------------------------------------------------------------------------------------------------
# Missed fires: the component or Redis down across several fire times fires once, then continues.


def test_outage_across_many_every_fires_fires_once_then_stays_aligned() -> None:
    schedule = parse_schedule("@every 2s", now_ms=NOW)
    due = NOW + 2000
    back = due + 10 * 2000 + 700  # down for ten more occurrences and a bit
    following = following_fire(schedule, start_ms=NOW, due_ms=due, now_ms=back)
    assert following == NOW + 12 * 2000  # the first aligned occurrence after recovery
    assert missed_fires(schedule, start_ms=NOW, due_ms=due, now_ms=back) == 10
    # On time: nothing skipped, the very next occurrence follows.
    assert following_fire(schedule, start_ms=NOW, due_ms=due, now_ms=due + 3) == due + 2000
    assert missed_fires(schedule, start_ms=NOW, due_ms=due, now_ms=due + 3) == 0


def test_outage_across_cron_fires_fires_once_then_continues() -> None:
    schedule = parse_schedule("0 * * * * *", now_ms=NOW)  # every minute
    due = ms("2026-11-26T05:01:00Z")
    back = ms("2026-11-26T06:30:10Z")
    assert following_fire(schedule, start_ms=NOW, due_ms=due, now_ms=back) == ms("2026-11-26T06:31:00Z")
    assert missed_fires(schedule, start_ms=NOW, due_ms=due, now_ms=back) == 89  # 05:02 .. 06:30
    assert missed_fires(schedule, start_ms=NOW, due_ms=due, now_ms=back, limit=10) == 10


def test_engine_loop_over_an_outage_never_storms() -> None:
    # The engine's loop: fire what is due, reschedule with following_fire. Across a 1-hour outage of
    # an @every 1s schedule, recovery produces exactly one fire, then one per second again.
    clock = ManualClock(start_ms=NOW)
    schedule = parse_schedule("@every 1s", now_ms=NOW)
    due = first_fire(schedule, now_ms=NOW)
    fired: list[int] = []

    def run_until(end_ms: int) -> Iterator[int]:
        nonlocal due
        while due is not None and due <= end_ms:
            clock.set(max(clock.now_ms(), due))
            yield clock.now_ms()
            due = following_fire(schedule, start_ms=NOW, due_ms=due, now_ms=clock.now_ms())

    fired += run_until(NOW + 5000)  # five fires
    clock.set(NOW + 5000 + HOUR + 250)  # outage: nobody fires for an hour
    fired += run_until(clock.now_ms())  # recovery: the overdue occurrence fires once
    fired += run_until(NOW + 5000 + HOUR + 3000)
    assert fired[:5] == [NOW + k * 1000 for k in range(1, 6)]
    assert fired[5] == NOW + 5000 + HOUR + 250  # once, late
    assert fired[6:] == [NOW + 5000 + HOUR + k * 1000 for k in range(1, 4)]  # back on the grid


def test_missed_fires_is_zero_for_one_shots_and_on_time() -> None:
    at = parse_schedule("@at 2030-01-01T00:00:00Z", now_ms=NOW)
    assert missed_fires(at, start_ms=NOW, due_ms=NOW, now_ms=NOW + DAY) == 0
    every = parse_schedule("@every 1m", now_ms=NOW)
    assert missed_fires(every, start_ms=NOW, due_ms=NOW + MINUTE, now_ms=NOW + MINUTE) == 0


# ---------------------------------------------------------------------------------------------------------
# Bounds


def test_instant_bounds_are_years_1_to_9999() -> None:
    assert format_instant(MIN_INSTANT_MS) == "0001-01-01T00:00:00.000Z"
    assert date(9999, 12, 31).isoformat() in format_instant(MAX_INSTANT_MS)


@settings(deadline=None, max_examples=200)
@given(
    CRON_SAMPLES | st.sampled_from(["@every 1s", "@every 7s", "@at 2030-01-01T00:00:00Z"]),
    INSTANTS,
    st.integers(0, 10 * DAY),
)
def test_memo_gives_the_same_answers_as_following_fire(expr: str, due: int, lag: int) -> None:
    schedule = parse_schedule(expr, now_ms=NOW)
    memo = NextFireMemo(max_entries=3)
    for now in (
        due + lag,
        due + lag,
        due + lag // 2,
        due,
    ):  # repeats hit the memo, the rest fill and clear it
        assert memo.following_fire(schedule, start_ms=NOW, due_ms=due, now_ms=now) == following_fire(
            schedule, start_ms=NOW, due_ms=due, now_ms=now
        )
