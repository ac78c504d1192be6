"""Shared fixtures: a real redis-server per test session, flushed per test; a real 3-master
Redis Cluster per test module, flushed per test through `admin`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
import redis.cluster
from hypothesis import settings as hypothesis_settings

from delayed_middleware.clock import SystemClock
from delayed_middleware.engine import DelayEngine
from delayed_middleware.keys import EngineKeys
from delayed_middleware.retry import RetryPolicy
from delayed_pubsub.metrics import Metrics
from delayed_pubsub.redelivery import Retrier
from tests.redis_server import RedisCluster, RedisServer


class SkewedClock(SystemClock):
    """A replica's system clock that runs `skew_ms` ahead (negative: behind) of the real time:
    a production clock (not authoritative), as on a machine whose NTP has drifted."""

    def __init__(self, skew_ms: int) -> None:
        self.skew_ms = skew_ms

    def now_ms(self) -> int:
        return super().now_ms() + self.skew_ms


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


@pytest.fixture
async def aclient(redis_server: RedisServer, redis_client: redis.Redis) -> AsyncIterator[aioredis.Redis]:
    """An asyncio client on the same flushed database as `redis_client`."""
    client = aioredis.Redis(port=redis_server.port)
    yield client
    await client.aclose()


def retrier(client: Any, consumer: str, policy: RetryPolicy | None = None, topic: str = "orders") -> Retrier:
    """The retry executor of group app1 on `topic` for `consumer`: an hourly backoff unless
    `policy` says otherwise."""
    return Retrier(
        client,
        policy or RetryPolicy(active=True, initial_ms=3_600_000, max_ms=3_600_000),
        topic=topic,
        group="app1",
        consumer=consumer,
        clock=SystemClock(),
        metrics=Metrics().for_instance(""),
        call_timeout=5.0,
    )


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


async def drain_and_compact(engine: DelayEngine) -> None:
    """Fire steps until nothing is due and no compaction pass is under way."""
    while (await engine.fire_due())[0] or engine.compacting:
        pass


def stored_bytes(client: redis.Redis | redis.cluster.RedisCluster, keys: EngineKeys) -> int:
    """MEMORY USAGE (every node sampled) of a delayed topic's stream and its moved hash."""
    total = 0
    for key in (keys.stream, keys.moved):
        total += int(client.memory_usage(key, samples=0) or 0)
    return total


def freed_by_deleting(client: redis.Redis, keys: EngineKeys) -> int:
    """used_memory freed by deleting every key of a delayed topic: what its pending messages
    hold in Redis. Fixed costs (the script cache, the slowlog, connection buffers) stay out."""
    before = int(client.info("memory")["used_memory"])
    names = [keys.stream, *client.scan_iter(match="{" + keys.stream + "}*", count=1_000)]
    client.delete(*names)
    return before - int(client.info("memory")["used_memory"])


def script_calls(*clients: redis.Redis) -> int:
    """EVAL and EVALSHA calls these Redis servers have answered so far (INFO commandstats):
    a test diffs two readings to count the script calls a step made."""
    total = 0
    for client in clients:
        stats: dict[str, Any] = client.info("commandstats")
        total += sum(int(v["calls"]) for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))
    return total
