"""Delayed messages across real `delayed-pubsub serve` processes: racing replicas, kill -9.

Each process is driven over its own unix socket the way daprd drives it; they
share one Redis, as replicas of one app do.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import redis

from delayed_middleware.entry import decode_entry
from tests.components.driver import delayed_entries, now_ms
from tests.components.serve import Serve, instance, props_for
from tests.redis_server import RedisServer, stream_entries

pytestmark = pytest.mark.slow


async def wait_for_len(client: redis.Redis, key: str, n: int, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while client.xlen(key) < n:
        assert time.monotonic() < deadline, f"{key}: {client.xlen(key)} of {n} after {within_s}s"
        await asyncio.sleep(0.05)


def delivered(client: redis.Redis, topic: str) -> list[int]:
    return [json.loads(decode_entry(f).data)["n"] for _, f in stream_entries(client, topic)]


async def test_two_replicas_fire_10k_each_exactly_once(
    folder: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    a, b = Serve(folder, "a"), Serve(folder, "b")
    try:
        props = props_for(redis_server)
        async with instance(a, props) as ca, instance(b, props):
            reply = await ca.bulk_publish("orders", delayed_entries(10_000, now_ms() + 8000, 1000))
            assert list(reply.failed_entries) == []
            assert int(redis_client.get("{app1-delayed}:pending") or 0) == 10_000
            await wait_for_len(redis_client, "orders", 10_000, within_s=45)
            await asyncio.sleep(1.0)  # a duplicate would land now, if ever
            assert sorted(delivered(redis_client, "orders")) == list(range(10_000))
            assert int(redis_client.get("{app1-delayed}:pending") or 0) == 0
            assert redis_client.xlen("app1-delayed") == 0
    finally:
        a.stop()
        b.stop()


async def test_kill_9_while_firing_loses_and_duplicates_nothing(
    folder: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    n = 5000
    a = Serve(folder, "a")
    try:
        props = props_for(redis_server)
        async with instance(a, props) as ca:
            reply = await ca.bulk_publish("orders", delayed_entries(n, now_ms() + 800, 3000))
            assert list(reply.failed_entries) == []
            await wait_for_len(redis_client, "orders", 500, within_s=10)  # firing is under way
            a.kill9()
        fired_before_kill = redis_client.xlen("orders")
        assert 0 < fired_before_kill < n, "the kill must land while messages are still pending"
        await asyncio.sleep(3.5)  # everything left is overdue while no replica runs
        assert redis_client.xlen("orders") == fired_before_kill

        b = Serve(folder, "b")
        try:
            async with instance(b, props):
                await wait_for_len(redis_client, "orders", n, within_s=20)
                await asyncio.sleep(1.0)
        finally:
            b.stop()
        assert sorted(delivered(redis_client, "orders")) == list(range(n))
        assert int(redis_client.get("{app1-delayed}:pending") or 0) == 0
    finally:
        a.stop()
