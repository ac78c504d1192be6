"""Concurrent delayed publishes through the gRPC server (real Redis, gRPC over the unix socket):
they reach Redis in far fewer SCHEDULE script calls than publishes, each is answered on its
own (a bad one INVALID_ARGUMENT alone, one whose client deadline passes DEADLINE_EXCEEDED
alone) and each answered OK is stored once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import pytest
import redis

from delayed_middleware.entry import decode_entry
from delayed_middleware.envelope import decode_envelope
from delayed_pubsub_pb.dapr.proto.components.v1 import pubsub_pb2
from tests.components.driver import Component
from tests.conftest import script_calls
from tests.redis_server import stream_entries

DELAY = {"scheduledSendDelay": "1h"}


def delayed_messages(client: redis.Redis) -> list[bytes]:
    """The message of every envelope on app1's delayed topic (each event of a bulk envelope)."""
    out: list[bytes] = []
    for _, f in stream_entries(client, "app1-delayed"):
        e = decode_envelope(decode_entry(f).data)
        out += [b.event for b in e.bulk_entries] if e.bulk_entries else [e.message]
    return out


async def test_concurrent_delayed_publishes_share_script_calls_and_a_bad_one_fails_alone(
    component: Callable[[str], Component], props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init({**props, "enableDelayedMessaging": "true"})
    await c.publish("orders", b"warm-up", DELAY)
    before = script_calls(redis_client)
    bulk = [pubsub_pb2.BulkMessageEntry(entry_id=str(i), event=b"bulk-%d" % i) for i in range(10)]
    calls = [
        c.publish("orders", b"unary-%d" % n, DELAY)
        if n != 17
        else c.publish("orders", b"refused", {"scheduledSendDelay": "soon"})
        for n in range(60)
    ]
    got = await asyncio.gather(c.bulk_publish("orders", bulk, DELAY), *calls, return_exceptions=True)
    made = script_calls(redis_client) - before
    bad = got[1 + 17]
    assert isinstance(bad, grpc.aio.AioRpcError)
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "scheduledSendDelay" in (bad.details() or "")
    assert "soon" in (bad.details() or "")
    reply = got[0]
    assert isinstance(reply, pubsub_pb2.BulkPublishResponse)
    assert not reply.failed_entries
    assert all(g is None for i, g in enumerate(got[1:]) if i != 17)
    # 60 calls answered OK and one bulk call: one script call each before coalescing.
    assert made <= 20, f"{made} SCHEDULE calls for 60 publishes"
    expected = [
        b"warm-up",
        *(b"unary-%d" % n for n in range(60) if n != 17),
        *(b"bulk-%d" % i for i in range(10)),
    ]
    assert sorted(delayed_messages(redis_client)) == sorted(expected)


async def test_a_publish_whose_client_deadline_passes_mid_batch_does_not_break_the_others(
    component: Callable[[str], Component], props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init({**props, "enableDelayedMessaging": "true"})
    await c.publish("orders", b"warm-up", DELAY)
    before = script_calls(redis_client)
    redis_client.client_pause(600, all=False)  # the batch waits in Redis ~0.6 s
    patient = [c.publish("orders", b"patient-%d" % n, DELAY) for n in range(20)]
    hasty = c.stub.Publish(
        pubsub_pb2.PublishRequest(data=b"hasty", pubsub_name="delayed", topic="orders", metadata=DELAY),
        metadata=c.md,
        timeout=0.2,
    )
    got = await asyncio.gather(hasty, *patient, return_exceptions=True)
    assert isinstance(got[0], grpc.aio.AioRpcError)
    assert got[0].code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert got[1:] == [None] * 20
    made = script_calls(redis_client) - before
    assert made <= 10, f"{made} SCHEDULE calls for 21 publishes"
    messages = delayed_messages(redis_client)
    for n in range(20):
        assert messages.count(b"patient-%d" % n) == 1
    assert messages.count(b"hasty") <= 1  # stored whole or not at all, never twice
    # The component still answers: the next publish is stored at once.
    await c.publish("orders", b"after", DELAY)
    assert delayed_messages(redis_client).count(b"after") == 1


@pytest.fixture(autouse=True)
def _unpause(redis_client: redis.Redis) -> object:
    yield None
    redis_client.client_unpause()
