"""The two-phase fire (CLAIM, APPEND, RELEASE: Redis Cluster's path) against a real Redis.

Every promise the two paths share is tested on both: those tests carry the `both_fire_paths`
mark (tests/middleware/engine/conftest.py) and run once through each path. Here are the
two-phase path's own: its history order, APPEND calls bounded by bytes, and a cancel that
lands between APPEND and RELEASE. Its crash points and leases are proved on a real cluster
(test_cluster.py).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis
import redis.asyncio as aioredis

from delayed_middleware.clock import ManualClock
from delayed_middleware.engine import DelayEngine, EngineConfig
from tests.middleware.engine.helpers import (
    KEYS,
    T0,
    drain,
    env,
    every,
    history,
    recurring,
    target,
    two_phase_engines,
)


@pytest.fixture(autouse=True)
def two_phase(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    two_phase_engines(request.module, monkeypatch)


async def test_history_in_the_two_phase_path(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """The same records as FIRE's; a wrong-type target is learnt in APPEND, so its
    'parked' comes after CLAIM's 'expired', with the 'fired' of the same RELEASE."""
    redis_client.hset("a-hash", "f", "v")
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock)
    await engine.schedule([env(1, T0 + 100, sid="x")])
    await engine.schedule([env(2, T0 + 200, sid="x")])  # replaces x
    await engine.schedule([env(3, T0 + 100, sid="y"), env(4, T0 + 100, topic="a-hash")])
    await engine.schedule([env(5, T0 + 100, expires_at_ms=T0 + 1)])
    assert await engine.cancel("y")
    clock.set(T0 + 250)
    await drain(engine)
    h = history(redis_client)
    assert [r.event for r in h[:7]] == ["scheduled", "replaced", *["scheduled"] * 4, "cancelled"]
    assert [r.event for r in h[7:]] == ["expired", "parked", "fired"]
    parked, fired = h[8], h[9]
    assert (parked.topic, parked.reason) == ("a-hash", "WRONGTYPE: the key is a hash, not a stream")
    assert (fired.id, fired.due_ms, fired.lateness_ms, fired.at_ms) == ("x", T0 + 200, 50, T0 + 250)
    assert redis_client.hlen(KEYS.parked) == 1
    assert redis_client.zcard(KEYS.inflight) == 0


async def test_sampled_messages_split_append_calls_by_bytes(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """20 schedules sampling a 1 MiB message: CLAIM takes them in one batch (it
    cannot see the sample's size), but no APPEND call carries more than 4 MiB,
    and each message is delivered once."""
    calls: list[str] = []

    async def count(point: str) -> None:
        calls.append(point)

    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=every, fault=count)
    redis_client.xadd("sensor", {"data": b"x" * (1 << 20), "metadata": b"{}"})
    await engine.schedule([recurring(i, 1_000, schedule_source="sensor") for i in range(20)])
    clock.set(T0 + 1_000)
    await drain(engine)
    assert redis_client.xlen("orders") == 20
    appends = [c for c in calls if c.startswith("appended:")]
    assert len(appends) >= 5  # 20 MiB in runs of at most 4 MiB


async def test_a_cancel_after_the_append_leaves_a_fired_record_not_a_cancelled_one(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """Two-phase fire on one node: the cancel lands between APPEND and RELEASE. It is too
    late and says so (False); the history must then say the message fired."""
    clock = ManualClock(T0)
    canceller = DelayEngine(aredis(), KEYS, clock, config=EngineConfig(two_phase=True))
    await canceller.schedule([env(1, T0 + 100, sid="s1")])
    answers: list[bool] = []

    async def cancel_after_append(at: str) -> None:
        if at == "appended:1":
            answers.append(await canceller.cancel("s1"))

    firer = DelayEngine(aredis(), KEYS, clock, config=EngineConfig(two_phase=True), fault=cancel_after_append)
    clock.set(T0 + 100)
    await drain(firer)
    assert answers == [False]
    assert len(target(redis_client)) == 1  # it went out, once
    events = [r.event for r in history(redis_client) if r.id == "s1"]
    assert events == ["scheduled", "fired"]
