"""The two-phase fire (CLAIM, APPEND, RELEASE: Redis Cluster's path) against a real Redis.

First, every single-node engine test runs again with the fire routed through
the two-phase path: both paths must give users the same results. Then the
two-phase path's own promises: every crash point loses and doubles nothing,
and a claim whose lease ended is taken over.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis
import redis.asyncio as aioredis

from delayed_middleware.clock import ManualClock
from delayed_middleware.engine import DelayEngine
from tests.middleware import test_engine, test_engine_attacks, test_engine_v2
from tests.middleware.test_engine import KEYS, T0, env
from tests.middleware.test_engine_v2 import drain, every, history, recurring

# Same records, another order: the two-phase path learns a target's wrong type
# in APPEND, so its 'parked' record comes after the batch's 'expired' ones
# (test_history_in_the_two_phase_path below checks its records).
# A scheduleSource's sample lives in another slot than the shard, so CLAIM
# cannot count it against the batch; the two-phase path bounds each APPEND
# call by bytes instead (test_sampled_messages_split_append_calls_by_bytes).
_FIRE_ONLY: frozenset[str] = frozenset(
    {"test_history_records_every_transition", "test_sampled_messages_count_against_the_fire_budget"}
)


@pytest.fixture(autouse=True)
def two_phase(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(DelayEngine, "_fire_once", DelayEngine._fire_two_phase)


for _module in (test_engine, test_engine_v2, test_engine_attacks):
    for _name in dir(_module):
        if _name.startswith("test_") and _name not in _FIRE_ONLY:
            globals()[f"{_name}__two_phase"] = getattr(_module, _name)


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
