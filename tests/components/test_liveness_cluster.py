"""Firing never silently stops on a real 3-master Redis Cluster.

The three ways it once stopped every shard for good (a failed APPEND inside
the two-phase fire left a cancellation on the engine's task, read as a stop):
a small pool under 1,000 concurrent delayed publishes, a small pool with 100
messages due together, and a master restarted. Each test checks what a user
would: every message answered OK arrives, nothing stays in flight, and
schedules keep firing afterwards. The component runs in-process on its socket,
so the tests can also read its health and metrics.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
import redis
from redis.exceptions import RedisClusterException

from delayed_middleware.keys import EngineKeys, shard_index, shard_topics
from delayed_pubsub.server import ComponentServer
from tests.components.driver import Component
from tests.redis_server import RedisCluster
from tests.waiting import wait_until

# While a master restarts the admin client fails until it maps the slots again: "not yet".
RESTARTING = (redis.RedisError, RedisClusterException)

pytestmark = pytest.mark.slow

Factory = Callable[[str], Component]
SHARDS = 16


def props(c: RedisCluster, **extra: str) -> dict[str, str]:
    return {
        "redisHost": c.nodes[0].address,
        "redisType": "cluster",
        "consumerID": "app1",
        "enableDelayedMessaging": "true",
        **extra,
    }


def delivered(admin: Any, topics: list[str]) -> list[int]:
    """The `n` of every entry on `topics` (each a JSON body {"n": ...})."""
    out: list[int] = []
    for t in topics:
        for _, fields in admin.xrange(t):
            out.append(json.loads(fields[b"data"])["n"])
    return sorted(out)


def in_flight(admin: Any) -> int:
    return sum(admin.zcard(EngineKeys.for_topic(t).inflight) for t in shard_topics("app1", SHARDS))


def fire_loops_restarted(server: ComponentServer, name: str) -> float:
    total = 0.0
    for shard in range(SHARDS):
        got = server.metrics.registry.get_sample_value(
            "delayed_pubsub_fire_loop_restarts_total", {"instance": name, "shard": str(shard)}
        )
        total += got or 0.0
    return total


async def every_fire_loop_up(server: ComponentServer, name: str) -> None:
    await server.check_health()
    for shard in range(SHARDS):
        up = server.metrics.registry.get_sample_value(
            "delayed_pubsub_fire_loop_up", {"instance": name, "shard": str(shard)}
        )
        assert up == 1.0, f"fire loop of shard {shard}: up={up}"


async def test_1000_concurrent_delayed_publishes_with_pool_size_10_are_all_delivered(
    cluster: RedisCluster, admin: Any, server: ComponentServer, component: Factory
) -> None:
    c = component("delayed")
    # All 1,000 admitted (admission control is test_overload.py's): this is about the pool.
    await c.init(props(cluster, poolSize="10", maxInflightPublishes="1000"))
    topics = [f"orders-{i}" for i in range(10)]

    async def publish(n: int) -> int | None:
        body = json.dumps({"n": n}).encode()
        try:
            await c.publish(topics[n % 10], body, {"scheduledSendDelay": f"{1000 + n % 1000}ms"})
        except grpc.aio.AioRpcError:
            return None  # refused (the pool was busy): not promised, not counted
        return n

    ok = [n for n in await asyncio.gather(*(publish(n) for n in range(1000))) if n is not None]
    assert len(ok) >= 500, f"only {len(ok)} of 1,000 publishes answered OK"
    await wait_until(
        lambda: len(delivered(admin, topics)) >= len(ok),
        f"all {len(ok)} OK'ed delivered",
        60,
        every_s=0.1,
        tolerate=RESTARTING,
    )
    await asyncio.sleep(0.5)  # a duplicate would land now
    assert delivered(admin, topics) == sorted(ok)
    assert in_flight(admin) == 0
    await every_fire_loop_up(server, "delayed")


async def test_100_messages_due_together_with_pool_size_10_leave_nothing_in_flight(
    cluster: RedisCluster, admin: Any, server: ComponentServer, component: Factory
) -> None:
    c = component("delayed")
    await c.init(props(cluster, poolSize="10"))
    topics = [f"due-{i}" for i in range(100)]  # one target each: 100 APPENDs at once
    due = time.time() + 10.0
    at = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(due)) + f".{int(due * 1000) % 1000:03d}Z"
    for n, t in enumerate(topics):
        # One at a time, again if the pool was busy: all 100 must be stored.
        while True:
            try:
                await c.publish(t, json.dumps({"n": n}).encode(), {"scheduledSendTime": at})
                break
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
    assert time.time() < due, "publishing took too long: the messages are not due together"
    await wait_until(
        lambda: len(delivered(admin, topics)) == 100, "100 delivered", 40, every_s=0.1, tolerate=RESTARTING
    )
    await wait_until(lambda: in_flight(admin) == 0, "nothing in flight", 20, every_s=0.1, tolerate=RESTARTING)
    # Firing goes on: a message published now fires a second later.
    sent = time.monotonic()
    await c.publish("later", json.dumps({"n": 100}).encode(), {"scheduledSendDelay": "1s"})
    await wait_until(
        lambda: delivered(admin, ["later"]) == [100],
        "the later message delivered",
        20,
        every_s=0.1,
        tolerate=RESTARTING,
    )
    assert time.monotonic() - sent >= 1.0
    assert delivered(admin, topics) == list(range(100))
    await every_fire_loop_up(server, "delayed")


async def test_a_master_restarted_with_aof_then_new_messages_and_a_schedule_fire(
    cluster: RedisCluster, admin: Any, server: ComponentServer, component: Factory
) -> None:
    c = component("delayed")
    await c.init(props(cluster))
    # The master restarted holds the targets; the schedule's shard lives on
    # another one, so its fire loop claims, then fails its APPEND.
    node = cluster.owner("ticks")
    sid = next(
        f"tick-{i}"
        for i in range(100)
        if cluster.owner(shard_topics("app1", SHARDS)[shard_index(f"tick-{i}", SHARDS)]) is not node
    )
    await c.publish("ticks", json.dumps({"n": -1}).encode(), {"schedule": "@every 1s", "scheduleId": sid})
    await wait_until(
        lambda: admin.xlen("ticks") >= 2, "the schedule fires", 10, every_s=0.1, tolerate=RESTARTING
    )
    targets = [t for t in (f"target-{i}" for i in range(200)) if cluster.owner(t) is node][:5]
    # Due while the master is down: delivered once it is back.
    await asyncio.gather(
        *(
            c.publish(targets[i % 5], json.dumps({"n": 100 + i}).encode(), {"scheduledSendDelay": "700ms"})
            for i in range(20)
        )
    )

    with node.client() as nc:
        nc.config_set("appendonly", "yes")
        await wait_until(
            lambda: nc.info("persistence")["aof_rewrite_in_progress"] == 0,
            "the AOF is written",
            10,
            every_s=0.1,
            tolerate=RESTARTING,
        )
    node.appendonly = True
    node.stop(kill=True)
    await asyncio.sleep(1.0)
    node.start()
    cluster.wait_ready()

    await asyncio.gather(
        *(
            c.publish(targets[i % 5], json.dumps({"n": i}).encode(), {"scheduledSendDelay": "1s"})
            for i in range(20)
        )
    )
    want = [*range(20), *range(100, 120)]
    await wait_until(
        lambda: len(delivered(admin, targets)) >= 40,
        "all 40 messages fired",
        30,
        every_s=0.1,
        tolerate=RESTARTING,
    )
    # The @every 1s keeps firing: three more ticks after the new messages.
    now = admin.xlen("ticks")
    await wait_until(
        lambda: admin.xlen("ticks") >= now + 3,
        "the schedule keeps firing",
        15,
        every_s=0.1,
        tolerate=RESTARTING,
    )
    assert delivered(admin, targets) == want
    assert in_flight(admin) == 0
    await every_fire_loop_up(server, "delayed")
