"""The engine's run loop against a real Redis: woken on time by another replica's schedule,
alive through a Redis restart and through a recurrence that raises."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import pytest
import redis
import redis.asyncio as aioredis

from delayed_middleware.clock import SystemClock
from delayed_middleware.engine import DelayEngine, EngineConfig
from delayed_middleware.envelope import Envelope
from tests.middleware.engine.helpers import (
    KEYS,
    env,
    every,
    history,
    named_recurring,
    payloads,
    raw_schedule,
)
from tests.redis_server import RedisServer, stream_entries


@pytest.mark.both_fire_paths
async def test_run_loop_wakes_exactly_on_time(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = SystemClock()
    engine = DelayEngine(aredis(), KEYS, clock)
    other = DelayEngine(aredis(), KEYS, clock)  # another replica publishing
    await engine.schedule([env(0, clock.now_ms() + 60_000)])  # a far head: the loop sleeps long
    task = asyncio.create_task(engine.run())
    try:
        await asyncio.sleep(0.2)
        due = clock.now_ms() + 300
        await other.schedule([env(1, due)])
        arrived = await _wait_for_entries(redis_client, "orders", 1, within_s=3)
        assert arrived[0] >= due, "delivered early"
        assert arrived[0] - due < 100, f"late by {arrived[0] - due} ms"
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


@pytest.mark.both_fire_paths
async def test_run_loop_survives_redis_restart(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, redis_server: RedisServer
) -> None:
    clock = SystemClock()
    engine = DelayEngine(aredis(), KEYS, clock, config=EngineConfig(max_sleep_s=0.5))
    task = asyncio.create_task(engine.run())
    try:
        await engine.schedule([env(1, clock.now_ms() + 1500)])
        await asyncio.sleep(0.2)
        await asyncio.to_thread(redis_server.restart)  # AOF keeps the pending message
        await _wait_for_entries(redis_server.client(), "orders", 1, within_s=8)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def _wait_for_entries(client: redis.Redis, topic: str, n: int, within_s: float) -> list[int]:
    """Arrival times (ms, from the entry ids Redis assigned) of the first n entries."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            entries = stream_entries(client, topic)
        except redis.ConnectionError:
            entries = []
        if len(entries) >= n:
            return [int(i.split("-")[0]) for i, _ in entries]
        await asyncio.sleep(0.005)
    raise AssertionError(f"{topic}: fewer than {n} entries after {within_s}s")


@pytest.mark.both_fire_paths
async def test_engine_loop_survives_a_recurrence_that_raises(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """A recurrence (cron library) that raises something other than ValueError killed the
    engine task: no delayed message of the app fired any more."""

    def broken(e: Envelope, after: int) -> int | None:
        if e.schedule_id == "bad":
            raise TypeError("a bug in a cron library")
        return every(e, after)

    clock = SystemClock()
    t0 = clock.now_ms()
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=broken, config=EngineConfig(max_sleep_s=0.1))
    # "bad" is stored with a next time, so schedule() itself does not call the recurrence.
    raw_schedule(redis_client, named_recurring("bad", t0 + 100, t0, 100, 0), t0, t0 + 200)
    task = asyncio.create_task(engine.run())
    try:
        await engine.schedule([env(5, t0 + 600)])
        for _ in range(60):
            if 5 in payloads(redis_client):
                break
            await asyncio.sleep(0.1)
        assert not task.done(), task.exception() if task.done() else None
        assert 5 in payloads(redis_client)
        # The schedule it cannot advance is withdrawn, visibly.
        [gone] = [h for h in history(redis_client) if h.event == "cancelled"]
        assert gone.id == "bad"
        assert "a bug in a cron library" in gone.reason
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, TypeError):
            await task
