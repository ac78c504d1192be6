"""The operator CLI and the pending-per-topic gauge on a real 3-master Redis Cluster with
`delayShards: 6`: what an operator sees covers every shard stream, not shard 0 only."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio.cluster as acluster

from delayed_middleware.clock import SystemClock
from delayed_middleware.instants import format_instant
from delayed_middleware.keys import EngineKeys, shard_index, shard_topics
from delayed_pubsub.gauges import PendingByTopic
from delayed_pubsub.instance import Instance
from delayed_pubsub.metrics import OTHER_TOPICS, Metrics
from delayed_pubsub.settings import parse_settings
from delayed_pubsub_pb.dapr.proto.components.v1 import pubsub_pb2
from tests.components.driver import DELAY_SHARDS, cli, cluster_conn, now_ms
from tests.components.serve import Serve, instance
from tests.redis_server import RedisCluster

pytestmark = pytest.mark.slow

SHARDS = DELAY_SHARDS
TOTAL = 1_000


@dataclass(frozen=True)
class Scene:
    """1,000 delayed messages spread over the 6 shards, due one second apart in a random order."""

    base_ms: int
    # scheduleId (every other message) or "" -> (topic, due ms, n)
    by_schedule_id: dict[str, tuple[str, int, int]]
    dues: list[int]
    conn: list[str]


def order(i: int) -> int:
    # A permutation of 0..999 (7 is prime to 1000): due times interleave across calls and shards.
    return (i * 7 + 3) % TOTAL


@pytest.fixture
async def scene(folder: Path, cluster: RedisCluster, admin: Any) -> AsyncIterator[Scene]:
    serve = Serve(folder, "a")
    props = {
        "redisHost": cluster.nodes[0].address,
        "redisType": "cluster",
        "consumerID": "app1",
        "enableDelayedMessaging": "true",
        "delayShards": str(SHARDS),
    }
    base = now_ms() + 3_600_000
    by_id: dict[str, tuple[str, int, int]] = {}
    try:
        async with instance(serve, props) as c:
            # 10 bulk calls of 100: half carry a scheduleId (home shard by hash), half do not
            # (one shard per call, in turn): every shard gets some of both.
            for k in range(10):
                topic = "orders" if k % 2 else "billing"
                entries = []
                for j in range(100):
                    i = k * 100 + j
                    due = base + order(i) * 1_000
                    md = {"scheduledSendTime": format_instant(due)}
                    if j % 2:
                        md["scheduleId"] = f"s-{i}"
                        by_id[f"s-{i}"] = (topic, due, i)
                    entries.append(
                        pubsub_pb2.BulkMessageEntry(
                            entry_id=str(j), event=json.dumps({"n": i}).encode(), metadata=md
                        )
                    )
                reply = await c.bulk_publish(topic, entries)
                assert list(reply.failed_entries) == []
            yield Scene(
                base, by_id, sorted(base + order(i) * 1_000 for i in range(TOTAL)), cluster_conn(cluster)
            )
    finally:
        serve.stop()


def shard_of_stream(admin: Any) -> dict[int, int]:
    """Envelopes per shard, as Redis holds them."""
    return {n: admin.xlen(t) for n, t in enumerate(shard_topics("app1", SHARDS))}


async def test_the_scene_really_spreads_over_every_shard_and_every_master(
    scene: Scene, cluster: RedisCluster, admin: Any
) -> None:
    held = shard_of_stream(admin)
    assert sum(held.values()) == TOTAL
    assert all(n > 0 for n in held.values()), held
    assert len({cluster.owner(t).port for t in shard_topics("app1", SHARDS)}) == 3


async def test_pending_lists_all_1000_over_6_shards_in_due_order(scene: Scene, admin: Any) -> None:
    result = await cli("pending", *scene.conn, "--limit", "0", "--json")
    assert result.code == 0, result.err
    rows = result.json()
    assert len(rows) == TOTAL
    assert [r["due"] for r in rows] == [format_instant(d) for d in scene.dues]
    # Every shard's envelopes are there, named <stream id>@<shard>; scheduleIds as given.
    shards = {r["id"].rpartition("@")[2] for r in rows if r["scheduleId"] is None}
    assert shards == {str(n) for n in range(SHARDS)}
    assert {r["id"] for r in rows if r["scheduleId"]} == set(scene.by_schedule_id)
    assert sum(r["topic"] == "orders" for r in rows) == sum(r["topic"] == "billing" for r in rows) == 500
    # The earliest 5, across whatever shards hold them.
    result = await cli("pending", *scene.conn, "--limit", "5", "--json")
    assert [r["id"] for r in result.json()] == [r["id"] for r in rows[:5]]


async def test_pending_table_says_1000_pending_with_counts_per_topic(scene: Scene) -> None:
    result = await cli("pending", *scene.conn, "--limit", "3")
    assert result.code == 0, result.err
    lines = [line.split() for line in result.out.splitlines()]
    assert ["total", "1000"] in lines
    assert ["orders", "500"] in lines
    assert ["billing", "500"] in lines
    assert "app1-delayed and its 5 other shards" in result.out
    assert "showing the earliest 3 of 1000" in result.err


async def test_the_component_yaml_gives_the_shards_too(
    scene: Scene, cluster: RedisCluster, tmp_path: Path
) -> None:
    yaml_file = tmp_path / "pubsub.yaml"
    yaml_file.write_text(
        "apiVersion: dapr.io/v1alpha1\nkind: Component\nmetadata:\n  name: delayed\nspec:\n"
        "  type: pubsub.delayed\n  version: v1\n  metadata:\n"
        f"  - name: redisHost\n    value: {cluster.nodes[2].address}\n"
        "  - name: redisType\n    value: cluster\n"
        "  - name: consumerID\n    value: app1\n"
        "  - name: enableDelayedMessaging\n    value: true\n"
        f"  - name: delayShards\n    value: {SHARDS}\n"
    )
    result = await cli("pending", "--component", str(yaml_file), "--limit", "0", "--json")
    assert result.code == 0, result.err
    assert len(result.json()) == TOTAL


async def test_inspect_finds_messages_on_shard_4_by_envelope_id_and_by_schedule_id(
    scene: Scene, admin: Any
) -> None:
    rows = (await cli("pending", *scene.conn, "--limit", "0", "--json")).json()
    on_4 = next(r for r in rows if r["id"].endswith("@4"))
    result = await cli("inspect", *scene.conn, on_4["id"])
    assert result.code == 0, result.err
    assert "app1~4-delayed " + on_4["id"].partition("@")[0] in result.out
    assert on_4["topic"] in result.out
    assert on_4["due"] in result.out
    # Its history (the `scheduled` record on shard 4's history stream) comes along.
    assert "scheduled" in result.out

    sid = next(s for s in scene.by_schedule_id if shard_index(s, SHARDS) == 4)
    _topic, due, n = scene.by_schedule_id[sid]
    result = await cli("inspect", *scene.conn, sid)
    assert result.code == 0, result.err
    assert "app1~4-delayed " in result.out
    assert json.dumps({"n": n}) in result.out
    assert format_instant(due) in result.out

    # A bare stream id that one shard holds is found too (ids are per shard stream).
    bare = on_4["id"].partition("@")[0]
    holders = [t for t in shard_topics("app1", SHARDS) if admin.xrange(t, bare, bare)]
    result = await cli("inspect", *scene.conn, bare)
    if len(holders) == 1:
        assert result.code == 0, result.err
        assert "app1~4-delayed" in result.out
    else:
        assert result.code == 2
        assert "@<shard>" in result.err

    result = await cli("inspect", *scene.conn, "1-1@4")
    assert result.code == 1


async def test_cancel_of_ids_on_shard_5_removes_them_and_nothing_else(scene: Scene, admin: Any) -> None:
    rows = (await cli("pending", *scene.conn, "--limit", "0", "--json")).json()
    envelope = next(r["id"] for r in rows if r["id"].endswith("@5"))
    sid = next(s for s in scene.by_schedule_id if shard_index(s, SHARDS) == 5)
    shard5 = EngineKeys.for_topic(shard_topics("app1", SHARDS)[5])
    before = admin.xlen(shard5.stream)

    result = await cli("cancel", *scene.conn, envelope, sid)
    assert result.code == 0, result.err
    assert f"cancelled {envelope}" in result.out
    assert f"cancelled {sid}" in result.out
    assert admin.xlen(shard5.stream) == before - 2
    assert int(admin.get(shard5.count)) == before - 2
    assert not admin.xrange(shard5.stream, envelope.partition("@")[0], envelope.partition("@")[0])
    assert not admin.hexists(shard5.ids, sid)

    left = (await cli("pending", *scene.conn, "--limit", "0", "--json")).json()
    assert len(left) == TOTAL - 2
    assert {r["id"] for r in rows} - {r["id"] for r in left} == {envelope, sid}
    # The operator's cancel is in shard 5's history, and the CLI's history finds it by id.
    result = await cli("history", *scene.conn, "--id", envelope)
    assert result.code == 0, result.err
    assert "cancelled" in result.out
    assert "operator" in result.out
    # And by scheduleId, through shard 5's by-id index.
    result = await cli("history", *scene.conn, "--id", sid, "--limit", "0", "--json")
    assert result.code == 0, result.err
    [last] = result.json()[-1:]
    assert (last["event"], last["reason"].split()[0]) == ("cancelled", "operator")
    assert admin.hget(shard5.history_index, sid) is not None
    # Cancelling again: not pending any more.
    result = await cli("cancel", *scene.conn, envelope)
    assert result.code == 1


async def test_history_of_every_shard_merged(scene: Scene) -> None:
    result = await cli("history", *scene.conn, "--limit", "0")
    assert result.code == 0, result.err
    assert f"{TOTAL} records" in result.out
    # By default the newest 100 of them, every shard merged.
    newest = await cli("history", *scene.conn)
    assert newest.out.splitlines()[-1] == "100 records"
    assert newest.out.splitlines()[1:-1] == result.out.splitlines()[-101:-1]


@pytest.fixture
def aclient(cluster: RedisCluster) -> acluster.RedisCluster:
    return acluster.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)


def gauge_series(metrics: Metrics) -> dict[str, float]:
    return {
        s.labels["topic"]: s.value
        for family in metrics.pending_by_topic.collect()
        for s in family.samples
        if s.labels["instance"] == "i"
    }


async def test_the_pending_per_topic_gauge_counts_every_shard(
    scene: Scene, aclient: acluster.RedisCluster
) -> None:
    try:
        metrics = Metrics()
        client: Any = aclient  # the cluster client serves the same calls
        gauge = PendingByTopic(client, "app1", metrics.for_instance("i"), SystemClock(), shards=SHARDS)
        assert await gauge.refresh() == {"orders": 500, "billing": 500}
        assert gauge_series(metrics) == {"orders": 500.0, "billing": 500.0}
        # Bounded scan: what was not read is reported under "(other)" from the shards' exact totals.
        bounded = PendingByTopic(
            client, "app1", metrics.for_instance("i"), SystemClock(), shards=SHARDS, max_scan=300
        )
        counts = await bounded.refresh()
        assert sum(counts.values()) == TOTAL
        assert counts[OTHER_TOPICS] == TOTAL - 300
    finally:
        await aclient.aclose()


async def test_an_instance_with_6_shards_reports_1000_pending_on_its_gauge(
    scene: Scene, cluster: RedisCluster
) -> None:
    """The gauge as a user scrapes it: an instance opened with the component's settings counts
    every shard at its first refresh (at start)."""
    metrics = Metrics()
    settings = parse_settings(
        {
            "redisHost": cluster.nodes[0].address,
            "redisType": "cluster",
            "consumerID": "app1",
            "enableDelayedMessaging": "true",
            "delayShards": str(SHARDS),
        }
    )
    inst = await Instance.open("i", settings, SystemClock(), metrics.for_instance("i"))
    try:
        deadline = time.monotonic() + 10
        while gauge_series(metrics) != {"orders": 500.0, "billing": 500.0}:
            assert time.monotonic() < deadline, gauge_series(metrics)
            await asyncio.sleep(0.05)
    finally:
        await inst.close()


async def test_a_wrong_shard_count_is_warned_of_and_a_missing_redis_type_is_named(
    scene: Scene, cluster: RedisCluster
) -> None:
    conn = [*scene.conn]
    conn[conn.index("--delay-shards") + 1] = "3"
    result = await cli("pending", *conn, "--limit", "0", "--json")
    assert result.code == 0, result.err
    assert "app1~3-delayed exists" in result.err
    assert "--delay-shards N" in result.err
    # Only what the first 3 shards hold is listed (the warning says why).
    assert 0 < len(result.json()) < TOTAL
    # The right count: no warning.
    result = await cli("pending", *scene.conn, "--limit", "1", "--json")
    assert "warning" not in result.err
    # A plain client on a cluster node: Redis answers MOVED, the CLI says what is missing.
    result = await cli("pending", "--redis-host", cluster.nodes[0].address, "--app-id", "app1")
    assert result.code == 3
    assert "--redis-type cluster" in result.err
