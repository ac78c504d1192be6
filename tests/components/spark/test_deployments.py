"""The data sources on Redis Cluster and on TLS with a client certificate: the component's own options."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.components.spark.conftest import APP, add_history, fired
from tests.redis_server import RedisCluster, TlsRedisServer, make_tls_files


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    c = RedisCluster(Path(tmp_path_factory.mktemp("cluster")))
    c.start()
    yield c
    c.stop()


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
