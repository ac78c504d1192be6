"""Delayed messaging on a real Redis Cluster and on Sentinel, through `delayed-pubsub serve`
processes driven over their sockets: exactly once across replicas, kill -9 and failovers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio.cluster as acluster
import redis.cluster
from redis.exceptions import RedisClusterException

from delayed_middleware.clock import SystemClock
from delayed_middleware.engine import DelayEngine, EngineConfig
from delayed_middleware.entry import decode_entry
from delayed_middleware.envelope import Envelope
from delayed_middleware.keys import EngineKeys, shard_topics
from tests.components.driver import (
    CLUSTER_SHARDS,
    Component,
    cluster_props,
    delayed_entries,
    engine_left,
    now_ms,
)
from tests.components.serve import Serve, instance
from tests.redis_server import RedisCluster, RedisSentinel

pytestmark = pytest.mark.slow

SHARDS = CLUSTER_SHARDS


def topics_on_every_master(c: RedisCluster, n: int) -> list[str]:
    topics = [f"topic-{i}" for i in range(n)]
    masters = {c.owner(t).port for t in topics}
    assert len(masters) == len({c.owner(t).port for t in shard_topics("app1", SHARDS)}) == 3
    return topics


def rows(admin: Any, key: str) -> list[tuple[bytes, dict[bytes, bytes]]]:
    got: list[tuple[bytes, dict[bytes, bytes]]] = admin.xrange(key)
    return got


def delivered(admin: Any, topic: str) -> list[int]:
    return sorted(json.loads(decode_entry(f).data)["n"] for _, f in rows(admin, topic))


async def publish_spread(
    c: Any, topics: list[str], total: int, first_due: int, spread_ms: int
) -> dict[str, list[int]]:
    """`total` delayed messages over `topics` (one bulk call per topic, n = i * len + k)."""
    want: dict[str, list[int]] = {}
    per = total // len(topics)
    for k, t in enumerate(topics):
        entries = delayed_entries(per, first_due, spread_ms)
        for i, e in enumerate(entries):
            e.event = json.dumps({"n": k * per + i}).encode()
        reply = await c.bulk_publish(t, entries)
        assert list(reply.failed_entries) == []
        want[t] = [k * per + i for i in range(per)]
    return want


async def wait_delivered(admin: Any, topics: list[str], total: int, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    got = 0
    while True:
        # During a failover the admin client fails until it maps the slots again.
        with contextlib.suppress(redis.RedisError, RedisClusterException):
            got = sum(admin.xlen(t) for t in topics)
        if got >= total:
            return
        assert time.monotonic() < deadline, f"{got} of {total} delivered after {within_s}s"
        await asyncio.sleep(0.1)


async def test_two_replicas_fire_10k_to_50_topics_over_every_master_exactly_once(
    folder: Path, cluster: RedisCluster, admin: Any
) -> None:
    topics = topics_on_every_master(cluster, 50)
    a, b = Serve(folder, "a"), Serve(folder, "b")
    try:
        props = cluster_props(cluster)
        async with instance(a, props) as ca, instance(b, props):
            want = await publish_spread(ca, topics, 10_000, now_ms() + 4_000, 1_000)
            # The 50 calls spread over the shards (each shard's history saw them).
            used = [t for t in shard_topics("app1", SHARDS) if admin.xlen(EngineKeys.for_topic(t).history)]
            assert len(used) > 8
            await wait_delivered(admin, topics, 10_000, within_s=40)
            await asyncio.sleep(1.0)  # a duplicate would land now, if ever
            assert {t: delivered(admin, t) for t in topics} == want
            assert engine_left(admin) == {"pending": 0, "inflight": 0, "envelopes": 0}
    finally:
        a.stop()
        b.stop()


async def test_kill_9_of_a_replica_while_firing_loses_and_doubles_nothing(
    folder: Path, cluster: RedisCluster, admin: Any
) -> None:
    topics = topics_on_every_master(cluster, 12)
    n = 6_000
    a, b = Serve(folder, "a"), Serve(folder, "b")
    try:
        props = cluster_props(cluster)
        async with instance(a, props) as ca, instance(b, props):
            want = await publish_spread(ca, topics, n, now_ms() + 3_000, 4_000)
            deadline = time.monotonic() + 15
            while sum(admin.xlen(t) for t in topics) < 1_000:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            a.kill9()  # mid-batch, most likely: its claims wait for their lease to end
            killed_at = time.monotonic()
            fired_at_kill = sum(admin.xlen(t) for t in topics)
            assert fired_at_kill < n, "the kill must land while messages are pending"
            # Lease 5 s + takeover within 2 s + the rest of the spread.
            await wait_delivered(admin, topics, n, within_s=20)
            await asyncio.sleep(1.0)
            assert {t: delivered(admin, t) for t in topics} == want
            # A claim the killed replica had appended but not released is
            # delivered already and released by the takeover: lease 5 s + 2 s.
            left = engine_left(admin)
            while left != {"pending": 0, "inflight": 0, "envelopes": 0} and time.monotonic() < killed_at + 8:
                await asyncio.sleep(0.1)
                left = engine_left(admin)
            assert left == {"pending": 0, "inflight": 0, "envelopes": 0}
            assert {t: delivered(admin, t) for t in topics} == want
    finally:
        a.stop()
        b.stop()


async def test_a_dead_replicas_claim_is_taken_over_within_2s_of_its_lease_ending_not_before(
    folder: Path, cluster: RedisCluster, admin: Any
) -> None:
    topics = topics_on_every_master(cluster, 6)
    shard = EngineKeys.for_topic(shard_topics("app1", SHARDS)[0])

    async def die(point: str) -> None:
        if point == "claimed":
            raise RuntimeError("killed after CLAIM")

    client = acluster.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
    try:
        # A replica (the real engine code, in this process) claims a due batch and dies.
        dead = DelayEngine(
            client,
            shard,
            SystemClock(),
            config=EngineConfig(two_phase=True, fire_budget_us=0),
            fault=die,
        )
        await dead.schedule(
            [
                Envelope(
                    id=f"m{i}",
                    topic=topics[i % 6],
                    due_ms=now_ms(),
                    published_at_ms=now_ms(),
                    message=json.dumps({"n": i}).encode(),
                )
                for i in range(300)
            ]
        )
        with pytest.raises(RuntimeError):
            await dead.fire_due()
    finally:
        await client.aclose()
    [(_, lease_end)] = admin.zrange(shard.inflight, 0, 0, withscores=True)
    assert admin.zcard(shard.inflight) == 300
    # Firing in serve's own process: the takeover starts with Init, not after a worker
    # process has started too (at a load of 8 that alone ran past the 5 s lease).
    c = Serve(folder, "c", "--workers", "0")
    try:
        async with instance(c, cluster_props(cluster)):
            up_at = now_ms()
            deadline = time.monotonic() + 15
            while admin.zcard(shard.inflight):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            released_at = now_ms()
            await wait_delivered(admin, topics, 300, within_s=5)
    finally:
        c.stop()
    # Never before the lease ends; within 2 s of its end, or of the replica being up if
    # its start-up ran past it.
    assert lease_end <= released_at < max(lease_end, up_at) + 2_000
    assert sorted(n for t in topics for n in delivered(admin, t)) == list(range(300))


# --- failovers ----------------------------------------------------------------


@pytest.fixture
def ha_cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    """3 masters with a replica each (node timeout 1 s), fresh per test: a test kills a master."""
    c = RedisCluster(tmp_path / "ha", replicas=1)
    c.start()
    yield c
    c.stop()


def replication(master: Any) -> tuple[int, list[int]]:
    """`master`'s replication offset and each replica's acknowledged offset (INFO replication)."""
    with master.client(decode_responses=True) as c:
        info: Any = c.info("replication")
    replicas = [int(v["offset"]) for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]
    return int(info["master_repl_offset"]), replicas


async def wait_replicated(masters: list[Any]) -> None:
    """Until every replica has acknowledged what its master had written when this was called."""
    targets = [(m, replication(m)[0]) for m in masters]
    deadline = time.monotonic() + 10
    while not all((r := replication(m)[1]) and min(r) >= offset for m, offset in targets):
        assert time.monotonic() < deadline, "replicas never caught up"
        await asyncio.sleep(0.05)


async def test_kill_a_master_failover_then_firing_resumes_exactly_once(
    folder: Path, ha_cluster: RedisCluster
) -> None:
    admin = ha_cluster.client()
    topics = topics_on_every_master(ha_cluster, 12)
    victim = ha_cluster.owner(shard_topics("app1", SHARDS)[0])
    masters = list({ha_cluster.owner(t).port: ha_cluster.owner(t) for t in topics}.values())
    a = Serve(folder, "a")
    try:
        props = {**cluster_props(ha_cluster), "redisHost": ",".join(ha_cluster.addresses)}
        async with instance(a, props) as ca:
            want = await publish_spread(ca, topics, 1_200, now_ms() + 4_000, 2_000)
            # Only what the replicas have survives a master's death (asynchronous replication).
            await wait_replicated(masters)
            victim.stop(kill=True)
            assert sum(admin.xlen(t) for t in topics if ha_cluster.owner(t) is not victim) < 1_200
            # Node timeout 1 s, then the election; then the due messages of the
            # dead master's shards and topics fire from the promoted replica.
            await wait_delivered(admin, topics, 1_200, within_s=30)
            await asyncio.sleep(1.0)
            assert {t: delivered(admin, t) for t in topics} == want
            assert engine_left(admin) == {"pending": 0, "inflight": 0, "envelopes": 0}
    finally:
        a.stop()
        admin.close()


@pytest.fixture
def ha_sentinel(tmp_path: Path) -> Iterator[RedisSentinel]:
    s = RedisSentinel(tmp_path / "sentinel", replica=True)
    s.start()
    yield s
    s.stop()


async def test_sentinel_failover_then_firing_resumes_exactly_once(
    folder: Path, ha_sentinel: RedisSentinel
) -> None:
    assert ha_sentinel.replica is not None
    topics = ["orders", "payments", "shipments"]
    a = Serve(folder, "a")
    try:
        props = {
            "redisHost": ha_sentinel.address,
            "failover": "true",
            "sentinelMasterName": ha_sentinel.master_name,
            "consumerID": "app1",
            "enableDelayedMessaging": "true",
        }
        async with instance(a, props) as ca:
            want = await publish_spread(ca, topics, 900, now_ms() + 6_000, 2_000)
            await wait_replicated([ha_sentinel.master])
            ha_sentinel.master.stop(kill=True)
            with ha_sentinel.replica.client() as replica:
                assert sum(replica.xlen(t) for t in topics) < 900, (
                    "the kill must land while messages are pending"
                )
            with ha_sentinel.replica.client() as promoted:
                await wait_delivered(promoted, topics, 900, within_s=30)
                await asyncio.sleep(1.0)
                assert {t: delivered(promoted, t) for t in topics} == want
                assert int(promoted.get("{app1-delayed}:pending") or 0) == 0
                assert promoted.xlen("app1-delayed") == 0
                assert promoted.info("replication")["role"] == "master"
    finally:
        a.stop()


async def test_delay_shards_on_a_single_node_spread_publishes_and_fire_them_all_once(
    component: Callable[[str], Component], props: dict[str, str], redis_client: redis.Redis
) -> None:
    """delayShards works on one node too (one-script FIRE per shard): a deployment can
    shard before it moves to a cluster, and readers find every shard by keys.shard_topics."""
    c = component("delayed")
    await c.init({**props, "enableDelayedMessaging": "true", "delayShards": "4"})
    due = now_ms() + 1_500
    for _ in range(8):  # one shard per call, in turn
        reply = await c.bulk_publish("orders", delayed_entries(25, due, 10))
        assert list(reply.failed_entries) == []
    held = [redis_client.xlen(t) for t in shard_topics("app1", 4)]
    assert sum(held) == 200
    assert all(held), held  # every shard got calls
    deadline = time.monotonic() + 10
    while redis_client.xlen("orders") < 200:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)
    assert redis_client.xlen("orders") == 200
    assert [redis_client.xlen(t) for t in shard_topics("app1", 4)] == [0, 0, 0, 0]
