"""Backfill (delayed_middleware.backfill) on a real Redis: a schedule's past occurrences by its own
calendar (a Berlin cron across both daylight-saving changes, jitter), delivered once however often
and however many at once, nothing changed by a dry run, refused ranges, pacing, and what it leaves
out (occurrences the schedule fired itself)."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from delayed_middleware.backfill import (
    MAX_OCCURRENCES,
    BackfillResult,
    ScheduleNotFoundError,
    backfill,
    parse_rate,
)
from delayed_middleware.clock import ManualClock
from delayed_middleware.engine import DelayEngine, EngineConfig
from delayed_middleware.entry import StreamEntry, decode_entry
from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.history import decode_record
from delayed_middleware.instants import format_instant, parse_instant
from delayed_middleware.keys import EngineKeys, backfill_record, delayed_topic, is_engine_key, key_slot
from delayed_middleware.plan import PlanContext, plan_bulk, plan_publish
from delayed_middleware.publish_keys import SCHEDULE_OCCURRENCE
from delayed_middleware.schedules import EnvelopeRecurrence, next_fire, occurrences, parse_stored_schedule
from delayed_middleware.zones import local_time, parse_time_zone
from tests.components.test_upgrade import release_tree
from tests.middleware.engine.helpers import two_phase_engines
from tests.redis_server import stream_entries
from tests.waiting import wait_until

KEYS = EngineKeys.for_topic(delayed_topic("app"))
BERLIN = parse_time_zone("Europe/Berlin")

Make = Callable[[], aioredis.Redis]


async def published(
    aredis: Make, now: str, metadata: Mapping[str, str], body: bytes = b"tick"
) -> tuple[DelayEngine, ManualClock]:
    """An engine whose clock reads `now`, with one schedule published through it."""
    clock = ManualClock(parse_instant(now))
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=EnvelopeRecurrence())
    ctx = PlanContext(now_ms=clock.now_ms(), pubsub_name="p", enabled=True)
    plan = plan_publish("orders", body, metadata, "", ctx)
    await engine.schedule([d.envelope for d in plan.delayed])
    return engine, clock


def delivered(client: redis.Redis, topic: str = "orders") -> list[dict[str, str]]:
    return [dict(decode_entry(f).metadata) for _, f in stream_entries(client, topic)]


def events(client: redis.Redis, event: str) -> list[int]:
    return [
        r.due_ms or 0
        for r in (decode_record(i, f) for i, f in stream_entries(client, KEYS.history))
        if r.event == event
    ]


def ms(text: str) -> int:
    return parse_instant(text)


async def daily(aredis: Make, clock: ManualClock, start: str, end: str, **kwargs: Any) -> BackfillResult:
    """Backfill schedule `daily` of app `app` over [start, end) (RFC 3339) at the clock's time."""
    return await backfill(aredis(), "app", "daily", ms(start), ms(end), clock=clock, **kwargs)


