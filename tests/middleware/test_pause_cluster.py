"""Pause and prefix cancel on a real 3-master Redis Cluster with several shard streams: a pause
that lands while an occurrence is in flight (claimed, not yet appended) waits for it, so the
occurrence is either fired or paused, never both; a claimer that dies mid-fire is taken over and
the pause then completes; a prefix cancel reaches every shard."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import redis.asyncio.cluster as acluster
import redis.cluster

from delayed_middleware.clock import ManualClock
from delayed_middleware.engine import DelayEngine, EngineConfig, ShardedEngine
from delayed_middleware.engine.pause import PAUSED, RESUMED, UNKNOWN, is_paused_ref
from delayed_middleware.entry import decode_entry
from delayed_middleware.envelope import ONESHOT, RECURRING, Envelope
from delayed_middleware.keys import EngineKeys, shard_topics
from tests.redis_server import RedisCluster

T0 = 1_800_000_000_000
LEASE = 1_000
SHARDS = 3


class Crash(Exception):
    """Stands for the process dying at a fault point."""


@pytest.fixture
async def aclient(cluster: RedisCluster) -> AsyncIterator[acluster.RedisCluster]:
    c = acluster.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
    yield c
    await c.aclose()


def every_second(e: Envelope, after: int) -> int | None:
    return (after // 1_000 + 1) * 1_000


def sharded(
    client: acluster.RedisCluster, clock: ManualClock, fault: Callable[[str], Awaitable[None]] | None = None
) -> ShardedEngine:
    return ShardedEngine(
        [
            DelayEngine(
                client,
                EngineKeys.for_topic(t),
                clock,
                config=EngineConfig(two_phase=True, lease_ms=LEASE, fire_budget_us=0),
                fault=fault,
                recurrence=every_second,
            )
            for t in shard_topics("app", SHARDS)
        ]
    )


def msg(sid: str, due: int, topic: str = "orders", recurring: bool = False) -> Envelope:
    return Envelope(
        id=sid,
        topic=topic,
        due_ms=due,
        published_at_ms=T0,
        message=sid.encode(),
        schedule_id=sid,
        kind=RECURRING if recurring else ONESHOT,
        schedule="@test" if recurring else "",
    )


def delivered(admin: redis.cluster.RedisCluster, topic: str = "orders") -> list[str]:
    got = admin.xrange(topic)
    return [decode_entry(dict(f)).data.decode() for _, f in got]  # type: ignore[union-attr,arg-type]


async def fire_all(e: ShardedEngine) -> None:
    while (await e.fire_due())[0]:
        pass


async def test_a_pause_landing_while_a_one_shot_is_in_flight_waits_and_finds_it_fired(
    aclient: acluster.RedisCluster, admin: redis.cluster.RedisCluster
) -> None:
    clock = ManualClock(T0)
    claimed, go_on = asyncio.Event(), asyncio.Event()

    async def hold_after_claim(point: str) -> None:
        if point == "claimed":
            claimed.set()
            await go_on.wait()

    await sharded(aclient, clock).schedule([msg("o-1", T0 + 1_000)])
    clock.set(T0 + 1_000)
    firer = sharded(aclient, clock, hold_after_claim)
    fire = asyncio.create_task(fire_all(firer))
    await asyncio.wait_for(claimed.wait(), 10)
    pause = asyncio.create_task(sharded(aclient, clock).set_paused("o-1", pause=True))
    await asyncio.sleep(0.5)
    assert not pause.done()  # in flight: the pause waits for the fire step to finish
    go_on.set()
    await fire
    assert (await pause).status == UNKNOWN  # it fired first: nothing left to pause
    assert delivered(admin) == ["o-1"]


async def test_a_pause_landing_while_a_schedule_is_in_flight_lets_that_fire_and_holds_the_rest(
    aclient: acluster.RedisCluster, admin: redis.cluster.RedisCluster
) -> None:
    clock = ManualClock(T0)
    claimed, go_on = asyncio.Event(), asyncio.Event()

    async def hold_after_claim(point: str) -> None:
        if point == "claimed" and not go_on.is_set():
            claimed.set()
            await go_on.wait()

    engine = sharded(aclient, clock)
    await engine.schedule([msg("tick", T0 + 1_000, recurring=True)])
    clock.set(T0 + 1_000)
    fire = asyncio.create_task(fire_all(sharded(aclient, clock, hold_after_claim)))
    await asyncio.wait_for(claimed.wait(), 10)
    pause = asyncio.create_task(engine.set_paused("tick", pause=True))
    await asyncio.sleep(0.5)
    assert not pause.done()
    go_on.set()
    await fire
    assert (await pause).status == PAUSED
    assert delivered(admin) == ["tick"]
    for t in range(2_000, 6_000, 1_000):
        clock.set(T0 + t)
        await fire_all(engine)
    assert delivered(admin) == ["tick"]
    clock.set(T0 + 6_500)
    assert (await engine.set_paused("tick", pause=False)).status == RESUMED
    await fire_all(engine)
    assert delivered(admin) == ["tick"]  # the next grid point after 6.5 s is 7 s
    clock.set(T0 + 7_000)
    await fire_all(engine)
    assert delivered(admin) == ["tick", "tick"]


async def test_a_claimer_dying_mid_fire_is_taken_over_and_the_pause_then_completes_once(
    aclient: acluster.RedisCluster, admin: redis.cluster.RedisCluster
) -> None:
    clock = ManualClock(T0)

    async def die_after_claim(point: str) -> None:
        if point == "claimed":
            raise Crash(point)

    engine = sharded(aclient, clock)
    await engine.schedule([msg("o-2", T0 + 1_000)])
    clock.set(T0 + 1_000)
    with pytest.raises(Crash):
        await fire_all(sharded(aclient, clock, die_after_claim))
    # Its claim stays in flight until the lease ends; the pause waits for it.
    pause = asyncio.create_task(engine.set_paused("o-2", pause=True))
    await asyncio.sleep(0.3)
    assert not pause.done()
    clock.set(T0 + 1_000 + LEASE + 1)
    await fire_all(sharded(aclient, clock))  # another replica takes the claim over
    assert (await asyncio.wait_for(pause, 10)).status == UNKNOWN
    assert delivered(admin) == ["o-2"]


async def test_a_paused_message_on_its_shard_is_not_claimed_and_resumes_there(
    aclient: acluster.RedisCluster, admin: redis.cluster.RedisCluster
) -> None:
    clock = ManualClock(T0)
    engine = sharded(aclient, clock)
    ids = [f"m-{i}" for i in range(30)]
    await engine.schedule([msg(i, T0 + 1_000) for i in ids])
    for i in ids[:10]:
        assert (await engine.set_paused(i, pause=True)).status == PAUSED
    clock.set(T0 + 5_000)
    await fire_all(engine)
    assert sorted(delivered(admin)) == sorted(ids[10:])
    for i in ids[:10]:
        shard = engine.shard_of(i)
        ref = await shard.redis.hget(shard.keys.ids, i)
        assert isinstance(ref, bytes)
        assert is_paused_ref(ref.decode())
        assert (await engine.set_paused(i, pause=False)).status == RESUMED
    await fire_all(engine)
    assert sorted(delivered(admin)) == sorted(ids)


async def test_a_prefix_cancel_reaches_every_shard(
    aclient: acluster.RedisCluster, admin: redis.cluster.RedisCluster
) -> None:
    clock = ManualClock(T0)
    engine = sharded(aclient, clock)
    matching = [f"tenant-7:{i}" for i in range(300)]
    others = [f"tenant-8:{i}" for i in range(30)]
    await engine.schedule([msg(i, T0 + 1_000) for i in matching + others])
    per_shard = [sum(1 for i in matching if engine.shard_of(i) is e) for e in engine.engines]
    assert all(n > 0 for n in per_shard)  # the ids spread over every shard
    assert await engine.cancel_prefix("tenant-7:") == 300
    assert await engine.cancel_prefix("tenant-7:") == 0
    clock.set(T0 + 1_000)
    await fire_all(engine)
    assert sorted(delivered(admin)) == sorted(others)
