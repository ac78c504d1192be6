"""Shared fixtures: a real redis-server per test session, flushed per test; a real 3-master
Redis Cluster per test module, flushed per test through `admin`."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.cluster
from hypothesis import settings as hypothesis_settings

from tests.redis_server import RedisCluster, RedisServer


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(Path(tmp_path_factory.mktemp("redis")))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A sync client on a flushed database: each test starts from nothing."""
    client = redis_server.client()
    client.flushall()
    yield client
    client.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    c = RedisCluster(Path(tmp_path_factory.mktemp("cluster")))
    c.start()
    yield c
    c.stop()


@pytest.fixture
def admin(cluster: RedisCluster) -> Iterator[redis.cluster.RedisCluster]:
    cluster.flushall()
    c = cluster.client()
    yield c
    c.close()


@contextmanager
def small_stream_nodes(client: Any, entries: int) -> Iterator[None]:
    """Streams created meanwhile get nodes of `entries` entries, so approximate trimming (which frees
    whole nodes) shows its bound in a small test; the server's setting is restored after."""
    before = client.config_get("stream-node-max-entries")["stream-node-max-entries"]
    client.config_set("stream-node-max-entries", str(entries))
    try:
        yield
    finally:
        client.config_set("stream-node-max-entries", before)


# The machine running the suite may be busy (two cores, parallel jobs): a
# property test is about what it computes, not how fast, so no deadline.
hypothesis_settings.register_profile("suite", deadline=None)
hypothesis_settings.load_profile("suite")