@pytest.fixture(params=("fire", "two-phase"))
def fire_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both fire paths: on "two-phase" every engine this module builds fires through CLAIM, APPEND
    and RELEASE (Redis Cluster's path)."""
    if request.param == "two-phase":
        two_phase_engines(sys.modules[__name__], monkeypatch)
    return str(request.param)


HOURLY = {"schedule": "@hourly", "scheduleId": "hourly"}
DAILY_BERLIN = {"schedule": "0 30 2 * * *", "scheduleTimeZone": "Europe/Berlin", "scheduleId": "daily"}


@pytest.fixture
async def berlin(aredis: Make, redis_client: redis.Redis) -> ManualClock:
    """Schedule `daily` (02:30 Berlin time) published on 2026-11-28 at noon: the clock, at that time."""
    _, clock = await published(aredis, "2026-11-28T12:00:00Z", DAILY_BERLIN)
    return clock


async def test_a_berlin_cron_is_replayed_across_both_daylight_saving_changes(
    aredis: Make, redis_client: redis.Redis, berlin: ManualClock
) -> None:
    clock = berlin
    spring = await daily(aredis, clock, "2026-03-27T00:00:00Z", "2026-03-31T00:00:00Z")
    autumn = await daily(aredis, clock, "2026-10-23T00:00:00Z", "2026-10-27T00:00:00Z")
    local = [local_time(m, BERLIN) for m in spring.deliver + autumn.deliver]
    assert local == [
        "2026-03-27T02:30:00+01:00",
        "2026-03-28T02:30:00+01:00",
        # 02:30 does not exist on the spring-forward day: the engine fires at 03:00 CEST.
        "2026-03-29T03:00:00+02:00",
        "2026-03-30T02:30:00+02:00",
        "2026-10-23T02:30:00+02:00",
        "2026-10-24T02:30:00+02:00",
        # 02:30 happens twice on the fall-back day: one occurrence, the first.
        "2026-10-25T02:30:00+02:00",
        "2026-10-26T02:30:00+01:00",
    ]
    msgs = delivered(redis_client)
    assert [m[SCHEDULE_OCCURRENCE] for m in msgs] == [
        format_instant(m) for m in spring.deliver + autumn.deliver
    ]
    assert all(m["scheduler"] == "daily" for m in msgs)
    # scheduleNext: the occurrence after each, as its fire would have named it.
    assert [m["scheduleNext"] for m in msgs[:3]] == [format_instant(m) for m in spring.deliver[1:4]]
    assert events(redis_client, "backfilled") == list(spring.deliver + autumn.deliver)
    assert spring.delivered == autumn.delivered == 4


async def fire_until(engine: DelayEngine, clock: ManualClock, until: str) -> None:
    """Move the clock from due time to due time, firing each, up to `until`."""
    end = ms(until)
    while True:
        _, head = await engine.fire_due()
        if head is None or head > end:
            clock.set(end)
            return
        clock.set(max(head, clock.now_ms()))


HOURLY_JITTERED = {"schedule": "0 0 * * * *", "scheduleJitter": "10m", "scheduleId": "hourly"}


@pytest.mark.parametrize("two_phase", [False, True])
async def test_jittered_occurrences_are_stamped_nominal_and_those_the_schedule_fired_are_left_out(
    aredis: Make, redis_client: redis.Redis, two_phase: bool
) -> None:
    clock = ManualClock(ms("2026-11-28T00:20:00Z"))
    engine = DelayEngine(
        aredis(), KEYS, clock, recurrence=EnvelopeRecurrence(), config=EngineConfig(two_phase=two_phase)
    )
    plan = plan_publish(
        "orders",
        b"tick",
        HOURLY_JITTERED,
        "",
        PlanContext(now_ms=clock.now_ms(), pubsub_name="p", enabled=True),
    )
    await engine.schedule([d.envelope for d in plan.delayed])
    await fire_until(engine, clock, "2026-11-28T03:15:00Z")
    fired = events(redis_client, "fired")
    assert len(fired) == 3
    assert any(d % 3_600_000 for d in fired), "jitter moved the fires off the hour"
    redis_client.delete("orders")
    clock.set(ms("2026-11-28T05:30:00Z"))

    result = await backfill(
        aredis(), "app", "hourly", ms("2026-11-27T22:00:00Z"), ms("2026-11-28T05:00:00Z"), clock=clock
    )

    hours = [format_instant(ms(f"2026-11-{d}:00:00.000Z")) for d in ("27T22", "27T23", "28T00")]
    assert [format_instant(m) for m in result.deliver] == hours
    assert [m[SCHEDULE_OCCURRENCE] for m in delivered(redis_client)] == hours
    # 01:00, 02:00 and 03:00 fired (at their jittered times); 04:00 is the schedule's own, pending.
    assert (result.fired, result.left_to_schedule, result.unverified) == (3, 1, 0)
    assert len(result.occurrences) == 7


async def test_a_dry_run_lists_and_changes_nothing(
    aredis: Make, redis_client: redis.Redis, berlin: ManualClock
) -> None:
    clock = berlin
    before = {k: redis_client.dump(k) for k in redis_client.keys("*")}
    result = await daily(aredis, clock, "2026-11-01T00:00:00Z", "2026-11-08T00:00:00Z", dry_run=True)
    assert len(result.deliver) == 7
    assert result.delivered == 0
    assert result.dry_run
    assert {k: redis_client.dump(k) for k in redis_client.keys("*")} == before


async def test_twice_delivers_once_and_the_dry_run_then_has_nothing_left(
    aredis: Make, redis_client: redis.Redis, berlin: ManualClock
) -> None:
    clock = berlin
    first = await daily(aredis, clock, "2026-11-01T00:00:00Z", "2026-11-08T00:00:00Z")
    # Overlapping: three new days, four done already.
    second = await daily(aredis, clock, "2026-11-04T00:00:00Z", "2026-11-11T00:00:00Z")
    again = await daily(aredis, clock, "2026-11-01T00:00:00Z", "2026-11-11T00:00:00Z", dry_run=True)
    assert (first.delivered, second.delivered, second.already) == (7, 3, 4)
    assert again.deliver == ()
    assert again.already == 10
    occurrences = [m[SCHEDULE_OCCURRENCE] for m in delivered(redis_client)]
    assert len(occurrences) == len(set(occurrences)) == 10
    assert len(events(redis_client, "backfilled")) == 10


# An @every grid hangs from its acceptance, and has no occurrence before it, unless it has a start.
EVERY_MINUTE = {"schedule": "@every 1m", "scheduleId": "m", "scheduleStart": "2026-11-01T00:00:00Z"}


async def test_five_backfills_at_once_deliver_each_occurrence_once(
    aredis: Make, redis_client: redis.Redis
) -> None:
    _, clock = await published(aredis, "2026-11-28T12:00:00Z", EVERY_MINUTE)
    start, end = ms("2026-11-28T11:00:00Z"), ms("2026-11-28T12:00:00Z")
    clients = [aredis() for _ in range(5)]
    results = await asyncio.gather(
        *(backfill(c, "app", "m", start, end, rate=10_000, clock=clock) for c in clients)
    )
    occurrences = [m[SCHEDULE_OCCURRENCE] for m in delivered(redis_client)]
    assert len(occurrences) == len(set(occurrences)) == 60
    assert sum(r.delivered for r in results) == 60
    assert sum(r.already for r in results) == 4 * 60
    assert len(events(redis_client, "backfilled")) == 60


@pytest.mark.parametrize(
    ("start", "end", "words"),
    [
        ("2026-11-02T00:00:00Z", "2026-11-01T00:00:00Z", "is not before --to"),
        ("2026-11-01T00:00:00Z", "2026-11-01T00:00:00Z", "is not before --to"),
        ("2026-11-01T00:00:00Z", "2026-11-29T00:00:00Z", "is in the future"),
        # @every 1s over three hours: 10,800 occurrences.
        ("2026-11-28T08:00:00Z", "2026-11-28T11:00:00Z", f"more than {MAX_OCCURRENCES:,} occurrences"),
    ],
)
async def test_a_range_out_of_bounds_is_refused_and_nothing_is_delivered(
    aredis: Make, redis_client: redis.Redis, start: str, end: str, words: str
) -> None:
    _, clock = await published(
        aredis, "2026-11-28T12:00:00Z", {**EVERY_MINUTE, "schedule": "@every 1s", "scheduleId": "s"}
    )
    with pytest.raises(InvalidArgumentError, match=words):
        await backfill(aredis(), "app", "s", ms(start), ms(end), clock=clock)
    assert not redis_client.exists("orders")


async def test_unknown_and_one_shot_ids_are_refused(aredis: Make, redis_client: redis.Redis) -> None:
    _, clock = await published(
        aredis, "2026-11-28T12:00:00Z", {"scheduledSendDelay": "1h", "scheduleId": "once"}
    )
    start, end = ms("2026-11-01T00:00:00Z"), ms("2026-11-02T00:00:00Z")
    with pytest.raises(ScheduleNotFoundError):
        await backfill(aredis(), "app", "nobody", start, end, clock=clock)
    with pytest.raises(InvalidArgumentError, match="not a recurring schedule"):
        await backfill(aredis(), "app", "once", start, end, clock=clock)
    assert not redis_client.exists("orders")


async def test_the_rate_paces_the_deliveries(aredis: Make, redis_client: redis.Redis) -> None:
    _, clock = await published(aredis, "2026-11-28T12:00:00Z", EVERY_MINUTE)
    start = ms("2026-11-28T11:30:00Z")
    t0 = time.monotonic()
    slow = await backfill(aredis(), "app", "m", start, start + 30 * 60_000, rate=10, clock=clock)
    slow_s = time.monotonic() - t0
    redis_client.delete("orders")
    t0 = time.monotonic()
    fast = await backfill(aredis(), "app", "m", start - 30 * 60_000, start, rate=10_000, clock=clock)
    fast_s = time.monotonic() - t0
    assert slow.delivered == fast.delivered == 30
    # 30 at 10/s: three chunks, two waits of a second (an order of magnitude, not a tight bound).
    assert 1.5 <= slow_s < 15
    assert fast_s < slow_s


async def test_a_source_schedule_delivers_the_sample_the_source_held_at_each_occurrence(
    aredis: Make, redis_client: redis.Redis
) -> None:
    redis_client.xadd(
        "prices", {"data": b"v1", "metadata": '{"k":"1"}'}, id=f"{ms('2026-11-28T00:30:00Z')}-0"
    )
    redis_client.xadd(
        "prices", {"data": b"v2", "metadata": '{"k":"2"}'}, id=f"{ms('2026-11-28T01:30:00Z')}-0"
    )
    meta = {"schedule": "@hourly", "scheduleId": "h", "scheduleSource": "prices"}
    _, clock = await published(aredis, "2026-11-28T12:00:00Z", meta)
    result = await backfill(
        aredis(), "app", "h", ms("2026-11-28T00:00:00Z"), ms("2026-11-28T03:00:00Z"), clock=clock
    )
    # 00:00: the source held nothing yet: delivers nothing, counted apart, recorded nowhere.
    assert (result.delivered, result.empty, result.deliver) == (
        2,
        1,
        (ms("2026-11-28T01:00:00Z"), ms("2026-11-28T02:00:00Z")),
    )
    assert result.as_json()["empty"] == 1
    assert events(redis_client, "backfilled") == list(result.deliver)
    assert redis_client.zrange(backfill_record("orders", KEYS.stream, "h"), 0, -1) == [
        str(m).encode() for m in result.deliver
    ]
    got = [
        (decode_entry(f).data, decode_entry(f).metadata) for _, f in stream_entries(redis_client, "orders")
    ]
    assert [(d, m["k"], m[SCHEDULE_OCCURRENCE]) for d, m in got] == [
        (b"v1", "1", "2026-11-28T01:00:00.000Z"),
        (b"v2", "2", "2026-11-28T02:00:00.000Z"),
    ]


async def test_a_source_whose_key_is_no_stream_gives_nothing_as_a_fire_and_stops_nothing(
    aredis: Make, redis_client: redis.Redis
) -> None:
    # The source is any key the publisher named (another app's, since turned into a hash).
    meta = {"schedule": "@hourly", "scheduleId": "h", "scheduleSource": "prices"}
    _, clock = await published(aredis, "2026-11-28T12:00:00Z", meta)
    redis_client.hset("prices", "a", "hash, not a stream")
    result = await backfill(
        aredis(), "app", "h", ms("2026-11-28T00:00:00Z"), ms("2026-11-28T03:00:00Z"), clock=clock
    )
    # As a fire of that source: each occurrence delivers nothing (empty), and fails nothing.
    assert (result.delivered, result.empty, result.failed) == (0, 3, ())
    assert not redis_client.exists("orders")
    assert events(redis_client, "backfilled") == []


async def test_a_target_pubsub_schedule_is_backfilled_into_its_outbox(
    aredis: Make, redis_client: redis.Redis
) -> None:
    meta = {**DAILY_BERLIN, "targetPubsub": "kafka"}
    _, clock = await published(aredis, "2026-11-28T12:00:00Z", meta)
    result = await daily(aredis, clock, "2026-11-01T00:00:00Z", "2026-11-03T00:00:00Z")
    assert result.delivered == 2
    assert not redis_client.exists("orders")
    rows = [f for _, f in stream_entries(redis_client, KEYS.outbox)]
    assert [(f[b"pubsub"], f[b"topic"], f[b"id"]) for f in rows] == [(b"kafka", b"orders", b"daily")] * 2
    assert [decode_entry(f).metadata[SCHEDULE_OCCURRENCE] for f in rows] == [
        format_instant(m) for m in result.deliver
    ]


async def test_fires_older_than_the_history_cannot_be_told_and_are_delivered_as_unverified(
    aredis: Make, redis_client: redis.Redis
) -> None:
    engine, clock = await published(aredis, "2026-11-28T00:20:00Z", HOURLY)
    await fire_until(engine, clock, "2026-11-28T02:30:00Z")
    window = (ms("2026-11-27T23:00:00Z"), ms("2026-11-28T02:30:00Z"))
    known = await backfill(aredis(), "app", "hourly", *window, clock=clock, dry_run=True)
    # 23:00 and 00:00 came before the schedule existed; 01:00 and 02:00 it fired.
    assert (len(known.deliver), known.fired, known.unverified) == (2, 2, 0)
    # The history trimmed away (historyMaxLen, historyMaxAge): its fires can no longer be told.
    redis_client.xtrim(KEYS.history, maxlen=0)
    blind = await backfill(aredis(), "app", "hourly", *window, clock=clock, dry_run=True)
    assert (len(blind.deliver), blind.fired, blind.unverified) == (4, 0, 2)


async def test_a_paused_period_is_backfilled_once_the_schedule_is_resumed(
    aredis: Make, redis_client: redis.Redis
) -> None:
    engine, clock = await published(aredis, "2026-11-28T00:20:00Z", HOURLY)
    await fire_until(engine, clock, "2026-11-28T01:30:00Z")
    await engine.set_paused("hourly", pause=True)
    clock.set(ms("2026-11-28T05:30:00Z"))
    window = (ms("2026-11-28T00:00:00Z"), ms("2026-11-28T05:30:00Z"))
    held = await backfill(aredis(), "app", "hourly", *window, clock=clock, dry_run=True)
    # Held at 02:00: that occurrence and the later ones are still the schedule's own.
    assert (len(held.deliver), held.fired, held.left_to_schedule) == (1, 1, 4)
    await engine.set_paused("hourly", pause=False)
    resumed = await backfill(aredis(), "app", "hourly", *window, clock=clock)
    # Resumed, it goes on at 06:00 (the paused fires are skipped): 02:00-05:00 are backfilled.
    assert [format_instant(m)[11:16] for m in resumed.deliver] == [
        "00:00",
        "02:00",
        "03:00",
        "04:00",
        "05:00",
    ]
    assert (resumed.fired, resumed.left_to_schedule) == (1, 0)


async def test_a_target_that_is_no_stream_fails_each_occurrence_and_records_none(
    aredis: Make, redis_client: redis.Redis, berlin: ManualClock
) -> None:
    redis_client.set("orders", "a string, not a stream")
    refused = await daily(aredis, berlin, "2026-11-01T00:00:00Z", "2026-11-04T00:00:00Z")
    assert refused.delivered == 0
    assert [why.split(":")[0] for _, why in refused.failed] == ["WRONGTYPE"] * 3
    assert events(redis_client, "backfilled") == []
    # Fixed, the same range goes out in full: nothing was recorded as delivered.
    redis_client.delete("orders")
    fixed = await daily(aredis, berlin, "2026-11-01T00:00:00Z", "2026-11-04T00:00:00Z")
    assert fixed.delivered == 3


async def test_a_bulk_schedule_delivers_every_entry_of_each_occurrence_in_calls_of_bounded_work(
    aredis: Make, redis_client: redis.Redis
) -> None:
    clock = ManualClock(ms("2026-11-28T12:00:00Z"))
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=EnvelopeRecurrence())
    entries = [(str(i), StreamEntry(f"e{i}".encode(), {"n": str(i)})) for i in range(200)]
    ctx = PlanContext(now_ms=clock.now_ms(), pubsub_name="p", enabled=True)
    plan = plan_bulk("orders", entries, {"schedule": "@hourly", "scheduleId": "bulk"}, ctx)
    await engine.schedule([d.envelope for d in plan.delayed])
    calls = redis_client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    result = await backfill(
        aredis(), "app", "bulk", ms("2026-11-28T09:00:00Z"), ms("2026-11-28T12:00:00Z"), clock=clock
    )
    assert result.delivered == 3
    got = [decode_entry(f) for _, f in stream_entries(redis_client, "orders")]
    assert [e.data for e in got] == [f"e{i}".encode() for i in range(200)] * 3
    assert {e.metadata[SCHEDULE_OCCURRENCE] for e in got[:200]} == {"2026-11-28T09:00:00.000Z"}
    # 600 XADDs: two script calls (at most CHUNK_ENTRIES each), besides the history's pages.
    after = redis_client.info("commandstats")["cmdstat_evalsha"]["calls"]
    assert after - calls == 2


