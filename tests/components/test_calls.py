"""A subscription's own Redis round trip (SubscriptionCalls.round_trip) against a real Redis."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
import redis.exceptions

from delayed_middleware.clock import SystemClock
from delayed_pubsub.broker import Broker
from delayed_pubsub.calls import SubscriptionCalls
from delayed_pubsub.settings import parse_settings
from tests.redis_server import RedisServer


def calls_of(aclient: aioredis.Redis, redis_server: RedisServer) -> SubscriptionCalls:
    settings = parse_settings({"redisHost": f"127.0.0.1:{redis_server.port}", "consumerID": "app1"})
    return Broker(aclient, settings, SystemClock()).subscription("orders", "c1")._calls


async def test_replies_come_back_in_order_with_an_error_reply_as_its_exception(
    aclient: aioredis.Redis, redis_server: RedisServer
) -> None:
    calls = calls_of(aclient, redis_server)
    await aclient.set("plain", "x")
    replies = await calls.round_trip(("PING",), ("XACK", "plain", "app1", "1-1"), ("GET", "plain"))
    assert replies[0] in (b"PONG", "PONG", True)
    assert isinstance(replies[1], redis.exceptions.ResponseError)
    assert "WRONGTYPE" in str(replies[1])
    assert replies[2] == b"x"


async def test_a_round_trip_cancelled_before_its_reply_leaves_no_reply_owed_on_a_pooled_connection(
    aclient: aioredis.Redis, redis_server: RedisServer
) -> None:
    # The reply of a cancelled call still arrives; a connection handed back to the pool with
    # it owed would give it to the next caller (here: nil for a PING). The connection is
    # closed instead.
    calls = calls_of(aclient, redis_server)
    slow = asyncio.ensure_future(calls.round_trip(("BLPOP", "nothing-here", "0.3")))
    await asyncio.sleep(0.05)
    slow.cancel()
    await asyncio.gather(slow, return_exceptions=True)
    await asyncio.sleep(0.4)  # the BLPOP's nil is on the wire by now
    for _ in range(3):
        (reply,) = await calls.round_trip(("PING",))
        assert reply in (b"PONG", "PONG", True)
