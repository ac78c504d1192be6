"""The data sources on Redis Cluster and on TLS with a client certificate: the component's own options."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio.cluster as acluster

from delayed_middleware.clock import ManualClock
from delayed_middleware.engine import DelayEngine, ShardedEngine
from delayed_middleware.envelope import Envelope
from delayed_middleware.keys import EngineKeys, shard_index, shard_topics
from delayed_pubsub.cli import build_parser
from delayed_pubsub.spark.cli import run
from tests.components.spark.conftest import APP, add_history, fired
from tests.redis_server import RedisCluster, TlsRedisServer, make_tls_files


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsRedisServer]:
    files = make_tls_files(Path(tmp_path_factory.mktemp("tls")))
    server = TlsRedisServer(Path(tmp_path_factory.mktemp("tls-redis")), files, auth_clients="yes")
    server.start()
    yield server
    server.stop()


def _check(spark: Any, client: Any, options: dict[str, str]) -> None:
    ids = add_history(client, [fired("a", 1_000, late) for late in range(25)])
    df = spark.read.format("delayed-history").options(**options, consumerID=APP, numPartitions="3").load()
    rows = df.collect()
    assert sorted(r["history_id"] for r in rows) == sorted(ids)
    assert sorted(r["lateness_ms"] for r in rows) == list(range(25))


def test_history_on_redis_cluster(spark: Any, cluster: RedisCluster) -> None:
    cluster.flushall()
    _check(spark, cluster.client(), {"redisHost": ",".join(cluster.addresses), "redisType": "cluster"})


def test_history_over_tls_with_client_certificate(spark: Any, tls_server: TlsRedisServer) -> None:
    client = tls_server.client()
    client.flushall()
    _check(
        spark,
        client,
        {
            "redisHost": tls_server.address,
            "enableTLS": "true",
            "insecureSkipTLSVerify": "true",
            "clientCert": tls_server.tls.client_cert.read_text(),
            "clientKey": tls_server.tls.client_key.read_text(),
        },
    )


def test_history_of_every_delay_shard_on_redis_cluster(spark: Any, cluster: RedisCluster) -> None:
    """With delayShards (16 by default on Cluster) each shard has its own history
    (`{app1~<n>-delayed}:history`): the reader reads every shard of the app, and
    exactly the shards the component's delayShards names."""
    cluster.flushall()
    client: Any = cluster.client()
    ids = {
        n: add_history(client, [fired(f"t{n}", 1_000, n)], app=APP if not n else f"{APP}~{n}")
        for n in (0, 5, 15)
    }
    props = {"redisHost": ",".join(cluster.addresses), "redisType": "cluster", "consumerID": APP}
    rows = spark.read.format("delayed-history").options(**props).load().collect()
    assert sorted(r["history_id"] for r in rows) == sorted(i for got in ids.values() for i in got)
    assert sorted(r["lateness_ms"] for r in rows) == [0, 5, 15]
    rows = spark.read.format("delayed-history").options(**props, delayShards="6").load().collect()
    assert sorted(r["lateness_ms"] for r in rows) == [0, 5]


async def test_pending_and_stats_read_every_delay_shard_on_redis_cluster(
    spark: Any, cluster: RedisCluster
) -> None:
    """1,000 pending over delayShards 6 on a cluster: `delayed-pending` has every envelope of
    every shard stream once, each row naming its shard stream, scheduleIds on the shard they
    hash to; and `delayed-pubsub stats` says 1,000 pending."""
    cluster.flushall()
    client = acluster.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
    topics = shard_topics(APP, 6)
    try:
        clock = ManualClock(time.time_ns() // 1_000_000)
        sharded = ShardedEngine([DelayEngine(client, EngineKeys.for_topic(t), clock) for t in topics])
        due = clock.now_ms() + 3_600_000

        def env(i: int, schedule_id: str = "") -> Envelope:
            return Envelope(
                id="",
                topic="t",
                due_ms=due + i,
                published_at_ms=clock.now_ms(),
                message=b"x",
                schedule_id=schedule_id,
            )

        # 12 calls of 50 without scheduleIds (one shard per call, in turn), 400 with one (by hash).
        for call in range(12):
            await sharded.schedule([env(call * 50 + i) for i in range(50)])
        await sharded.schedule([env(600 + i, f"s{i}") for i in range(400)])
    finally:
        await client.aclose()
    props = {"redisHost": ",".join(cluster.addresses), "redisType": "cluster", "consumerID": APP}
    rows = spark.read.format("delayed-pending").options(**props, delayShards="6").load().collect()
    assert len(rows) == 1_000
    assert {r["delayed_topic"] for r in rows} == set(topics)
    assert len({(r["delayed_topic"], r["stream_id"]) for r in rows}) == 1_000
    by_sid = {r["schedule_id"]: r["delayed_topic"] for r in rows if r["schedule_id"]}
    assert by_sid == {f"s{i}": topics[shard_index(f"s{i}", 6)] for i in range(400)}

    out = io.StringIO()
    argv = ["--redis-host", cluster.nodes[1].address, "--redis-type", "cluster", "--delay-shards", "6"]
    assert run(build_parser().parse_args(["stats", *argv, "--app-id", APP]), out) == 0
    text = out.getvalue().split("pending by due window")[0]
    [line] = [line.split() for line in text.splitlines() if line.strip().startswith("t ")]
    assert line[:2] == ["t", "1,000"], text