@pytest.mark.parametrize("topic", ["orders", "{tenant}orders", "a}b{c", "app-delayed-ish"])
def test_the_record_lives_in_the_targets_slot_inside_the_engines_namespace(topic: str) -> None:
    record = backfill_record(topic, KEYS.stream, "daily}{x")
    assert key_slot(record) == key_slot(topic)
    assert is_engine_key(record)
    # Another app's record of the same schedule id is another key.
    assert record != backfill_record(topic, delayed_topic("app2"), "daily}{x")


@pytest.mark.parametrize(
    "metadata",
    [
        {"schedule": "0 30 2 * * *", "scheduleTimeZone": "Europe/Berlin", "scheduleJitter": "20m"},
        {"schedule": "0 */5 1-3 * * *", "scheduleTimeZone": "Europe/Berlin", "scheduleJitter": "4m"},
        {"schedule": "@every 7m", "scheduleStart": "2026-03-01T00:00:00Z", "scheduleJitter": "5m"},
        {"schedule": "@hourly", "scheduleLimit": "500"},
    ],
)
def test_the_calendar_replayed_is_the_one_the_engine_fires_by(metadata: dict[str, str]) -> None:
    # Each occurrence's due time is the engine's next fire after the one before: so a `fired`
    # record (which names the due time) is matched to its occurrence.
    now = ms("2026-03-02T00:00:00Z")
    ctx = PlanContext(now_ms=now, pubsub_name="p", enabled=True)
    env = plan_publish("orders", b"x", {**metadata, "scheduleId": "k"}, "", ctx).delayed[0].envelope
    schedule = parse_stored_schedule(env.schedule, now_ms=now)
    # From the first whose due time is the engine's first fire (a nominal time at or just
    # before now may be due after it, jittered).
    walk = occurrences(
        schedule, origin_ms=env.published_at_ms, after_ms=now - schedule.jitter_ms - 1, key="k"
    )
    got = list(itertools.islice(itertools.dropwhile(lambda o: o[1] < env.due_ms, walk), 400))
    due = env.due_ms
    for nominal, jittered in got:
        assert jittered == due
        assert 0 <= jittered - nominal < max(schedule.jitter_ms, 1)
        due = next_fire(schedule, start_ms=env.published_at_ms, after_ms=due, key="k") or 0


