"""A lost reply after a landed write: a TCP proxy on loopback forwards the
command to Redis and cuts the connection before the answer comes back.

The component must not hide the uncertainty: the call fails UNAVAILABLE (never
OK with a silent second copy, which redis-py's automatic retry used to make),
and the entry is stored exactly once. A retry by daprd or the app may then
store a second copy of a plain publish (at-least-once, RELIABILITY.md). A
delayed publish is different: the schedule step is idempotent (a per-call
token), so the component retries it itself and answers OK, stored once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
import redis

from delayed_pubsub_pb.dapr.proto.components.v1 import pubsub_pb2
from tests.chaos.proxy import LosingProxy
from tests.components.driver import Component
from tests.redis_server import RedisServer

Factory = Callable[[str], Component]
MARKER = b"lost-reply-marker"


@pytest.fixture
async def proxy(own_redis: RedisServer) -> AsyncIterator[LosingProxy]:
    p = LosingProxy(own_redis.port, MARKER)
    await p.start()
    yield p
    await p.stop()


def stored(admin: redis.Redis, topic: str) -> list[bytes]:
    entries: Any = admin.xrange(topic)
    return [fields[b"data"] for _id, fields in entries]


@pytest.mark.parametrize("retries", ["3", "0"])
async def test_a_plain_publish_whose_reply_is_lost_fails_unavailable_and_is_stored_once(
    component: Factory, own_redis: RedisServer, proxy: LosingProxy, retries: str
) -> None:
    admin = own_redis.client()
    c = component("delayed")
    await c.init({"redisHost": f"127.0.0.1:{proxy.port}", "consumerID": "app1", "redisMaxRetries": retries})
    await c.publish("orders", b"before")
    proxy.armed = True
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.publish("orders", MARKER)
    assert proxy.cuts == 1
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert stored(admin, "orders") == [b"before", MARKER]
    # The next publish reconnects and works.
    await c.publish("orders", b"after")
    assert stored(admin, "orders") == [b"before", MARKER, b"after"]
    # daprd (or the app) retrying the failed call stores a second copy: plain
    # publishes are at-least-once on a lost reply.
    await c.publish("orders", MARKER)
    assert stored(admin, "orders").count(MARKER) == 2
    admin.close()


async def test_a_bulk_publish_whose_reply_is_lost_fails_whole_and_is_stored_once(
    component: Factory, own_redis: RedisServer, proxy: LosingProxy
) -> None:
    admin = own_redis.client()
    c = component("delayed")
    await c.init({"redisHost": f"127.0.0.1:{proxy.port}", "consumerID": "app1"})
    entries = [
        pubsub_pb2.BulkMessageEntry(entry_id=str(i), event=MARKER if i == 3 else b"e%d" % i) for i in range(5)
    ]
    proxy.armed = True
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.bulk_publish("orders", entries)
    assert proxy.cuts == 1
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert stored(admin, "orders") == [b"e0", b"e1", b"e2", MARKER, b"e4"]
    admin.close()


async def test_a_delayed_publish_with_a_schedule_id_retried_after_a_lost_reply_fires_once(
    component: Factory, own_redis: RedisServer, proxy: LosingProxy
) -> None:
    admin = own_redis.client()
    c = component("delayed")
    await c.init(
        {"redisHost": f"127.0.0.1:{proxy.port}", "consumerID": "app1", "enableDelayedMessaging": "true"}
    )
    stream = await c.subscribe("orders")
    md = {"scheduledSendDelay": "1s", "scheduleId": "order-66"}
    proxy.armed = True
    await c.publish("orders", MARKER, md)  # the component's own retry finds its token: OK
    assert proxy.cuts == 1
    await c.publish("orders", MARKER, md)  # an app's retry anyway replaces the stored one
    msg = await stream.next(within=10)
    assert msg.data == MARKER
    await stream.ack(msg.id)
    assert await stream.nothing_for(2.0)
    assert stored(admin, "orders") == [MARKER]
    admin.close()


async def test_a_delayed_publish_without_schedule_id_whose_reply_is_lost_is_answered_ok_and_fires_once(
    component: Factory, own_redis: RedisServer, proxy: LosingProxy
) -> None:
    """The engine's schedule step is idempotent (a per-call token the script
    remembers): the component retries the call itself, Redis finds the token
    and stores nothing more, and the publisher gets OK, not an error it would retry."""
    admin = own_redis.client()
    c = component("delayed")
    await c.init(
        {"redisHost": f"127.0.0.1:{proxy.port}", "consumerID": "app1", "enableDelayedMessaging": "true"}
    )
    stream = await c.subscribe("orders")
    await c.publish("orders", b"warm-up", {"scheduledSendDelay": "0s"})  # the script is loaded
    assert (await stream.next(within=10)).data == b"warm-up"
    proxy.armed = True
    await c.publish("orders", MARKER, {"scheduledSendDelay": "1s"})
    assert proxy.cuts == 1
    assert admin.xlen("app1-delayed") == 1
    msg = await stream.next(within=10)
    assert msg.data == MARKER
    await stream.ack(msg.id)
    assert await stream.nothing_for(2.0)
    assert stored(admin, "orders") == [b"warm-up", MARKER]
    admin.close()
