"""Replicas whose clocks are wrong against a real Redis: due decisions, lateness, call-token
windows and age trims are taken on Redis's clock (TIME), so a replica minutes or days ahead or
behind fires nothing early, nothing late, and trims or forgets nothing too soon."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable

import pytest
import redis
import redis.asyncio as aioredis

from delayed_middleware.clock import ManualClock, SystemClock
from delayed_middleware.engine import DelayEngine, EngineConfig
from delayed_middleware.entry import Trim
from tests.conftest import SkewedClock
from tests.middleware.engine.helpers import (
    KEYS,
    drain,
    env,
    history,
    payloads,
    target,
)
from tests.waiting import wait_until


def redis_ms(client: redis.Redis) -> int:
    """The Redis server's clock (TIME) in ms."""
    sec, usec = client.time()
    return int(sec) * 1000 + int(usec) // 1000


@pytest.mark.both_fire_paths
async def test_a_replica_with_a_fast_clock_does_not_fire_early(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """A message due in a minute by the publisher's clock (and Redis's) was delivered at once
    by a replica whose system clock runs ten minutes ahead: FIRE compared due times with the
    firing replica's clock. Due decisions are made on Redis TIME."""
    t0 = SystemClock().now_ms()
    publisher = DelayEngine(aredis(), KEYS, ManualClock(t0))
    fast = DelayEngine(aredis(), KEYS, SkewedClock(600_000))
    await publisher.schedule([env(1, t0 + 60_000)])
    fired, head = await fast.fire_due()
    assert (fired, payloads(redis_client)) == (0, [])
    # The head comes back in the fast replica's own frame, so its loop sleeps ~a minute.
    assert head is not None
    assert 59_000 < head - fast.state.clock.now_ms() <= 60_000


@pytest.mark.both_fire_paths
async def test_a_replica_with_a_slow_clock_fires_on_time_and_measures_lateness_on_redis_time(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """A replica whose clock runs ten minutes behind held every message ten minutes (it found
    nothing due), and would have recorded a negative lateness."""
    slow = DelayEngine(aredis(), KEYS, SkewedClock(-600_000))
    due = redis_ms(redis_client) + 200
    await slow.schedule([env(1, due)])
    await wait_until(lambda: redis_ms(redis_client) >= due, "Redis TIME past the due time")
    await drain(slow)
    assert payloads(redis_client) == [1]
    [fired] = [r for r in history(redis_client) if r.event == "fired"]
    assert fired.lateness_ms is not None
    assert 0 <= fired.lateness_ms < 5_000
    assert 0 <= fired.at_ms - due < 5_000


@pytest.mark.both_fire_paths
async def test_a_fast_replica_sleeps_until_the_message_is_due_by_redis_time(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """A replica ten minutes ahead must neither spin on a head that looks overdue by its own
    clock (one FIRE after another for ten minutes) nor fire before Redis says it is due."""
    engine = DelayEngine(aredis(), KEYS, SkewedClock(600_000))
    due = redis_ms(redis_client) + 1_500
    await engine.schedule([env(1, due)])
    redis_client.config_resetstat()
    runner = asyncio.create_task(engine.run())
    try:
        await wait_until(lambda: bool(payloads(redis_client)), "the delivery")
        arrived = redis_ms(redis_client)
    finally:
        runner.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await runner
    [entry_id, _] = target(redis_client)[0]
    assert int(entry_id.split("-")[0]) >= due
    assert arrived - due < 1_000
    # Woken by its own schedule's wake-up, then asleep until due: a handful of fire calls.
    calls = int(redis_client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))
    assert calls < 20


@pytest.mark.both_fire_paths
async def test_a_replica_with_a_fast_clock_does_not_forget_other_replicas_call_tokens(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """Call tokens were scored and pruned by the calling replica's clock: one running an hour
    ahead pruned every token of the others as 'older than the window', so another replica's
    retry after a lost reply stored its messages twice."""
    t0 = SystemClock().now_ms()
    honest = DelayEngine(aredis(), KEYS, ManualClock(t0))
    ahead = DelayEngine(aredis(), KEYS, ManualClock(t0 + 3_600_000))
    await honest.schedule([env(1, t0 + 60_000)], token="honest-call")
    await ahead.schedule([env(2, t0 + 60_000)])  # any call of the fast replica
    await honest.schedule([env(1, t0 + 60_000)], token="honest-call")  # the retry
    assert await honest.pending() == 2


@pytest.mark.both_fire_paths
async def test_a_replica_with_a_fast_clock_does_not_age_out_history_early(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """History records carry stream ids from Redis's clock; a replica two days ahead trimmed
    by its own clock, so a one-day retention deleted records written a second ago. The age
    trim is taken on the shard's time, as FIRE's streamTTL trim is."""
    slow = DelayEngine(aredis(), KEYS, SystemClock())
    due = redis_ms(redis_client)
    await slow.schedule([env(1, due)])
    await drain(slow)
    assert [r.event for r in history(redis_client)] == ["scheduled", "fired"]
    fast = DelayEngine(aredis(), KEYS, SkewedClock(2 * 86_400_000))
    stop = asyncio.Event()
    passes = 0

    def beat() -> None:
        nonlocal passes
        passes += 1

    run = asyncio.create_task(fast.run(stop, beat=beat))
    await wait_until(lambda: passes >= 2, "two passes of the fast replica's loop")
    stop.set()
    await run
    assert [r.event for r in history(redis_client)] == ["scheduled", "fired"]


@pytest.mark.both_fire_paths
@pytest.mark.parametrize("two_phase", [False, True], ids=["fire", "two-phase"])
async def test_a_replica_with_a_fast_clock_does_not_trim_unread_messages_by_stream_ttl(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, two_phase: bool
) -> None:
    """streamTTL trims a topic by MINID, and topic entry ids come from Redis's clock. A replica
    two days ahead that fires a message with a one-day streamTTL must not trim the messages
    published to that topic a moment ago (nobody has read them yet); those older than a day
    by Redis's clock still go (whole stream nodes: `~`)."""
    old = redis_ms(redis_client) - 2 * 86_400_000
    for n in range(300):
        redis_client.xadd(
            "orders", {"data": json.dumps({"n": n + 1000}), "metadata": "{}"}, id=f"{old}-{n + 1}"
        )
    for n in range(5):
        redis_client.xadd("orders", {"data": json.dumps({"n": n + 100}), "metadata": "{}"})
    trim = Trim(mode="MINID", max_age_ms=86_400_000)
    cfg = EngineConfig(two_phase=two_phase)
    fast = DelayEngine(aredis(), KEYS, SkewedClock(2 * 86_400_000), trim=trim, config=cfg)
    await fast.schedule([env(1, redis_ms(redis_client))])
    await drain(fast)
    got = sorted(payloads(redis_client))
    assert [n for n in got if n < 1000] == [1, 100, 101, 102, 103, 104]
    assert len(got) - 6 < 100