@pytest.mark.parametrize(
    ("text", "rate"), [("100/s", 100.0), ("100", 100.0), (" 2.5/s ", 2.5), ("0.05/s", 0.05), ("1_000", 1000.0)]
)
def test_a_rate_reads_as_n_per_second_with_or_without_its_unit(text: str, rate: float) -> None:
    assert parse_rate(text) == rate


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("fast", "not a number of occurrences per second"),
        ("", "not a number of occurrences per second"),
        ("/s", "not a number of occurrences per second"),
        ("100/sec", "not a number of occurrences per second"),
        ("0/s", "must be a number more than 0 per second"),
        ("-1", "must be a number more than 0 per second"),
        ("nan", "must be a number more than 0 per second"),
        ("inf", "must be a number more than 0 per second"),
        ("1e999/s", "must be a number more than 0 per second"),
    ],
)
def test_a_rate_that_is_no_finite_positive_number_of_occurrences_per_second_is_refused(
    text: str, why: str
) -> None:
    # The reason alone: the CLI and the dashboard each name their flag or field and the value.
    with pytest.raises(ValueError, match=f"^{why}$"):
        parse_rate(text)


@pytest.mark.parametrize("rate", [float("inf"), float("nan"), 0.0, -1.0])
async def test_a_rate_that_is_no_finite_positive_number_is_refused_naming_it(
    aredis: Make, redis_client: redis.Redis, rate: float
) -> None:
    # A caller of backfill() that did not read the rate with parse_rate.
    _, clock = await published(aredis, "2026-11-28T12:00:00Z", EVERY_MINUTE)
    start = ms("2026-11-28T11:00:00Z")
    with pytest.raises(InvalidArgumentError, match="--rate"):
        await backfill(aredis(), "app", "m", start, start + 10 * 60_000, rate=rate, clock=clock)
    assert not redis_client.exists("orders")


