"""Refills (storing a cron schedule's next occurrence after FIRE) against a real Redis: a replica
that stops between FIRE and REFILL strands nothing, a replica without a recurrence leaves the
schedule to one with it, and a replace or cancel racing the refill wins."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from delayed_middleware import lua_scripts
from delayed_middleware.clock import ManualClock, SystemClock
from delayed_middleware.engine import DelayEngine, EngineConfig
from delayed_middleware.entry import decode_entry
from delayed_middleware.instants import format_instant
from tests.middleware.engine.helpers import (
    KEYS,
    T0,
    bare_fire,
    drain,
    every,
    history,
    named_recurring,
    payloads,
    raw_schedule,
    recurring,
    target,
)


@pytest.mark.both_fire_paths
async def test_crash_between_fire_and_refill_loses_and_doubles_nothing(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=every)
    await engine.schedule([recurring(1, 1_000, sid="tick")])
    # A replica fires occurrence 1 and dies before computing the one after next:
    # the bare FIRE script, without the engine's refill step.
    redis_client.eval(
        lua_scripts.FIRE, len(KEYS.script_keys), *KEYS.script_keys,
        *(KEYS.buckets, T0 + 1_000, 500, 2000, 1 << 20, "", "", 100),
    )  # fmt: skip
    assert redis_client.zrange(KEYS.refill, 0, -1) == [b"tick"]
    # Occurrence 2 comes: another replica completes the refill first, then fires it once.
    clock.set(T0 + 2_000)
    await drain(engine)
    clock.set(T0 + 3_000)
    await drain(engine)
    nexts = [decode_entry(f).metadata["scheduleNext"] for _, f in target(redis_client)]
    assert nexts == [format_instant(T0 + t) for t in (2_000, 3_000, 4_000)]


@pytest.mark.both_fire_paths
async def test_a_refill_left_by_a_stopped_replica_is_completed_by_a_running_one(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """Replica A fires occurrence 1 and stops before REFILL; replica B's FIRE at occurrence 2
    takes the envelope out of the index to wait for its refill, and B stops too (a rolling
    update). A replica that was already running refilled only at its own start or after a
    Redis error: the schedule never fired again."""
    clock = SystemClock()
    t0 = clock.now_ms()
    survivor = DelayEngine(aredis(), KEYS, clock, recurrence=every, config=EngineConfig(max_sleep_s=0.1))
    task = asyncio.create_task(survivor.run())
    try:
        await asyncio.sleep(0.3)  # past its start-up refill
        # Its next time is unknown ("-"), as after A fired it and stopped before REFILL.
        raw_schedule(redis_client, named_recurring("tick", t0 + 200, t0 - 99_800, 100_000, 1), t0, "-")
        # "B": its FIRE finds no next time, parks the occurrence for REFILL, then B stops.
        bare_fire(redis_client, t0 + 200)
        assert redis_client.zrange(KEYS.refill, 0, -1) == [b"tick"]
        for _ in range(60):
            if target(redis_client):
                break
            await asyncio.sleep(0.1)
        assert payloads(redis_client) == [1]
        assert await survivor.pending() == 1
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.mark.both_fire_paths
async def test_an_engine_without_recurrence_does_not_cancel_recurring_schedules(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """The component builds its engine without a recurrence function (cron is another
    issue): during a rolling upgrade such a replica met a refill and cancelled the schedule
    ("needs the engine's recurrence function" treated as unschedulable)."""
    clock = ManualClock(T0)
    raw_schedule(redis_client, named_recurring("cron", T0 + 1_000, T0, 1_000, 1), T0, "-")
    clock.set(T0 + 1_000)
    plain = DelayEngine(aredis(), KEYS, clock)
    await drain(plain)
    await plain.refill_pending()
    assert redis_client.hexists(KEYS.ids, "cron")
    assert [h.event for h in history(redis_client)] == ["scheduled"]
    capable = DelayEngine(aredis(), KEYS, clock, recurrence=every)
    await drain(capable)
    assert payloads(redis_client) == [1]
    assert await capable.pending() == 1


@pytest.mark.both_fire_paths
async def test_a_fire_batch_refills_its_cron_envelopes_itself(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fire step hands back what the recurrence needs (expression, acceptance time), so
    the firing replica stores 1,000 successors in the same fire_due, without the refill-set
    sweep (which would read every ref and envelope back first)."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=every)
    await engine.schedule([recurring(i, 1_000, sid=f"c{i}") for i in range(1_000)])

    async def no_sweep(limit: int = 0) -> int:
        raise AssertionError("the sweep ran: the fire step's refills were not applied directly")

    # On the refiller the fire step calls (the facade's refill_pending is not on its path).
    monkeypatch.setattr(engine.parts.refiller, "refill_pending", no_sweep)
    for k in (1, 2, 3):
        clock.set(T0 + k * 1_000)
        await drain(engine)
        assert redis_client.zcard(KEYS.refill) == 0
        assert len(target(redis_client)) == 1_000 * k
    nexts = {decode_entry(f).metadata["scheduleNext"] for _, f in target(redis_client)[-1_000:]}
    assert nexts == {format_instant(T0 + 4_000)}


async def test_a_replace_racing_refill_pending_is_not_cancelled(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cron schedule waits for its refill (its replica stopped between FIRE and REFILL,
    or an outage passed its successor). The publisher replaces it (same scheduleId) while a
    replica's refill_pending sweep is between its two reads."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=every)
    publisher = DelayEngine(aredis(), KEYS, clock, recurrence=every)
    # Stored with its successor unknown, as a replica that fired it and stopped left it.
    raw_schedule(redis_client, named_recurring("c", T0 + 1_000, T0, 1_000, 1), T0, "-")
    clock.set(T0 + 1_000)
    redis_client.zadd(KEYS.refill, {"c": T0 + 1_000})
    real_pipeline = engine.state.redis.pipeline
    calls = 0

    def pipeline(transaction: bool = True) -> Any:
        pipe = real_pipeline(transaction=transaction)
        real_execute = pipe.execute

        async def execute(raise_on_error: bool = True) -> Any:
            nonlocal calls
            out = await real_execute(raise_on_error)
            calls += 1
            if calls == 1:  # the refs were read; the replace lands now
                await publisher.schedule([named_recurring("c", T0 + 5_000, T0, 5_000, 2)])
            return out

        monkeypatch.setattr(pipe, "execute", execute)
        return pipe

    monkeypatch.setattr(engine.state.redis, "pipeline", pipeline)
    await engine.refill_pending()
    monkeypatch.undo()
    assert redis_client.hexists(KEYS.ids, "c")  # the replacement stands
    clock.set(T0 + 5_000)
    await drain(engine)
    assert [decode_entry(f).data for _, f in target(redis_client)] == [b'{"n":2}']


async def test_a_replace_or_cancel_between_fire_and_its_refill_wins(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FIRE hands back the cron envelopes it advanced; before the replica's REFILL lands,
    one schedule is replaced and another cancelled. The compare-and-set leaves both alone:
    the replacement keeps its own next time, the cancelled one stays gone, nothing waits
    in the refill set, and a third is refilled as usual."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=every)
    await engine.schedule([named_recurring(s, T0 + 1_000, T0, 1_000, n) for n, s in enumerate("abc")])
    real_advance = engine.parts.refiller.advance

    async def racing_advance(quads: Any) -> None:
        if quads:
            await engine.schedule([named_recurring("a", T0 + 5_000, T0, 5_000, 9)])
            assert await engine.cancel("b")
        await real_advance(quads)

    monkeypatch.setattr(engine.parts.refiller, "advance", racing_advance)
    clock.set(T0 + 1_000)
    await drain(engine)
    monkeypatch.undo()
    assert redis_client.zcard(KEYS.refill) == 0
    assert not redis_client.hexists(KEYS.ids, "b")
    for now in (T0 + 2_000, T0 + 3_000, T0 + 5_000):
        clock.set(now)
        await drain(engine)
    got = [(decode_entry(f).metadata["scheduler"], decode_entry(f).data) for _, f in target(redis_client)]
    assert [d for s, d in got if s == "a"] == [b'{"n":0}', b'{"n":9}']
    assert [d for s, d in got if s == "b"] == [b'{"n":1}']
    assert [d for s, d in got if s == "c"] == [b'{"n":2}'] * 4
