"""Schedules in a time zone, with bounds and jitter, pure: cron in a time zone across DST days in two
hemispheres, the CRON_TZ= prefix, start/end/limit bounds, jitter fixed per occurrence, the stored form
read back by the engine's recurrence function, and every bad value refused naming its key."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from delayed_middleware.envelope import RECURRING, Envelope
from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.instants import format_instant, parse_instant
from delayed_middleware.plan import PlanContext, plan_publish
from delayed_middleware.schedules import (
    EnvelopeRecurrence,
    NextFireMemo,
    Schedule,
    first_fire,
    jitter_offset,
    next_fire,
    parse_schedule,
    parse_stored_schedule,
    with_bounds,
)
from delayed_middleware.zones import local_time, parse_time_zone

SECOND = 1000


def ms(text: str) -> int:
    return parse_instant(text)


def walk(
    schedule: Schedule, after: str, count: int, *, key: str = "", start_ms: int | None = None
) -> list[str]:
    """The next `count` fires after `after`, as RFC 3339 UTC (fewer if the schedule ends)."""
    cursor = ms(after)
    origin = cursor if start_ms is None else start_ms
    out: list[str] = []
    for _ in range(count):
        due = next_fire(schedule, start_ms=origin, after_ms=cursor, key=key)
        if due is None:
            break
        out.append(format_instant(due))
        cursor = due
    return out


def zoned(expr: str, zone: str) -> Schedule:
    return parse_schedule(expr, now_ms=ms("2026-01-01T00:00:00Z"), time_zone=zone)


# ---------------------------------------------------------------------------------------------------------
# Time zones and daylight saving time.

# (zone, expression, after, expected fires as local time). 2026: New York springs forward on 8 March
# (02:00 EST -> 03:00 EDT) and falls back on 1 November (02:00 EDT -> 01:00 EST); London on 29 March
# (01:00 GMT -> 02:00 BST) and 25 October (02:00 BST -> 01:00 GMT); Sydney falls back on 5 April
# (03:00 AEDT -> 02:00 AEST) and springs forward on 4 October (02:00 AEST -> 03:00 AEDT).
DST_TABLE = [
    # A daily time inside the skipped hour fires once, at the end of the gap, then as usual.
    (
        "America/New_York",
        "0 30 2 * * *",
        "2026-03-06T12:00:00Z",
        ["2026-03-07T02:30:00-05:00", "2026-03-08T03:00:00-04:00", "2026-03-09T02:30:00-04:00"],
    ),
    # A daily time inside the repeated hour fires once, at its first (daylight) occurrence.
    (
        "America/New_York",
        "0 30 1 * * *",
        "2026-10-31T12:00:00Z",
        ["2026-11-01T01:30:00-04:00", "2026-11-02T01:30:00-05:00"],
    ),
    # Hourly through the fall-back: 01:00 once (the repeat is skipped), so no hour fires twice.
    (
        "America/New_York",
        "@hourly",
        "2026-11-01T03:30:00Z",
        [
            "2026-11-01T00:00:00-04:00",
            "2026-11-01T01:00:00-04:00",
            "2026-11-01T02:00:00-05:00",
            "2026-11-01T03:00:00-05:00",
        ],
    ),
    # Every 15 minutes through the spring-forward: 02:00-02:45 do not exist; they fire once, at 03:00.
    (
        "America/New_York",
        "0 */15 * * * *",
        "2026-03-08T06:40:00Z",
        ["2026-03-08T01:45:00-05:00", "2026-03-08T03:00:00-04:00", "2026-03-08T03:15:00-04:00"],
    ),
    (
        "Europe/London",
        "0 30 1 * * *",
        "2026-03-28T12:00:00Z",
        ["2026-03-29T02:00:00+01:00", "2026-03-30T01:30:00+01:00"],
    ),
    (
        "Europe/London",
        "0 30 1 * * *",
        "2026-10-24T12:00:00Z",
        ["2026-10-25T01:30:00+01:00", "2026-10-26T01:30:00+00:00"],
    ),
    (
        "Australia/Sydney",
        "0 30 2 * * *",
        "2026-04-04T00:00:00Z",
        ["2026-04-05T02:30:00+11:00", "2026-04-06T02:30:00+10:00"],
    ),
    (
        "Australia/Sydney",
        "0 30 2 * * *",
        "2026-10-03T00:00:00Z",
        ["2026-10-04T03:00:00+11:00", "2026-10-05T02:30:00+11:00"],
    ),
    # @daily is local midnight, on either side of a change of offset.
    (
        "Europe/London",
        "@daily",
        "2026-03-28T12:00:00Z",
        ["2026-03-29T00:00:00+00:00", "2026-03-30T00:00:00+01:00"],
    ),
]


@pytest.mark.parametrize(("zone", "expr", "after", "expected"), DST_TABLE)
def test_cron_in_a_zone_fires_once_across_skipped_and_repeated_wall_times(
    zone: str, expr: str, after: str, expected: list[str]
) -> None:
    schedule = zoned(expr, zone)
    tz = parse_time_zone(zone)
    got = walk(schedule, after, len(expected))
    assert [local_time(ms(g), tz) for g in got] == expected
    # The memo the engine uses gives the same answers.
    memo = NextFireMemo()
    cursor = ms(after)
    for g in got:
        due = memo.next_fire(schedule, start_ms=0, after_ms=cursor)
        assert due == ms(g)
        cursor = due


def test_a_year_of_daily_fires_in_a_zone_is_one_per_local_day_at_the_local_time() -> None:
    for zone in ("America/New_York", "Australia/Sydney"):
        tz = parse_time_zone(zone)
        got = walk(zoned("0 0 9 * * *", zone), "2026-01-01T00:00:00Z", 365)
        local = [local_time(ms(g), tz) for g in got]
        assert all(t[11:19] == "09:00:00" for t in local), zone
        assert len({t[:10] for t in local}) == 365


def test_cron_tz_prefix_and_key_are_one_zone_and_must_agree() -> None:
    now = ms("2026-01-01T00:00:00Z")
    by_prefix = parse_schedule("CRON_TZ=America/New_York 0 0 9 * * *", now_ms=now)
    by_key = parse_schedule("0 0 9 * * *", now_ms=now, time_zone="America/New_York")
    both = parse_schedule("CRON_TZ=America/New_York 0 0 9 * * *", now_ms=now, time_zone="America/New_York")
    assert by_prefix == by_key == both
    assert by_key.expr == "CRON_TZ=America/New_York 0 0 9 * * *"
    assert first_fire(by_key, now_ms=now) == ms("2026-01-01T14:00:00Z")
    # UTC is the default: named explicitly it changes nothing.
    assert parse_schedule("@daily", now_ms=now, time_zone="UTC") == parse_schedule("@daily", now_ms=now)
    with pytest.raises(InvalidArgumentError) as err:
        parse_schedule("CRON_TZ=America/New_York 0 0 9 * * *", now_ms=now, time_zone="Europe/London")
    assert (err.value.key, err.value.value) == ("scheduleTimeZone", "Europe/London")


@pytest.mark.parametrize(
    ("expr", "zone", "key"),
    [
        ("@daily", "Mars/Olympus_Mons", "scheduleTimeZone"),
        ("@daily", "../../etc/passwd", "scheduleTimeZone"),
        ("@daily", "/usr/share/zoneinfo/UTC", "scheduleTimeZone"),
        ("@daily", "America/New_York ", "scheduleTimeZone"),
        ("@daily", "x" * 200, "scheduleTimeZone"),
        ("@every 10s", "America/New_York", "scheduleTimeZone"),
        ("@at 2026-05-01T00:00:00Z", "America/New_York", "scheduleTimeZone"),
        ("CRON_TZ=Nowhere/Land @daily", None, "schedule"),
        ("CRON_TZ=America/New_York", None, "schedule"),
        ("CRON_TZ=America/New_York @every 1m", None, "schedule"),
    ],
)
def test_bad_time_zones_are_refused_naming_the_key(expr: str, zone: str | None, key: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        parse_schedule(expr, now_ms=ms("2026-01-01T00:00:00Z"), time_zone=zone)
    assert err.value.key == key
    assert err.value.value == (zone if key == "scheduleTimeZone" else expr)


# ---------------------------------------------------------------------------------------------------------
# Bounds.

NOW = ms("2026-11-26T12:00:00Z")


def bounded(expr: str, key: str = "s", **options: str) -> Schedule:
    return with_bounds(parse_schedule(expr, now_ms=NOW), now_ms=NOW, key=key, **options)


def test_every_counts_its_grid_from_the_start_and_fires_at_the_start() -> None:
    s = bounded("@every 1h", start="2026-11-27T09:00:00+01:00")
    assert first_fire(s, now_ms=NOW) == ms("2026-11-27T08:00:00Z")
    assert walk(s, "2026-11-26T12:00:00Z", 3, start_ms=NOW) == [
        "2026-11-27T08:00:00.000Z",
        "2026-11-27T09:00:00.000Z",
        "2026-11-27T10:00:00.000Z",
    ]
    # A start in the past keeps its grid: the next point of it after now.
    past = bounded("@every 1h", start="2026-11-26T10:20:00Z")
    assert first_fire(past, now_ms=NOW) == ms("2026-11-26T12:20:00Z")


def test_cron_never_fires_before_its_start_and_a_match_at_the_start_counts() -> None:
    s = bounded("0 0 9 * * *", start="2026-11-28T09:00:00Z")
    assert first_fire(s, now_ms=NOW) == ms("2026-11-28T09:00:00Z")


@pytest.mark.parametrize("limit", [1, 3, 10])
def test_a_limit_of_n_gives_n_fires_then_none(limit: int) -> None:
    for expr in ("@every 10s", "0 0 9 * * *", "@daily"):
        s = bounded(expr, limit=str(limit))
        got = walk(s, format_instant(NOW), limit + 5, start_ms=NOW)
        assert len(got) == limit, expr


def test_an_end_stops_the_fires_and_a_limit_and_an_end_both_bind() -> None:
    s = bounded("@every 1h", end="2026-11-26T15:00:00Z")
    assert walk(s, format_instant(NOW), 10, start_ms=NOW) == [
        "2026-11-26T13:00:00.000Z",
        "2026-11-26T14:00:00.000Z",
        "2026-11-26T15:00:00.000Z",
    ]
    assert (
        len(walk(bounded("@every 1h", end="2026-11-26T15:00:00Z", limit="2"), "2026-11-26T12:00:00Z", 9)) == 2
    )


def test_missed_occurrences_count_towards_the_limit_so_replicas_agree_on_the_last() -> None:
    s = bounded("@every 10s", limit="3")
    # Down across the second and third occurrence: the overdue one fires once at recovery, then nothing.
    assert next_fire(s, start_ms=NOW, after_ms=NOW + 35 * SECOND) is None


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"start": "2026-11-27T10:00:00Z", "end": "2026-11-27T09:00:00Z"}, "scheduleEnd"),
        ({"start": "2026-11-27T10:00:00Z", "end": "2026-11-27T10:00:00Z"}, "scheduleEnd"),
        ({"end": "2026-11-26T11:00:00Z"}, "scheduleEnd"),
        ({"end": "2026-11-26T12:30:00Z"}, "scheduleEnd"),  # @daily at 00:00: nothing fires before then
        ({"start": "tomorrow"}, "scheduleStart"),
        ({"start": "2026-11-27 10:00:00"}, "scheduleStart"),
        ({"end": "2026-13-01T00:00:00Z"}, "scheduleEnd"),
        ({"limit": "0"}, "scheduleLimit"),
        ({"limit": "-1"}, "scheduleLimit"),
        ({"limit": "1.5"}, "scheduleLimit"),
        ({"limit": "three"}, "scheduleLimit"),
        ({"limit": "10001"}, "scheduleLimit"),
        ({"limit": "9" * 40}, "scheduleLimit"),
        ({"limit": "٣"}, "scheduleLimit"),
        ({"jitter": "24h"}, "scheduleJitter"),
        ({"jitter": "five seconds"}, "scheduleJitter"),
        ({"jitter": "-1s"}, "scheduleJitter"),
    ],
)
def test_bad_bounds_are_refused_naming_the_key_and_value(options: Mapping[str, str], key: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        bounded("@daily", **options)
    assert err.value.key == key
    assert err.value.value == options[key.removeprefix("schedule").lower()]


def test_bounds_and_jitter_need_a_recurring_schedule() -> None:
    for option in ("start", "end", "limit", "jitter"):
        value = "2026-12-01T00:00:00Z" if option in ("start", "end") else "1s" if option == "jitter" else "2"
        with pytest.raises(InvalidArgumentError) as err:
            bounded("@at 2026-12-01T00:00:00Z", **{option: value})
        assert err.value.key == "schedule" + option.capitalize()


# ---------------------------------------------------------------------------------------------------------
# Jitter.


def test_jitter_is_fixed_per_occurrence_within_range_and_the_grid_does_not_drift() -> None:
    s = bounded("@every 10s", key="job-1", jitter="5s")
    got = [ms(t) for t in walk(s, format_instant(NOW), 200, key="job-1", start_ms=NOW)]
    nominal = [NOW + k * 10 * SECOND for k in range(1, 201)]
    offsets = [g - n for g, n in zip(got, nominal, strict=True)]
    assert all(0 <= o < 5 * SECOND for o in offsets)
    assert len(set(offsets)) > 150  # really spread, not one offset
    # The same answer whoever asks, whenever: from the previous fire, from 'now', from another replica.
    for k in (3, 77, 150):
        assert next_fire(s, start_ms=NOW, after_ms=got[k - 1], key="job-1") == got[k]
        assert next_fire(s, start_ms=NOW, after_ms=nominal[k] - 1, key="job-1") in (got[k - 1], got[k])
        assert jitter_offset(s, nominal[k], "job-1") == offsets[k]
    # Another id, other offsets.
    other = [ms(t) for t in walk(s, format_instant(NOW), 50, key="job-2", start_ms=NOW)]
    assert other != got[:50]


def test_a_thousand_schedules_with_jitter_spread_over_the_jitter_window() -> None:
    s = bounded("@every 10s", key="x", jitter="5s")
    firsts = [first_fire(s, now_ms=NOW, key=f"job-{i}") for i in range(1000)]
    offsets = [f - NOW - 10 * SECOND for f in firsts if f is not None]
    assert len(offsets) == 1000
    assert all(0 <= o < 5 * SECOND for o in offsets)
    per_second = Counter(o // SECOND for o in offsets)
    assert sorted(per_second) == [0, 1, 2, 3, 4]
    assert all(150 <= n <= 250 for n in per_second.values()), per_second


def test_cron_jitter_must_be_less_than_the_shortest_gap() -> None:
    with pytest.raises(InvalidArgumentError) as err:
        bounded("0 0 9,10 * * *", jitter="1h")
    assert err.value.key == "scheduleJitter"
    s = bounded("0 0 9,10 * * *", jitter="59m")
    assert len(walk(s, format_instant(NOW), 10, key="s", start_ms=NOW)) == 10


# ---------------------------------------------------------------------------------------------------------
# The stored form and the engine's recurrence function.


def test_the_stored_form_reads_back_to_the_same_schedule() -> None:
    for s in (
        bounded(
            "@every 10s", jitter="5s", limit="4", start="2026-11-27T00:00:00Z", end="2026-12-01T00:00:00Z"
        ),
        with_bounds(zoned("0 30 2 * * *", "America/New_York"), now_ms=NOW, key="", seed="abc", jitter="1m"),
        zoned("@daily", "Australia/Sydney"),
    ):
        assert parse_stored_schedule(s.expr, now_ms=NOW) == s


def test_publishers_cannot_write_the_stored_form() -> None:
    with pytest.raises(InvalidArgumentError) as err:
        parse_schedule("@every 10s; limit=1", now_ms=NOW)
    assert err.value.key == "schedule"


def test_recurrence_of_an_envelope_ends_after_its_limit_with_its_jitter_by_its_schedule_id() -> None:
    ctx = PlanContext(now_ms=NOW, pubsub_name="p", enabled=True)
    md = {"schedule": "@every 10s", "scheduleId": "r", "scheduleLimit": "3", "scheduleJitter": "2s"}
    envelope = plan_publish("t", b"x", md, "", ctx).delayed[0].envelope
    assert envelope.every_ms == 0  # advanced by the recurrence, not by the fire script alone
    recurrence = EnvelopeRecurrence()
    dues = [envelope.due_ms]
    while (nxt := recurrence(envelope, dues[-1])) is not None:
        dues.append(nxt)
    assert len(dues) == 3
    schedule = parse_stored_schedule(envelope.schedule, now_ms=NOW)
    assert dues == [
        NOW + k * 10 * SECOND + jitter_offset(schedule, NOW + k * 10 * SECOND, "r") for k in (1, 2, 3)
    ]
    # The engine's refill probe carries only the expression, acceptance time and id: enough.
    probe = Envelope(
        id="r",
        topic="",
        due_ms=dues[0],
        published_at_ms=NOW,
        schedule_id="r",
        kind=RECURRING,
        schedule=envelope.schedule,
    )
    assert EnvelopeRecurrence()(probe, dues[0]) == dues[1]


def test_a_plain_every_is_still_advanced_by_the_fire_script() -> None:
    ctx = PlanContext(now_ms=NOW, pubsub_name="p", enabled=True)
    envelope = plan_publish("t", b"x", {"schedule": "@every 10s"}, "", ctx).delayed[0].envelope
    assert (envelope.every_ms, envelope.schedule) == (10 * SECOND, "@every 10s")


# ---------------------------------------------------------------------------------------------------------
# Year 9999: bounds at the far end of the calendar are refused or accepted, never an exception.


def test_a_start_whose_local_time_is_past_year_9999_is_refused_naming_it() -> None:
    # 9999-12-31T23:59:59Z is 10000-01-01 05:44:59 in Kathmandu: no wall-clock time matches there.
    with pytest.raises(InvalidArgumentError) as err:
        plan_publish(
            "t",
            b"x",
            {
                "schedule": "* * * * * *",
                "scheduleTimeZone": "Asia/Kathmandu",
                "scheduleStart": "9999-12-31T23:59:59Z",
            },
            "",
            PlanContext(now_ms=NOW, pubsub_name="p", enabled=True),
        )
    assert (err.value.key, err.value.value) == ("scheduleStart", "9999-12-31T23:59:59Z")
    assert "never fires" in err.value.reason


@pytest.mark.parametrize(
    ("metadata", "fires"),
    [
        # The grid passes year 9999 after 10 fires: they fire, then the schedule ends.
        ({"schedule": "@every 1s", "scheduleStart": "9999-12-31T23:59:50Z", "scheduleLimit": "1000000"}, 10),
        # 1,000,000 years of yearly fires: those before year 10000 fire.
        ({"schedule": "@every 8760h", "scheduleLimit": "1000000"}, None),
        ({"schedule": "@every 8760h", "scheduleLimit": "1000000", "scheduleJitter": "8759h"}, None),
        # A zone east of UTC runs out of wall-clock time before UTC does.
        (
            {
                "schedule": "0 0 * * * *",
                "scheduleTimeZone": "Asia/Kathmandu",
                "scheduleStart": "9999-12-31T10:00:00Z",
            },
            8,
        ),
    ],
)
def test_a_limit_or_start_that_outlasts_year_9999_is_accepted_and_ends_there(
    metadata: Mapping[str, str], fires: int | None
) -> None:
    ctx = PlanContext(now_ms=NOW, pubsub_name="p", enabled=True)
    envelope = plan_publish("t", b"x", {**metadata, "scheduleId": "far"}, "", ctx).delayed[0].envelope
    recurrence = EnvelopeRecurrence()
    if fires is None:
        # Walking a million years is not the point: the last fires before the end of year 9999.
        envelope = replace(envelope, due_ms=ms("9990-01-01T00:00:00Z"))
    dues = [envelope.due_ms]
    while (nxt := recurrence(envelope, dues[-1])) is not None:
        assert nxt > dues[-1]
        dues.append(nxt)
        assert len(dues) < 100
    assert dues[-1] <= ms("9999-12-31T23:59:59.999Z")
    if fires is not None:
        assert len(dues) == fires
    else:
        assert dues[-1] > ms("9997-12-31T00:00:00Z")  # within two intervals of the end


_FAR_INSTANTS = st.one_of(
    st.sampled_from(
        [
            "0001-01-01T00:00:00Z",
            "9999-12-31T23:59:59Z",
            "9999-12-31T23:59:59.999Z",
            "9999-12-31T23:59:50Z",
            "9999-12-31T18:00:00-05:00",
            "0001-01-01T00:00:00+14:00",
            "2026-11-26T12:00:00Z",
            "2026-11-26T11:59:59Z",
            "not a time",
            "",
        ]
    ),
    st.integers(ms("0001-01-01T00:00:00Z"), ms("9999-12-31T23:59:59.999Z")).map(format_instant),
)


@settings(max_examples=300, deadline=None)
@given(
    schedule=st.sampled_from(
        [
            "* * * * * *",
            "@every 1s",
            "@every 8760h",
            "@every 2562047h",
            "@hourly",
            "@yearly",
            "0 0 0 29 2 *",
            "0 30 2 * * *",
            "CRON_TZ=Pacific/Kiritimati 59 59 23 31 12 *",
            "@at 9999-12-31T23:59:59Z",
        ]
    ),
    zone=st.sampled_from([None, "UTC", "Asia/Kathmandu", "Pacific/Kiritimati", "Etc/GMT+12", "localtime"]),
    start=st.none() | _FAR_INSTANTS,
    end=st.none() | _FAR_INSTANTS,
    limit=st.none() | st.sampled_from(["1", "2", "10000", "10001", "1000000", "0", "x"]),
    jitter=st.none() | st.sampled_from(["0s", "1ms", "59m59s", "8759h", "-1s", "2562047h"]),
    now=st.sampled_from(["2026-11-26T12:00:00Z", "9999-12-31T23:00:00Z", "9999-12-31T23:59:59.999Z"]),
)
def test_any_bounds_are_a_schedule_or_an_invalid_argument(
    schedule: str,
    zone: str | None,
    start: str | None,
    end: str | None,
    limit: str | None,
    jitter: str | None,
    now: str,
) -> None:
    # Nothing a publisher sends may escape as another exception (UNKNOWN at the gRPC edge), and an
    # accepted schedule's next fires are computed without one too (at fire time, year 9999 ends it).
    metadata = {"schedule": schedule, "scheduleId": "p"}
    for key, value in (
        ("scheduleTimeZone", zone),
        ("scheduleStart", start),
        ("scheduleEnd", end),
        ("scheduleLimit", limit),
        ("scheduleJitter", jitter),
    ):
        if value is not None:
            metadata[key] = value
    refused: InvalidArgumentError | None = None
    try:
        plan = plan_publish(
            "t", b"x", metadata, "", PlanContext(now_ms=ms(now), pubsub_name="p", enabled=True)
        )
    except InvalidArgumentError as exc:
        refused = exc
    if refused is not None:
        assert (refused.key, refused.value) in metadata.items()
        return
    envelope = plan.delayed[0].envelope
    recurrence = EnvelopeRecurrence()
    due: int | None = envelope.due_ms
    for _ in range(3):
        if due is None or not envelope.schedule:
            break
        nxt = recurrence(envelope, due)
        assert nxt is None or nxt > due
        due = nxt