async def test_fires_of_the_schedule_before_a_replace_that_changed_its_jitter_are_not_delivered_again(
    aredis: Make, redis_client: redis.Redis
) -> None:
    clock = ManualClock(ms("2026-11-28T00:20:00Z"))
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=EnvelopeRecurrence())

    async def publish(metadata: Mapping[str, str]) -> None:
        ctx = PlanContext(now_ms=clock.now_ms(), pubsub_name="p", enabled=True)
        await engine.schedule(
            [d.envelope for d in plan_publish("orders", b"tick", metadata, "", ctx).delayed]
        )

    # Fired on the hour at 01:00, 02:00, 03:00; then the same scheduleId is replaced with jitter.
    await publish({**HOURLY_JITTERED, "scheduleJitter": "0s"})
    await fire_until(engine, clock, "2026-11-28T03:15:00Z")
    assert events(redis_client, "fired") == [ms(f"2026-11-28T0{h}:00:00Z") for h in (1, 2, 3)]
    await publish(HOURLY_JITTERED)
    redis_client.delete("orders")
    clock.set(ms("2026-11-28T03:35:00Z"))

    result = await backfill(
        aredis(), "app", "hourly", ms("2026-11-28T00:30:00Z"), ms("2026-11-28T03:30:00Z"), clock=clock
    )

    # Each of those hours was delivered once already, by the schedule itself, under the same id.
    assert (result.deliver, result.fired) == ((), 3)
    assert not redis_client.exists("orders")


