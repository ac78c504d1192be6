"""One fire call's work is bounded whatever the envelopes carry: entries, bytes (metadata and
sampled messages included) and time, and one envelope above the budget still fires alone."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis
import redis.asyncio as aioredis

from delayed_middleware.clock import ManualClock
from delayed_middleware.engine import DelayEngine, EngineConfig, FireReport
from delayed_middleware.envelope import BulkEntry, Envelope
from tests.middleware.engine.helpers import (
    KEYS,
    T0,
    drain,
    env,
    every,
    payloads,
    recurring,
    target,
)


@pytest.mark.both_fire_paths
async def test_fire_batches_are_budgeted_by_entries(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    reports: list[FireReport] = []
    # No time budget: on a busy machine it may cut a call after one 1,000-entry
    # envelope (the clock is read after every costly one), and this is about entries.
    engine = DelayEngine(
        aredis(),
        KEYS,
        ManualClock(T0),
        config=EngineConfig(batch_entries=2_000, fire_budget_us=0),
        on_batch=reports.append,
    )
    bulk = [
        Envelope(
            id="",
            topic="orders",
            due_ms=T0,
            published_at_ms=T0,
            bulk_entries=[BulkEntry(f"{b}-{i}", f'{{"n":{b * 1000 + i}}}'.encode()) for i in range(1000)],
        )
        for b in range(12)
    ]
    await engine.schedule(bulk)
    await drain(engine)
    assert len(target(redis_client)) == 12_000
    assert max(r.entries for r in reports) == 2_000
    assert [r.fired for r in reports if r.fired] == [2] * 6


@pytest.mark.both_fire_paths
async def test_one_envelope_above_the_budget_still_fires_alone(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0), config=EngineConfig(batch_bytes=10))
    await engine.schedule([env(1, T0), env(2, T0)])
    assert await engine.fire_due() == (1, T0)
    assert await engine.fire_due() == (1, None)
    assert payloads(redis_client) == [1, 2]


@pytest.mark.both_fire_paths
async def test_fire_batches_stop_at_their_time_budget(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    reports: list[FireReport] = []
    engine = DelayEngine(
        aredis(), KEYS, ManualClock(T0), config=EngineConfig(fire_budget_us=1), on_batch=reports.append
    )
    await engine.schedule([env(i, T0) for i in range(100)])
    await drain(engine)
    assert sorted(payloads(redis_client)) == list(range(100))
    # Time is checked every eight envelopes: a 1 us budget stops each call there.
    assert max(r.fired for r in reports) == 8
    assert await engine.pending() == 0


def heavy(n: int, *, keys: int = 0, value_bytes: int = 0) -> Envelope:
    """A message with a tiny payload and a lot of metadata: `keys` keys, or one key of `value_bytes`."""
    metadata = {f"k{i}": "v" for i in range(keys)} if keys else {"big": "v" * value_bytes}
    return Envelope(
        id="",
        topic="orders",
        due_ms=T0,
        published_at_ms=T0,
        message=f'{{"n":{n}}}'.encode(),
        metadata=metadata,
    )


@pytest.mark.both_fire_paths
async def test_metadata_pairs_count_against_the_fire_budget(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """Metadata keys were free in the budget: 500 messages of 4,000 metadata keys each fired
    in one script call (2M pairs decoded and JSON-encoded: seconds of blocked Redis)."""
    reports: list[FireReport] = []
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0), on_batch=reports.append)
    await engine.schedule([heavy(i, keys=4_000) for i in range(6)])
    await drain(engine)
    assert sorted(payloads(redis_client)) == list(range(6))
    # 4,000 pairs are 1,000 units of work of the 2,000 a call may do (with the entry).
    assert [r.fired for r in reports] == [1] * 6


@pytest.mark.both_fire_paths
async def test_metadata_bytes_count_against_the_fire_budget(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """Only payload bytes were counted: messages with 1 MiB metadata values and a 7-byte
    payload all fired in one call, however many."""
    reports: list[FireReport] = []
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0), on_batch=reports.append)
    await engine.schedule([heavy(i, value_bytes=1 << 20) for i in range(10)])
    await drain(engine)
    assert sorted(payloads(redis_client)) == list(range(10))
    assert max(r.fired for r in reports) <= 3  # 4 MiB per call, metadata included


@pytest.mark.both_fire_paths
async def test_costly_envelopes_read_the_clock_before_the_next(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """The time budget was checked every 8 envelopes whatever they cost: 8 costly ones ran
    before the first look at the clock."""
    reports: list[FireReport] = []
    engine = DelayEngine(
        aredis(),
        KEYS,
        ManualClock(T0),
        config=EngineConfig(fire_budget_us=1, batch_entries=1 << 30, batch_bytes=1 << 30),
        on_batch=reports.append,
    )
    await engine.schedule([heavy(i, keys=200) for i in range(16)])
    await drain(engine)
    assert sorted(payloads(redis_client)) == list(range(16))
    assert max(r.fired for r in reports) == 1


async def test_sampled_messages_count_against_the_fire_budget(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """A scheduleSource's latest message is copied at each fire, whatever its size; it was
    not counted: 20 schedules sampling a 1 MiB message fired as 20 MiB in one call."""
    reports: list[FireReport] = []
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=every, on_batch=reports.append)
    redis_client.xadd("sensor", {"data": b"x" * (1 << 20), "metadata": b"{}"})
    await engine.schedule([recurring(i, 1_000, schedule_source="sensor") for i in range(20)])
    clock.set(T0 + 1_000)
    await drain(engine)
    assert redis_client.xlen("orders") == 20
    assert max(r.fired for r in reports) <= 4  # 4 MiB per call
