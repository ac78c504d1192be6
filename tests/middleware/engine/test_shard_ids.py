"""Ids across shard streams (ShardedEngine): each shard stream numbers its entries on its own, so
two shards hold the same stream id whenever two publishes land on them in the same millisecond."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import redis
import redis.asyncio as aioredis

from delayed_middleware.clock import ManualClock
from delayed_middleware.engine import DelayEngine, ShardedEngine
from delayed_middleware.entry import decode_entry
from delayed_middleware.inspector import Inspector
from delayed_middleware.keys import EngineKeys, shard_index, shard_topics
from tests.middleware.engine.helpers import T0, env, every, recurring, target

SHARDS = 3


async def colliding_schedule(client: aioredis.Redis, clock: ManualClock) -> tuple[ShardedEngine, str, int]:
    """A recurring schedule without scheduleId whose stream id another shard also holds, away from
    the id's hash shard; found by publishing in the same millisecond (bounded attempts)."""
    for _ in range(50):
        await client.flushall()
        engines = [
            DelayEngine(client, EngineKeys.for_topic(t), clock, recurrence=every)
            for t in shard_topics("app", SHARDS)
        ]
        sharded = ShardedEngine(engines)
        # Three calls at once: one shard each (in turn), most likely in one millisecond.
        got = await asyncio.gather(
            sharded.schedule([recurring(1, 1_000)]),
            sharded.schedule([env(2, T0 + 60_000)]),
            sharded.schedule([env(3, T0 + 60_000)]),
        )
        rec, *others = [ids[0] for ids in got]
        local, _, shard = rec.partition("@")
        if local in {o.partition("@")[0] for o in others} and shard_index(local, SHARDS) != int(shard):
            return sharded, local, int(shard)
    raise AssertionError("no same-millisecond collision in 50 attempts")


async def test_the_same_stream_id_on_two_shards_happens_naturally_and_inspect_finds_the_schedule(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    client = aredis()
    sharded, local, shard = await colliding_schedule(client, ManualClock(T0))
    # `inspect <scheduler header>`: the recurring envelope's id is a key of its shard's ids hash.
    info = await Inspector(client, "app", shards=SHARDS).get(local)
    assert info is not None
    assert (info.message.shard, info.message.kind) == (shard, "recurring")
    # The one-shot that shares the id: named with its shard, it is found on that shard only.
    holders = [n for n, e in enumerate(sharded.engines) if n != shard and await e.holds(local)]
    other = holders[0]
    info = await Inspector(client, "app", shards=SHARDS).get(f"{local}@{other}")
    assert info is not None
    assert (info.message.shard, info.message.kind) == (other, "oneshot")


async def test_a_recurring_schedule_without_id_is_cancelled_by_its_scheduler_header(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    client = aredis()
    clock = ManualClock(T0)
    sharded, _, shard = await colliding_schedule(client, clock)
    clock.set(T0 + 1_000)
    assert (await sharded.engines[shard].fire_due())[0] == 1
    [(_, fields)] = target(redis_client)
    scheduler = decode_entry(fields).metadata["scheduler"]
    # What the subscriber saw is what it cancels with (README: "that id cancels it").
    assert await sharded.cancel(scheduler)
    # The schedule is gone; the one-shot that shares its stream id on another shard is not.
    clock.set(T0 + 60_000)
    for e in sharded.engines:
        while (await e.fire_due())[0]:
            pass
    delivered = sorted(json.loads(decode_entry(f).data)["n"] for _, f in target(redis_client))
    assert delivered == [1, 2, 3]