async def test_a_range_from_before_1970_is_delivered_not_a_crash(
    aredis: Make, redis_client: redis.Redis
) -> None:
    # RFC 3339 takes any year from 0001: the history (stream ids) starts at 1970, read from there.
    _, clock = await published(aredis, "2026-11-28T12:00:00Z", {"schedule": "0 0 0 * * *", "scheduleId": "d"})
    result = await backfill(
        aredis(), "app", "d", ms("1969-12-30T00:00:00Z"), ms("1970-01-02T00:00:00Z"), clock=clock
    )
    days = ["1969-12-30T00:00:00.000Z", "1969-12-31T00:00:00.000Z", "1970-01-01T00:00:00.000Z"]
    assert result.delivered == 3
    assert [m[SCHEDULE_OCCURRENCE] for m in delivered(redis_client)] == days
    assert events(redis_client, "backfilled") == [ms(d) for d in days]


async def test_working_out_a_long_range_does_not_hold_the_event_loop(
    aredis: Make, redis_client: redis.Redis
) -> None:
    # The dashboard runs backfills in its event loop: its pages and live updates wait on it.
    meta = {
        "schedule": "@daily",
        "scheduleTimeZone": "Europe/Berlin",
        "scheduleJitter": "1h",
        "scheduleId": "j",
    }
    _, clock = await published(aredis, "2026-11-28T12:00:00Z", meta)
    gaps: list[float] = []

    async def tick() -> None:
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(0.01)
            gaps.append(time.monotonic() - t0)

    ticker = asyncio.create_task(tick())
    t0 = time.monotonic()
    start = ms("2000-01-01T00:00:00Z")
    result = await backfill(
        aredis(), "app", "j", start, start + 9_000 * 86_400_000, clock=clock, dry_run=True
    )
    took = time.monotonic() - t0
    ticker.cancel()
    assert len(result.deliver) == 9_000
    # 9,000 days of a zoned, jittered cron are ~0.5 s of CPU (a sparse cron over centuries, seconds):
    # held, the loop's longest wait is most of the call (wall times, so a loaded machine stretches both).
    assert max(gaps) < took / 2, (max(gaps), took)


