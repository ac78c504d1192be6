"""FIRE reads the envelopes of a due batch a span of the delayed topic at a time (read-ahead):
envelopes due together but stored apart, or deleted under it, still fire exactly once, and what is not due stays pending however close to a due one it is stored."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from delayed_middleware.clock import ManualClock
from delayed_middleware.engine import DelayEngine, EngineConfig
from delayed_middleware.entry import decode_entry
from tests.middleware.engine.helpers import KEYS, T0, drain, env, target


def _xrange_calls(client: redis.Redis) -> int:
    stats: dict[str, Any] = client.info("commandstats")
    return int(stats.get("cmdstat_xrange", {"calls": 0})["calls"])


def _fired(client: redis.Redis) -> list[int]:
    return [json.loads(decode_entry(f).data)["n"] for _, f in target(client)]


async def test_envelopes_stored_together_are_read_a_span_at_a_time(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """1,000 envelopes due at one instant, stored by one publish: read with a few range reads,
    not one XRANGE each, and every one fired once."""
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0), config=EngineConfig(fire_budget_us=0))
    await engine.schedule([env(i, T0) for i in range(1_000)])
    before = _xrange_calls(redis_client)
    await drain(engine)
    assert _xrange_calls(redis_client) - before < 100
    assert sorted(_fired(redis_client)) == list(range(1_000))


@pytest.mark.parametrize(
    ("every", "n"),
    [
        # Due and not-yet-due envelopes stored alternately: a span read holds both.
        (2, 600),
        # One due envelope per 50 stored: the span reads stop paying, each is read alone.
        (50, 5_000),
    ],
)
async def test_what_is_stored_between_due_envelopes_but_not_due_stays_pending(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, every: int, n: int
) -> None:
    """Only the due envelopes fire, each once; the others stay pending and fire at their own
    time, each once."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock)
    await engine.schedule([env(i, T0 if i % every == 0 else T0 + 86_400_000) for i in range(n)])
    await drain(engine)
    assert sorted(_fired(redis_client)) == list(range(0, n, every))
    assert await engine.pending() == n - n // every
    clock.advance(86_400_000)
    await drain(engine)
    assert sorted(_fired(redis_client)) == list(range(n))


async def test_envelopes_deleted_inside_a_span_are_reported_gone_and_the_rest_fire_once(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """An operator's XDEL of every seventh envelope of a burst: those are reported lost, the
    others fire once, and nothing stays in the index."""
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0))
    ids = await engine.schedule([env(i, T0) for i in range(500)])
    deleted = set(range(0, 500, 7))
    redis_client.xdel(KEYS.stream, *(ids[i] for i in deleted))
    with caplog.at_level(logging.ERROR, logger="delayed_middleware.engine"):
        await drain(engine)
    lost = [r.getMessage() for r in caplog.records if "were lost" in r.getMessage()]
    assert sum(int(m.split()[0]) for m in lost) == len(deleted)
    assert sorted(_fired(redis_client)) == sorted(set(range(500)) - deleted)
    assert await engine.pending() == 0
    assert redis_client.xlen(KEYS.stream) == 0
