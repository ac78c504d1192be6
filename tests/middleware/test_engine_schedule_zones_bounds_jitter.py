"""Schedules in a time zone, with bounds and jitter, through the delay engine on a real Redis, one-
and two-phase fire, with time moved by an injected clock: zoned cron across DST days, a limit of 1
and of 3 leaving a `completed` record, a replace restarting the count, an end bound, and jittered
times held by the index."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pytest
import redis
import redis.asyncio as aioredis

from delayed_middleware.clock import ManualClock
from delayed_middleware.engine import DelayEngine, EngineConfig
from delayed_middleware.entry import decode_entry
from delayed_middleware.history import decode_record
from delayed_middleware.instants import format_instant, parse_instant
from delayed_middleware.keys import EngineKeys, delayed_topic
from delayed_middleware.plan import PlanContext, plan_publish
from delayed_middleware.schedules import EnvelopeRecurrence, jitter_offset, parse_stored_schedule
from delayed_middleware.zones import local_time, parse_time_zone
from tests.redis_server import stream_entries

KEYS = EngineKeys.for_topic(delayed_topic("app"))


def engine_at(
    aredis: Callable[[], aioredis.Redis], now: str, two_phase: bool
) -> tuple[DelayEngine, ManualClock]:
    clock = ManualClock(parse_instant(now))
    engine = DelayEngine(
        aredis(), KEYS, clock, recurrence=EnvelopeRecurrence(), config=EngineConfig(two_phase=two_phase)
    )
    return engine, clock


async def publish(engine: DelayEngine, clock: ManualClock, metadata: Mapping[str, str]) -> None:
    ctx = PlanContext(now_ms=clock.now_ms(), pubsub_name="p", enabled=True)
    plan = plan_publish("orders", b"tick", metadata, "", ctx)
    await engine.schedule([d.envelope for d in plan.delayed])


async def run_until(engine: DelayEngine, clock: ManualClock, until: str) -> None:
    """Move the clock from due time to due time, firing each, up to `until`."""
    end = parse_instant(until)
    while True:
        _, head = await engine.fire_due()
        if head is None or head > end:
            return
        clock.set(max(head, clock.now_ms()))


def fired_dues(client: redis.Redis) -> list[int]:
    return [int(r.due_ms or 0) for r in events(client) if r.event == "fired"]


def events(client: redis.Redis) -> list:  # type: ignore[type-arg]
    return [decode_record(i, f) for i, f in stream_entries(client, KEYS.history)]


def delivered(client: redis.Redis) -> list[dict[str, str]]:
    return [dict(decode_entry(f).metadata) for _, f in stream_entries(client, "orders")]


@pytest.mark.parametrize("two_phase", [False, True])
@pytest.mark.parametrize(
    ("zone", "expr", "published", "until", "expected_local"),
    [
        (
            "America/New_York",
            "0 30 2 * * *",
            "2026-03-06T12:00:00Z",
            "2026-03-09T12:00:00Z",
            ["2026-03-07T02:30:00-05:00", "2026-03-08T03:00:00-04:00", "2026-03-09T02:30:00-04:00"],
        ),
        (
            "America/New_York",
            "0 30 1 * * *",
            "2026-10-31T12:00:00Z",
            "2026-11-02T12:00:00Z",
            ["2026-11-01T01:30:00-04:00", "2026-11-02T01:30:00-05:00"],
        ),
        (
            "Europe/London",
            "0 0 * * * *",
            "2026-10-24T23:30:00Z",
            "2026-10-25T03:30:00Z",
            [
                "2026-10-25T01:00:00+01:00",
                "2026-10-25T02:00:00+00:00",
                "2026-10-25T03:00:00+00:00",
            ],
        ),
        (
            "Europe/London",
            "0 30 1 * * *",
            "2026-03-28T12:00:00Z",
            "2026-03-30T12:00:00Z",
            ["2026-03-29T02:00:00+01:00", "2026-03-30T01:30:00+01:00"],
        ),
    ],
)
async def test_zoned_cron_fires_once_per_wall_time_across_dst(
    aredis: Callable[[], aioredis.Redis],
    redis_client: redis.Redis,
    two_phase: bool,
    zone: str,
    expr: str,
    published: str,
    until: str,
    expected_local: list[str],
) -> None:
    engine, clock = engine_at(aredis, published, two_phase)
    await publish(engine, clock, {"schedule": expr, "scheduleTimeZone": zone, "scheduleId": "tz"})
    await run_until(engine, clock, until)
    tz = parse_time_zone(zone)
    assert [local_time(d, tz) for d in fired_dues(redis_client)] == expected_local
    # Each delivered message names the next fire (UTC), which the index then holds.
    nexts = [m["scheduleNext"] for m in delivered(redis_client)]
    assert [parse_instant(n) for n in nexts[:-1]] == fired_dues(redis_client)[1:]


@pytest.mark.parametrize("two_phase", [False, True])
async def test_a_limit_of_1_fires_once_then_the_schedule_is_removed_with_a_completed_record(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, two_phase: bool
) -> None:
    engine, clock = engine_at(aredis, "2026-11-26T12:00:00Z", two_phase)
    await publish(engine, clock, {"schedule": "@every 10s", "scheduleId": "once", "scheduleLimit": "1"})
    await run_until(engine, clock, "2026-11-26T12:05:00Z")
    assert len(delivered(redis_client)) == 1
    assert delivered(redis_client)[0]["scheduleNext"] == "purge"
    assert [r.event for r in events(redis_client)] == ["scheduled", "fired", "completed"]
    completed = events(redis_client)[-1]
    assert (completed.id, completed.reason) == ("once", "NoNextFire")
    assert await engine.pending() == 0
    assert not redis_client.hexists(KEYS.ids, "once")
    assert redis_client.xlen(KEYS.stream) == 0


@pytest.mark.parametrize("two_phase", [False, True])
async def test_replacing_a_limited_schedule_restarts_its_count(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, two_phase: bool
) -> None:
    engine, clock = engine_at(aredis, "2026-11-26T12:00:00Z", two_phase)
    md = {
        "schedule": "0 * * * * *",
        "scheduleId": "r",
        "scheduleLimit": "3",
        "scheduleTimeZone": "Asia/Tokyo",
    }
    await publish(engine, clock, md)
    await run_until(engine, clock, "2026-11-26T12:02:30Z")
    assert len(delivered(redis_client)) == 2
    await publish(engine, clock, md)
    await run_until(engine, clock, "2026-11-26T13:00:00Z")
    assert len(delivered(redis_client)) == 5
    assert [r.event for r in events(redis_client)].count("completed") == 1
    assert await engine.pending() == 0


@pytest.mark.parametrize("two_phase", [False, True])
async def test_an_end_bound_stops_an_every_schedule_and_jittered_times_are_what_the_index_holds(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, two_phase: bool
) -> None:
    engine, clock = engine_at(aredis, "2026-11-26T12:00:00Z", two_phase)
    t0 = clock.now_ms()
    md = {
        "schedule": "@every 10s",
        "scheduleId": "j",
        "scheduleJitter": "4s",
        "scheduleEnd": "2026-11-26T12:01:00Z",
    }
    await publish(engine, clock, md)
    [envelope] = plan_publish(
        "orders", b"", md, "", PlanContext(now_ms=t0, pubsub_name="p", enabled=True)
    ).delayed
    schedule = parse_stored_schedule(envelope.envelope.schedule, now_ms=t0)
    nominal = [t0 + k * 10_000 for k in range(1, 7)]
    jittered = [n + jitter_offset(schedule, n, "j") for n in nominal]
    expected = [j for j in jittered if j <= parse_instant("2026-11-26T12:01:00Z")]
    # Before anything fires, the index holds the first jittered time.
    assert (await engine.fire_due())[1] == expected[0]
    await run_until(engine, clock, "2026-11-26T12:10:00Z")
    assert fired_dues(redis_client) == expected
    assert any(j != n for j, n in zip(jittered, nominal, strict=True))
    assert [r.event for r in events(redis_client)][-1] == "completed"
    # scheduleNext carried by each message is the next jittered time, 'purge' on the last.
    assert [m["scheduleNext"] for m in delivered(redis_client)] == [
        *(format_instant(j) for j in expected[1:]),
        "purge",
    ]


# (zone, expression, jitter, published, the clock jumps to, run until). Each crosses a spring-forward
# that brings two occurrences closer than the jitter: Berlin's 02:05 is skipped and lands on 03:00, five
# minutes before 03:05; New York's 02:30 lands on 03:00, thirty minutes before 03:30; Lord Howe moves
# its clocks by thirty minutes, so 02:00 lands on 02:30, thirty minutes before 03:00. Published a week
# earlier, when the next fires were all an hour apart; the clock then jumps to the eve of the change.
DST_JITTER_CASES = [
    (
        "Europe/Berlin",
        "0 5 * * * *",
        "10m",
        "2027-03-20T12:00:00Z",
        "2027-03-27T22:00:00Z",
        "2027-03-28T04:00:00Z",
    ),
    (
        "America/New_York",
        "0 30 1,2,3 * * *",
        "45m",
        "2027-03-06T12:00:00Z",
        "2027-03-14T05:00:00Z",
        "2027-03-14T09:00:00Z",
    ),
    (
        "Australia/Lord_Howe",
        "@hourly",
        "45m",
        "2027-09-25T12:00:00Z",
        "2027-10-02T13:00:00Z",
        "2027-10-02T18:00:00Z",
    ),
]


@pytest.mark.parametrize("two_phase", [False, True])
@pytest.mark.parametrize(("zone", "expr", "jitter", "published", "jump", "until"), DST_JITTER_CASES)
async def test_a_jittered_zoned_cron_keeps_firing_in_order_across_a_spring_forward(
    aredis: Callable[[], aioredis.Redis],
    redis_client: redis.Redis,
    two_phase: bool,
    zone: str,
    expr: str,
    jitter: str,
    published: str,
    jump: str,
    until: str,
) -> None:
    engine, clock = engine_at(aredis, published, two_phase)
    ids = [f"job-{i}" for i in range(100)]
    for sid in ids:
        await publish(
            engine,
            clock,
            {"schedule": expr, "scheduleTimeZone": zone, "scheduleJitter": jitter, "scheduleId": sid},
        )
    clock.set(parse_instant(jump))
    await run_until(engine, clock, until)
    # Nothing accepted is ended by the calendar: no schedule cancelled, every one still pending.
    assert [r for r in events(redis_client) if r.event in ("cancelled", "completed")] == []
    assert await engine.pending() == len(ids)
    # Each schedule fired through the night, in order (how many depends on its jitter near `until`).
    per_id: dict[str, list[int]] = {}
    for r in events(redis_client):
        if r.event == "fired":
            per_id.setdefault(r.id, []).append(int(r.due_ms or 0))
    assert sorted(per_id) == sorted(ids)
    for dues in per_id.values():
        assert len(dues) >= 4
        assert dues == sorted(set(dues))


@pytest.mark.parametrize("two_phase", [False, True])
@pytest.mark.parametrize(
    ("metadata", "published", "late", "fires"),
    [
        # The grid runs into year 10000 after ten fires (the limit would allow a million).
        (
            {"schedule": "@every 1s", "scheduleStart": "9999-12-31T23:59:50Z", "scheduleLimit": "1000000"},
            "9999-12-31T23:59:40Z",
            None,
            10,
        ),
        # Kathmandu's wall clock reaches year 10000 at 18:15 UTC. Fired late (the component down from
        # 16:00 to 18:30), the next fire is asked for from a UTC instant with no wall-clock time there.
        (
            {"schedule": "0 0 * * * *", "scheduleTimeZone": "Asia/Kathmandu"},
            "9999-12-31T16:00:00Z",
            "9999-12-31T18:30:00Z",
            1,
        ),
        # Jittered: the 29th (due after the publish), the 30th and the 31st, then nothing in year 10000.
        ({"schedule": "@daily", "scheduleJitter": "23h"}, "9999-12-29T00:00:00Z", None, 3),
    ],
)
async def test_a_schedule_whose_next_fire_passes_year_9999_ends_with_a_completed_record(
    aredis: Callable[[], aioredis.Redis],
    redis_client: redis.Redis,
    two_phase: bool,
    metadata: dict[str, str],
    published: str,
    late: str | None,
    fires: int,
) -> None:
    engine, clock = engine_at(aredis, published, two_phase)
    await publish(engine, clock, {**metadata, "scheduleId": "far"})
    if late is not None:
        clock.set(parse_instant(late))
    await run_until(engine, clock, "9999-12-31T23:59:59.999Z")
    records = [(r.event, r.reason) for r in events(redis_client)]
    assert records[-1] == ("completed", "NoNextFire"), records
    assert not [r for r in records if r[0] == "cancelled"]
    assert len(fired_dues(redis_client)) == fires
    assert fired_dues(redis_client) == sorted(set(fired_dues(redis_client)))
    assert delivered(redis_client)[-1]["scheduleNext"] == "purge"
    assert await engine.pending() == 0
    assert not redis_client.hexists(KEYS.ids, "far")