CATCHING_UP = {"schedule": "@hourly", "scheduleId": "h", "scheduleCatchup": "all"}


async def caught_up_to_0200(aredis: Make) -> tuple[DelayEngine, ManualClock]:
    """Schedule `h` (catch-up `all`) fired at 01:00, then down until 05:30: its first fire there
    delivers 02:00 and the catch-up paces 03:00, 04:00 and 05:00 after it."""
    engine, clock = await published(aredis, "2026-11-28T00:20:00Z", CATCHING_UP)
    await fire_until(engine, clock, "2026-11-28T01:10:00Z")
    clock.set(ms("2026-11-28T05:30:00Z"))
    await engine.fire_due()
    return engine, clock


async def test_a_catch_up_in_progress_keeps_the_occurrences_it_will_fire(
    aredis: Make, redis_client: redis.Redis
) -> None:
    engine, clock = await caught_up_to_0200(aredis)
    result = await backfill(
        aredis(), "app", "h", ms("2026-11-28T00:30:00Z"), ms("2026-11-28T05:30:00Z"), clock=clock
    )
    await fire_until(engine, clock, "2026-11-28T05:31:00Z")
    # The pending occurrence is 03:00 (due at a paced time after now): it and those after are the
    # schedule's own, as for any pending occurrence.
    assert (result.deliver, result.left_to_schedule) == ((), 3)
    hours = [m[SCHEDULE_OCCURRENCE] for m in delivered(redis_client)]
    assert sorted(hours) == [f"2026-11-28T0{h}:00:00.000Z" for h in range(1, 6)]


