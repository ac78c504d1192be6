"""Recurring schedules against a real Redis: each occurrence once with its scheduleNext, missed
fires once on recovery, replace by scheduleId, scheduleSource sampling, and @every successors
computed in the fire step itself (on the grid, formatted exactly as Python does)."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Callable

import pytest
import redis
import redis.asyncio as aioredis

from delayed_middleware.clock import ManualClock
from delayed_middleware.engine import DelayEngine, EngineConfig
from delayed_middleware.entry import decode_entry
from delayed_middleware.instants import format_instant
from tests.middleware.engine.helpers import (
    KEYS,
    T0,
    drain,
    engine_libraries,
    every,
    every_env,
    history,
    payloads,
    recurring,
    target,
)


@pytest.mark.both_fire_paths
async def test_recurring_fires_every_occurrence_once_with_schedule_next(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=every)
    [rid] = await engine.schedule([recurring(1, 1_000)])
    for k in range(1, 6):
        clock.set(T0 + k * 1_000 - 1)
        await drain(engine)
        assert len(target(redis_client)) == k - 1
        clock.set(T0 + k * 1_000)
        await drain(engine)
        entries = [decode_entry(f) for _, f in target(redis_client)]
        assert len(entries) == k
        assert entries[-1].metadata == {
            "k": "v1",
            "scheduler": rid,
            "scheduleNext": format_instant(T0 + (k + 1) * 1_000),
            "scheduleOccurrence": format_instant(T0 + k * 1_000),
        }
        assert await engine.pending() == 1
        assert redis_client.zcard(KEYS.refill) == 0
    assert await engine.cancel(rid)
    clock.set(T0 + 60_000)
    await drain(engine)
    assert len(target(redis_client)) == 5
    assert await engine.pending() == 0
    for key in (KEYS.ids, KEYS.refill, KEYS.due):
        assert redis_client.exists(key) == 0
    assert target(redis_client, KEYS.stream) == []


@pytest.mark.both_fire_paths
@pytest.mark.parametrize("successor", ["refilled by the replica", "computed by the fire step"])
async def test_missed_fires_fire_once_on_recovery_then_continue(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, successor: str
) -> None:
    """Both ways a successor is found (a replica's recurrence and REFILL, or @every's grid
    in the fire script) follow the same missed-fires policy."""
    clock = ManualClock(T0)
    if successor == "refilled by the replica":
        engine = DelayEngine(aredis(), KEYS, clock, recurrence=every)
        await engine.schedule([recurring(1, 1_000, sid="tick")])
    else:
        engine = DelayEngine(aredis(), KEYS, clock, recurrence=None)
        await engine.schedule([every_env(1_000, sid="tick")])
    clock.set(T0 + 1_000)
    await drain(engine)
    clock.set(T0 + 10_500)  # down across eight fire times
    await drain(engine)
    await drain(engine)
    entries = [decode_entry(f) for _, f in target(redis_client)]
    assert len(entries) == 2
    assert entries[-1].metadata["scheduleNext"] == format_instant(T0 + 11_000)
    clock.set(T0 + 10_999)
    await drain(engine)
    assert len(target(redis_client)) == 2
    clock.set(T0 + 11_000)
    await drain(engine)
    assert len(target(redis_client)) == 3


@pytest.mark.both_fire_paths
async def test_racing_replicas_fire_each_recurring_occurrence_exactly_once(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(T0)
    engines = [DelayEngine(aredis(), KEYS, clock, recurrence=every) for _ in range(5)]
    await engines[0].schedule([recurring(i, 1_000 + 10 * (i % 3)) for i in range(60)])
    for step in range(1, 13):
        clock.set(T0 + step * 1_000 + 25)
        await asyncio.gather(*(drain(e) for e in engines))
    got = payloads(redis_client)
    expected = {
        i: sum(1 for s in range(1, 13) if s * 1_000 + 25 >= (1_000 + 10 * (i % 3))) for i in range(60)
    }
    # occurrences of interval d up to t: floor(t / d)
    expected = {i: (12 * 1_000 + 25) // (1_000 + 10 * (i % 3)) for i in range(60)}
    assert {i: got.count(i) for i in range(60)} == expected
    assert await engines[0].pending() == 60


@pytest.mark.both_fire_paths
async def test_recurring_replaced_by_id_fires_only_the_new_one(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=every)
    await engine.schedule([recurring(1, 1_000, sid="job")])
    await engine.schedule([recurring(2, 500, sid="job")])
    clock.set(T0 + 1_000)
    await drain(engine)
    assert payloads(redis_client) == [2]
    assert await engine.pending() == 1
    assert len(target(redis_client, KEYS.stream)) == 1


@pytest.mark.both_fire_paths
async def test_schedule_source_delivers_the_latest_message_or_nothing(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=every)
    [rid] = await engine.schedule([recurring(1, 1_000, schedule_source="sensor", schedule_ttl_ms=30_000)])
    clock.set(T0 + 1_000)
    await drain(engine)
    assert target(redis_client) == []  # the source is empty: nothing
    redis_client.xadd("sensor", {"data": b"21C", "metadata": b'{"unit":"C"}'})
    redis_client.xadd("sensor", {"data": b"22C", "metadata": b'{"unit":"C"}', "contentType": b"text/plain"})
    clock.set(T0 + 2_000)
    await drain(engine)
    [(_, fields)] = target(redis_client)
    e = decode_entry(fields)
    assert (e.data, e.content_type, e.expires_at_ms) == (b"22C", "text/plain", T0 + 2_000 + 30_000)
    assert e.metadata == {
        "unit": "C",
        "scheduler": rid,
        "scheduleNext": format_instant(T0 + 3_000),
        "scheduleOccurrence": format_instant(T0 + 2_000),
    }


def _lua_iso(client: redis.Redis, values: list[int]) -> list[str]:
    libs = engine_libraries("index.lua", "decode.lua", "history.lua", "common.lua")
    body = "local out = {} for i, v in ipairs(ARGV) do out[i] = iso_ms(tonumber(v)) end return out"
    return [v.decode() for v in client.eval(libs + "\n" + body, 0, *values)]


def test_the_fire_step_formats_schedule_next_exactly_as_python(redis_client: redis.Redis) -> None:
    """The Lua formatter behind an @every message's scheduleNext equals format_instant:
    edges of the calendar (year 1, leap days, centuries, 9999's last ms) and 20,000 random ms."""
    from delayed_middleware.instants import MAX_INSTANT_MS, MIN_INSTANT_MS, parse_instant

    edges = [MIN_INSTANT_MS, MAX_INSTANT_MS, 0, -1, 1, T0, 951_782_400_000, 951_868_799_999]
    for text in ("2000-02-29T23:59:59.999Z", "1900-03-01T00:00:00.000Z", "2024-12-31T12:00:00.500Z",
                 "1600-02-29T00:00:00.001Z", "0004-02-29T00:00:00.000Z", "9999-12-31T00:00:00.000Z"):  # fmt: skip
        edges.append(parse_instant(text))
    rng = random.Random(11)
    values = edges + [rng.randint(MIN_INSTANT_MS, MAX_INSTANT_MS) for _ in range(20_000)]
    for i in range(0, len(values), 2_000):
        part = values[i : i + 2_000]
        assert _lua_iso(redis_client, part) == [format_instant(v) for v in part]


@pytest.mark.both_fire_paths
async def test_every_fires_on_its_grid_without_refills_for_1000_occurrences(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """No replica computes an @every successor (no recurrence function at all): the fire
    step does, from the acceptance instant, so 1,000 fires fired late by a varying amount
    still fall on T0 + k * 1 s, and each message names the next grid point."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=None)
    await engine.schedule([every_env(1_000, sid="tick")])
    rng = random.Random(3)
    for k in range(1, 1_001):
        clock.set(T0 + k * 1_000 + rng.randrange(0, 900))  # late, never a whole interval
        await drain(engine)
        assert redis_client.zcard(KEYS.refill) == 0
    nexts = [decode_entry(f).metadata["scheduleNext"] for _, f in target(redis_client)]
    assert nexts == [format_instant(T0 + (k + 1) * 1_000) for k in range(1, 1_001)]
    fired = [r for r in history(redis_client) if r.event == "fired"]
    assert [r.due_ms for r in fired] == [T0 + k * 1_000 for k in range(1, 1_001)]


@pytest.mark.both_fire_paths
async def test_every_replaced_or_cancelled_stops_and_the_end_of_time_purges(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    from delayed_middleware.instants import MAX_INSTANT_MS

    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=None)
    await engine.schedule([every_env(1_000, sid="a"), every_env(1_000, sid="b")])
    clock.set(T0 + 1_000)
    await drain(engine)
    assert await engine.cancel("a")
    await engine.schedule([every_env(5_000, sid="b", published=T0 + 1_000)])  # replaces b
    clock.set(T0 + 5_000)
    await drain(engine)
    assert len(target(redis_client)) == 2  # a and b once each, then nothing until b's new grid
    clock.set(T0 + 6_000)
    await drain(engine)
    assert [decode_entry(f).metadata["scheduler"] for _, f in target(redis_client)][-1] == "b"
    assert await engine.cancel("b")
    # A grid whose next point falls after year 9999: the last occurrence says purge and goes.
    last = MAX_INSTANT_MS - 500
    clock.set(last - 1_000)
    await engine.schedule([every_env(1_000, sid="end", published=last - 1_000)])
    clock.set(last)
    await drain(engine)
    assert decode_entry(target(redis_client)[-1][1]).metadata["scheduleNext"] == "purge"
    assert await engine.pending() == 0
    assert redis_client.exists(KEYS.ids) == 0


@pytest.mark.parametrize("two_phase", [False, True])
async def test_old_format_every_envelopes_keep_their_grid_beside_new_ones(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, two_phase: bool
) -> None:
    """Envelopes stored before everyMs existed (an '@every' expression, no interval) go the
    cron way (successor from the replica's recurrence, REFILLed by the fire step's own
    reply); new ones advance in Lua. Side by side, through an outage, both stay on
    published + k * 1 s, fire once after the outage, and name the same next time."""
    from delayed_middleware.schedules import EnvelopeRecurrence

    clock = ManualClock(T0)
    config = EngineConfig(two_phase=two_phase)
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=EnvelopeRecurrence(), config=config)
    old = dataclasses.replace(every_env(1_000, sid="old"), every_ms=0, schedule="@every 1s")
    new = dataclasses.replace(every_env(1_000, sid="new"), schedule="@every 1s")
    await engine.schedule([old, new])
    for now in (T0 + 1_000, T0 + 2_300, T0 + 9_500, T0 + 10_000):
        clock.set(now)
        await drain(engine)
    rows = [decode_entry(f).metadata for _, f in target(redis_client)]
    by = {s: [m["scheduleNext"] for m in rows if m["scheduler"] == s] for s in ("old", "new")}
    expected = [format_instant(T0 + k) for k in (2_000, 3_000, 10_000, 11_000)]
    assert by == {"old": expected, "new": expected}
    assert redis_client.zcard(KEYS.refill) == 0
