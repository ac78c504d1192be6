"""Broker and Subscription against a real Redis, below the gRPC layer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from delayed_middleware.clock import SystemClock
from delayed_middleware.entry import StreamEntry, encode_entry
from delayed_pubsub.broker import Broker, BulkEntry, Delivery, Subscription
from delayed_pubsub.settings import Settings, parse_settings
from tests.redis_server import RedisServer


@pytest.fixture
async def aclient(redis_server: RedisServer, redis_client: redis.Redis) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis(port=redis_server.port)
    yield client
    await client.aclose()


def settings(redis_server: RedisServer, **extra: str) -> Settings:
    return parse_settings(
        {
            "redisHost": f"127.0.0.1:{redis_server.port}",
            "consumerID": "app1",
            "processingTimeout": "400ms",
            "redeliverInterval": "100ms",
            **extra,
        }
    )


async def next_delivery(it: AsyncIterator[Delivery], within: float = 5.0) -> Delivery:
    return await asyncio.wait_for(anext(it), within)


async def test_publish_is_readable_as_pubsub_redis_reads_it(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    broker = Broker(aclient, settings(redis_server), SystemClock())
    entry_id = await broker.publish("orders", StreamEntry(b"{}", {"a": "1"}, "application/json"))
    rows: Any = redis_client.xrange("orders")
    assert rows == [
        (entry_id.encode(), {b"data": b"{}", b"metadata": b'{"a":"1"}', b"contentType": b"application/json"})
    ]


async def test_max_len_approx_trims_the_stream(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    broker = Broker(aclient, settings(redis_server, maxLenApprox="10"), SystemClock())
    await broker.bulk_publish("orders", [BulkEntry(str(i), StreamEntry(b"x")) for i in range(1000)])
    # Approximate trimming removes whole radix-tree nodes (100 entries each).
    assert 10 <= redis_client.xlen("orders") <= 200


async def test_stream_ttl_trims_entries_older_than_the_ttl(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    two_hours_ago = int(time.time() * 1000) - 7_200_000
    for i in range(500):
        redis_client.xadd("orders", encode_entry(StreamEntry(b"old")), id=f"{two_hours_ago}-{i}")  # type: ignore[arg-type]
    broker = Broker(aclient, settings(redis_server, streamTTL="1h"), SystemClock())
    await broker.publish("orders", StreamEntry(b"new"))
    rows: Any = redis_client.xrange("orders")
    assert len(rows) < 200  # approximate: whole 100-entry nodes go
    assert rows[-1][1][b"data"] == b"new"


async def test_bulk_publish_to_wrong_type_key_reports_every_entry(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    redis_client.set("orders", "a string")
    broker = Broker(aclient, settings(redis_server), SystemClock())
    failed = await broker.bulk_publish(
        "orders", [BulkEntry("a", StreamEntry(b"1")), BulkEntry("b", StreamEntry(b"2"))]
    )
    assert [f.entry_id for f in failed] == ["a", "b"]
    assert all("WRONGTYPE" in f.error for f in failed)


async def test_subscription_reclaims_entries_of_a_dead_consumer(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    s = settings(redis_server)
    redis_client.xgroup_create("orders", "app1", id="0", mkstream=True)
    kept = redis_client.xadd("orders", encode_entry(StreamEntry(b"kept", {"k": "v"})))  # type: ignore[arg-type]
    gone = redis_client.xadd("orders", encode_entry(StreamEntry(b"gone")))  # type: ignore[arg-type]
    # A consumer reads both and dies; one entry is then deleted while pending.
    redis_client.xreadgroup("app1", "dead", {"orders": ">"})
    redis_client.xdel("orders", gone)

    sub = Broker(aclient, s, SystemClock()).subscription("orders", "alive")
    await sub.start()
    try:
        it = sub.deliveries()
        d = await next_delivery(it)
        assert (d.id, d.entry.data, d.metadata) == (_s(kept), b"kept", {"k": "v", "deliveryAttempt": "2"})
        await sub.ack(d.id)
        pending: Any = redis_client.xpending("orders", "app1")
        assert pending["pending"] == 0  # the deleted one was dropped from the PEL too
    finally:
        await sub.close()


async def test_subscription_keeps_retrying_while_the_topic_key_is_unusable(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    redis_client.set("orders", "not a stream")
    sub = Broker(aclient, settings(redis_server), SystemClock()).subscription("orders", "c1")
    start = asyncio.create_task(sub.start())
    await asyncio.sleep(0.3)
    assert not start.done()  # still retrying XGROUP CREATE, not failed
    redis_client.delete("orders")
    await asyncio.wait_for(start, 5)
    redis_client.xadd("orders", encode_entry(StreamEntry(b"ok")))  # type: ignore[arg-type]
    try:
        assert (await next_delivery(sub.deliveries())).entry.data == b"ok"
    finally:
        await sub.close()


async def test_close_leaves_unacked_entries_pending_and_keeps_their_consumer(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    sub: Subscription = Broker(aclient, settings(redis_server), SystemClock()).subscription("orders", "c1")
    await sub.start()
    redis_client.xadd("orders", encode_entry(StreamEntry(b"x")))  # type: ignore[arg-type]
    await next_delivery(sub.deliveries())
    await sub.close()
    consumers: Any = redis_client.xinfo_consumers("orders", "app1")
    assert [(c["name"], c["pending"]) for c in consumers] == [(b"c1", 1)]


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