async def test_a_finished_catch_up_leaves_nothing_to_backfill(
    aredis: Make, redis_client: redis.Redis, fire_path: str
) -> None:
    engine, clock = await caught_up_to_0200(aredis)
    await fire_until(engine, clock, "2026-11-28T05:31:00Z")
    # The paced fires' records name their occurrences (`occ`), their due times being after 05:30;
    # 02:00 fired at its own due time (no `occ`).
    records = [decode_record(i, f) for i, f in stream_entries(redis_client, KEYS.history)]
    named = sorted(r.occurrence_ms for r in records if r.event == "fired" and r.occurrence_ms is not None)
    assert named == [ms(f"2026-11-28T0{h}:00:00Z") for h in range(3, 6)]
    result = await backfill(
        aredis(),
        "app",
        "h",
        ms("2026-11-28T00:30:00Z"),
        ms("2026-11-28T05:30:00Z"),
        clock=clock,
        dry_run=True,
    )
    assert result.deliver == ()


@pytest.mark.parametrize("withdraw", ["cancelled", "replaced"])
async def test_a_schedule_cancelled_or_replaced_mid_backfill_stops_it(
    aredis: Make, redis_client: redis.Redis, withdraw: str
) -> None:
    engine, clock = await published(aredis, "2026-11-28T12:00:00Z", EVERY_MINUTE)
    start = ms("2026-11-28T11:00:00Z")
    # 2/s: chunks of 2, half a second apart between chunks; 20 occurrences would take ~10 s.
    run = asyncio.create_task(backfill(aredis(), "app", "m", start, start + 20 * 60_000, rate=2, clock=clock))
    await wait_until(lambda: redis_client.xlen("orders") >= 2)
    if withdraw == "cancelled":
        assert await engine.cancel("m")
    else:
        ctx = PlanContext(now_ms=clock.now_ms(), pubsub_name="p", enabled=True)
        plan = plan_publish("orders", b"new", {**EVERY_MINUTE, "schedule": "@every 2m"}, "", ctx)
        await engine.schedule([d.envelope for d in plan.delayed])
    at_withdrawal = redis_client.xlen("orders")
    result = await asyncio.wait_for(run, 10)
    # Checked before each chunk: at most the chunk in flight (2) goes out after the withdrawal.
    assert result.stopped == withdraw
    assert result.as_json()["stopped"] == withdraw
    assert result.delivered == redis_client.xlen("orders") <= at_withdrawal + 2
    assert result.delivered < 20
    assert events(redis_client, "backfilled") == list(result.deliver)


# Run by a release's own Python package: each history entry (JSON lines of [stream id, fields]) as
# that release's decode_record reads it, and (where it has one) its record_problem's verdict.
READ_WITH_RELEASE = """
import json, sys
from delayed_middleware import history
assert history.__file__.startswith(sys.argv[1]), history.__file__  # that release's, not this one's
for line in sys.stdin:
    i, f = json.loads(line)
    r = history.decode_record(i, f)
    problem = history.record_problem(f) if hasattr(history, "record_problem") else None
    print(json.dumps([r.event, r.id, r.due_ms, r.at_ms, r.lateness_ms, problem]))
"""


@pytest.mark.parametrize("version", ["0.1.0", "0.2.0"])
async def test_an_earlier_release_reads_a_fired_record_naming_its_occurrence(
    aredis: Make, redis_client: redis.Redis, tmp_path_factory: pytest.TempPathFactory, version: str
) -> None:
    # A rollback reads the records this release wrote: the history is a flat field set, and an
    # earlier release's reader (its own package, from this repository's history) ignores `occ`.
    tree = release_tree(tmp_path_factory, version)
    engine, clock = await caught_up_to_0200(aredis)
    await fire_until(engine, clock, "2026-11-28T05:31:00Z")
    rows = stream_entries(redis_client, KEYS.history)
    assert any(b"occ" in f for _, f in rows)
    lines = "".join(
        json.dumps([str(i), {k.decode(): v.decode() for k, v in f.items()}]) + "\n" for i, f in rows
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        READ_WITH_RELEASE,
        str(tree),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(tree / "middleware")},
    )
    out, err = await proc.communicate(lines.encode())
    assert proc.returncode == 0, err.decode()
    then = [json.loads(line) for line in out.decode().splitlines()]
    now = [decode_record(i, f) for i, f in rows]
    assert then == [[r.event, r.id, r.due_ms, r.at_ms, r.lateness_ms, None] for r in now]
