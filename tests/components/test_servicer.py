"""The PubSub service driven over a real unix socket exactly as daprd drives it, against a real Redis."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
import redis
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from delayed_middleware.clock import SystemClock
from delayed_pubsub.broker import Broker
from delayed_pubsub.servicer import _pump_acks
from delayed_pubsub.settings import parse_settings
from delayed_pubsub_pb.dapr.proto.components.v1 import pubsub_pb2
from tests.components.driver import Component
from tests.redis_server import RedisServer, free_port
from tests.waiting import wait_until

Factory = Callable[[str], Component]

CLOUDEVENT = json.dumps(
    {
        "specversion": "1.0",
        "id": "5929aaac-a5e2-4ca1-859c-edfe73f11565",
        "source": "checkout",
        "type": "com.dapr.event.sent",
        "datacontenttype": "application/json",
        "data": {"orderId": 66, "note": "Zürich ✓"},
        "topic": "orders",
        "pubsubname": "delayed",
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    }
).encode()


def entries(client: redis.Redis, topic: str) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """The raw stream entries, as any Redis client (or pubsub.redis) sees them."""
    rows: Any = client.xrange(topic)
    return [(i, dict(f)) for i, f in rows]


# --- discovery ---------------------------------------------------------------


async def test_reflection_v1alpha_lists_pubsub_health_and_reflection(channel: grpc.aio.Channel) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo()
    await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    reply = await call.read()
    await call.done_writing()
    names = {s.name for s in reply.list_services_response.service}
    assert names == {
        "dapr.proto.components.v1.PubSub",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }


async def test_health_reports_serving(channel: grpc.aio.Channel) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    reply = await stub.Check(health_pb2.HealthCheckRequest(service=""))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


# --- Init, Features, Ping ----------------------------------------------------


async def test_init_then_features_advertise_bulk_only(component: Factory, props: dict[str, str]) -> None:
    c = component("delayed")
    await c.init(props)
    assert await c.features() == ["BULK_PUBSUB", "MESSAGE_TTL"]
    await c.ping()


async def _unary(c: Component, call: str) -> None:
    if call == "publish":
        await c.publish("orders", b"x")
    elif call == "bulk":
        await c.bulk_publish("orders", [pubsub_pb2.BulkMessageEntry(entry_id="1", event=b"x")])
    else:
        await getattr(c, call)()


@pytest.mark.parametrize("call", ["features", "ping", "pause", "resume", "publish", "bulk"])
async def test_calls_before_init_fail_precondition(component: Factory, call: str) -> None:
    c = component("never-initialized")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _unary(c, call)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "never-initialized" in (err.value.details() or "")


async def test_pull_before_init_fails_precondition(component: Factory) -> None:
    stream = await component("never-initialized").subscribe("orders")
    code, details = await stream.status()
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "never-initialized" in details


async def test_pull_with_empty_topic_is_invalid_argument(component: Factory, props: dict[str, str]) -> None:
    c = component("delayed")
    await c.init(props)
    code, details = await (await c.subscribe("")).status()
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "topic" in details


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("redisPort", "http"),
        ("redisDB", "-1"),
        ("redisType", "galaxy"),
        ("enableTLS", "maybe"),
        ("processingTimeout", "10 minutes"),
        ("queueDepth", "0"),
        ("streamTTL", "1d"),
    ],
)
async def test_bad_init_metadata_is_invalid_argument_naming_key_and_value(
    component: Factory, props: dict[str, str], key: str, value: str
) -> None:
    c = component("delayed")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.init({**props, key: value})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = err.value.details() or ""
    assert key in details
    assert value in details


async def test_failover_without_master_name_is_invalid_argument(
    component: Factory, props: dict[str, str]
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await component("delayed").init({**props, "failover": "true"})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sentinelMasterName" in (err.value.details() or "")


async def test_unreachable_redis_is_unavailable_naming_host_port(
    component: Factory, props: dict[str, str]
) -> None:
    port = free_port()  # nothing listens there
    c = component("delayed")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.init(
            {**props, "redisHost": f"127.0.0.1:{port}", "dialTimeout": "500ms", "redisMaxRetries": "0"}
        )
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"127.0.0.1:{port}" in (err.value.details() or "")
    # A failed Init registers nothing.
    with pytest.raises(grpc.aio.AioRpcError) as err2:
        await c.ping()
    assert err2.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_ping_is_unavailable_while_redis_is_down(
    component: Factory, props: dict[str, str], redis_server: RedisServer
) -> None:
    c = component("delayed")
    await c.init({**props, "redisMaxRetries": "0", "dialTimeout": "300ms"})
    redis_server.stop()
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.ping()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        redis_server.start()
    await c.ping()


# --- Publish -----------------------------------------------------------------


async def test_publish_empty_topic_is_invalid_argument(component: Factory, props: dict[str, str]) -> None:
    c = component("delayed")
    await c.init(props)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.publish("", b"x")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "topic" in (err.value.details() or "")


@pytest.mark.parametrize(
    "data",
    [CLOUDEVENT, bytes(range(256)) * 3, b""],
    ids=["cloudevent", "raw-bytes", "empty"],
)
async def test_publish_round_trips_byte_exact_through_pull(
    component: Factory, props: dict[str, str], data: bytes
) -> None:
    c = component("delayed")
    await c.init(props)
    stream = await c.subscribe("orders")
    await c.publish("orders", data, {"rawPayload": "true", "traceid": "ü-1"})
    msg = await stream.next()
    assert msg.data == data
    assert msg.topic_name == "orders"
    assert msg.content_type == ""
    assert msg.metadata["rawPayload"] == "true"
    assert msg.metadata["traceid"] == "ü-1"
    assert msg.metadata["deliveryAttempt"] == "1"
    assert msg.id
    await stream.ack(msg.id)
    assert await stream.close() == grpc.StatusCode.OK


async def test_publish_writes_pubsub_redis_entry_format(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init(props)
    await c.publish("orders", CLOUDEVENT, {"k": "v"})
    [(_, fields)] = entries(redis_client, "orders")
    assert fields == {b"data": CLOUDEVENT, b"metadata": b'{"k":"v"}'}


async def test_messages_published_before_subscribing_are_delivered(
    component: Factory, props: dict[str, str]
) -> None:
    c = component("delayed")
    await c.init(props)
    for i in range(3):
        await c.publish("orders", f"early-{i}".encode())
    stream = await c.subscribe("orders")
    got = []
    for _ in range(3):
        msg = await stream.next()
        got.append(msg.data)
        await stream.ack(msg.id)
    assert got == [b"early-0", b"early-1", b"early-2"]


# --- BulkPublish -------------------------------------------------------------


async def test_bulk_publish_reports_the_failing_entry_and_lands_the_others(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init(props)
    # A plain string where the stream should be: XADD fails with WRONGTYPE for
    # the entries of this topic only.
    redis_client.set("broken", "not a stream")
    reply = await c.bulk_publish(
        "broken", [pubsub_pb2.BulkMessageEntry(entry_id="e1", event=b"x", content_type="text/plain")]
    )
    assert [(f.entry_id, "WRONGTYPE" in f.error) for f in reply.failed_entries] == [("e1", True)]

    entries = [
        pubsub_pb2.BulkMessageEntry(
            entry_id=f"e{i}", event=f"m{i}".encode(), content_type="text/plain", metadata={"n": str(i)}
        )
        for i in range(5)
    ]
    reply = await c.bulk_publish("orders", entries, metadata={"batch": "b1"})
    assert list(reply.failed_entries) == []
    stream = await c.subscribe("orders")
    for i in range(5):
        msg = await stream.next()
        assert (msg.data, msg.content_type) == (f"m{i}".encode(), "text/plain")
        assert msg.metadata["n"] == str(i)
        assert msg.metadata["batch"] == "b1"
        await stream.ack(msg.id)


async def test_bulk_publish_reports_exactly_the_entries_redis_refused(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init(props)
    # Real per-entry failures inside one pipelined batch: with maxmemory just
    # above what Redis uses, the first XADDs fit and the rest get OOM.
    used = int(redis_client.info("memory")["used_memory"])
    redis_client.config_set("maxmemory-policy", "noeviction")
    redis_client.config_set("maxmemory", str(used + 256 * 1024))
    try:
        batch = [
            pubsub_pb2.BulkMessageEntry(entry_id=f"e{i}", event=bytes([65 + i % 26]) * 16 * 1024)
            for i in range(60)
        ]
        reply = await c.bulk_publish("orders", batch)
    finally:
        redis_client.config_set("maxmemory", "0")
    failed = {f.entry_id for f in reply.failed_entries}
    assert all("maxmemory" in f.error for f in reply.failed_entries)
    landed = [f[b"data"] for _, f in entries(redis_client, "orders")]
    assert 0 < len(landed) < 60
    assert len(landed) + len(failed) == 60
    assert landed == [e.event for e in batch if e.entry_id not in failed]


# --- PullMessages ------------------------------------------------------------


async def test_ack_removes_the_entry_from_the_pel(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init(props)
    stream = await c.subscribe("orders")
    await c.publish("orders", b"one")
    msg = await stream.next()
    assert redis_client.xpending("orders", "app1")["pending"] == 1
    await stream.ack(msg.id)
    await wait_until(lambda: redis_client.xpending("orders", "app1")["pending"] == 0)


async def test_nack_redelivers_same_entry_after_redeliver_interval(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init({**props, "redeliverInterval": "300ms", "processingTimeout": "60s"})
    stream = await c.subscribe("orders")
    await c.publish("orders", b"flaky", {"k": "v"})
    first = await stream.next()
    assert first.metadata["deliveryAttempt"] == "1"
    nacked_at = time.monotonic()
    await stream.nack(first.id)
    second = await stream.next(within=3)
    assert time.monotonic() - nacked_at >= 0.28
    assert (second.id, second.data, second.metadata["k"]) == (first.id, b"flaky", "v")
    assert second.metadata["deliveryAttempt"] == "2"
    await stream.nack(second.id)
    third = await stream.next(within=3)
    assert third.metadata["deliveryAttempt"] == "3"
    await stream.ack(third.id)
    # The stream parses a metadata field it has seen before once, and the entries that carry
    # it share the map: other messages with the same metadata carry their own attempt, and
    # nothing of the redelivery's (nor a deliveryAttempt of the publisher's own).
    await c.publish("orders", b"steady", {"k": "v"})
    await c.publish("orders", b"steady", {"k": "v", "deliveryAttempt": "9"})
    for _ in range(2):
        other = await stream.next()
        assert (other.data, dict(other.metadata)) == (b"steady", {"k": "v", "deliveryAttempt": "1"})
        await stream.ack(other.id)
    await wait_until(lambda: redis_client.xpending("orders", "app1")["pending"] == 0)


async def test_cancelled_stream_leaves_message_pending_for_the_next_stream(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init(props)  # processingTimeout 500ms
    stream = await c.subscribe("orders")
    await c.publish("orders", b"in-flight")
    msg = await stream.next()
    await stream.cancel()
    assert redis_client.xpending("orders", "app1")["pending"] == 1

    started = time.monotonic()
    again = await (await c.subscribe("orders")).next(within=5)
    assert time.monotonic() - started >= 0.3  # not before it had been idle processingTimeout
    assert (again.id, again.data) == (msg.id, b"in-flight")
    assert again.metadata["deliveryAttempt"] == "2"


async def test_unacked_message_of_live_stream_is_not_duplicated_to_it(
    component: Factory, props: dict[str, str]
) -> None:
    c = component("delayed")
    await c.init(props)  # processingTimeout 500ms, reclaim every 200ms
    stream = await c.subscribe("orders")
    await c.publish("orders", b"slow")
    msg = await stream.next()
    assert await stream.nothing_for(1.2)  # well past processingTimeout
    await stream.ack(msg.id)


async def test_concurrency_caps_unacked_messages_per_stream(
    component: Factory, props: dict[str, str]
) -> None:
    c = component("delayed")
    await c.init({**props, "concurrency": "2"})
    for i in range(4):
        await c.publish("orders", f"m{i}".encode())
    stream = await c.subscribe("orders")
    a, b = await stream.next(), await stream.next()
    assert await stream.nothing_for(0.3)
    await stream.ack(a.id)
    third = await stream.next()
    assert [a.data, b.data, third.data] == [b"m0", b"m1", b"m2"]


async def test_stream_survives_redis_restart(
    component: Factory, props: dict[str, str], redis_server: RedisServer
) -> None:
    c = component("delayed")
    await c.init(props)
    stream = await c.subscribe("orders")
    await c.publish("orders", b"before")
    before = await stream.next()
    await stream.ack(before.id)
    redis_server.restart()
    await c.publish("orders", b"after")
    after = await stream.next(within=10)
    assert after.data == b"after"
    assert not stream.ended.is_set()


async def test_stream_recreates_group_when_redis_comes_back_empty(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init(props)
    stream = await c.subscribe("orders")
    await c.publish("orders", b"before")
    await stream.ack((await stream.next()).id)
    redis_client.flushall()
    await c.publish("orders", b"after-flush")
    assert (await stream.next(within=10)).data == b"after-flush"


async def test_entry_deleted_while_waiting_for_redelivery_is_dropped(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init(props)
    stream = await c.subscribe("orders")
    await c.publish("orders", b"doomed")
    msg = await stream.next()
    redis_client.xdel("orders", msg.id)
    await stream.nack(msg.id)
    await c.publish("orders", b"next")
    nxt = await stream.next()
    assert nxt.data == b"next"
    await stream.ack(nxt.id)
    assert await stream.nothing_for(0.5)
    await wait_until(lambda: redis_client.xpending("orders", "app1")["pending"] == 0)


async def test_pause_stops_and_resume_restarts_delivery(component: Factory, props: dict[str, str]) -> None:
    c = component("delayed")
    await c.init(props)
    stream = await c.subscribe("orders")
    await c.pause()
    await c.pause()  # idempotent
    await c.publish("orders", b"held")
    assert await stream.nothing_for(0.4)
    await c.resume()
    await c.resume()
    assert (await stream.next()).data == b"held"


async def test_orderly_close_removes_the_idle_consumer(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init(props)
    stream = await c.subscribe("orders")
    await c.publish("orders", b"x")
    await stream.ack((await stream.next()).id)
    await wait_until(lambda: redis_client.xpending("orders", "app1")["pending"] == 0)
    assert len(redis_client.xinfo_consumers("orders", "app1")) == 1
    assert await stream.close() == grpc.StatusCode.OK
    await wait_until(lambda: redis_client.xinfo_consumers("orders", "app1") == [])


async def test_two_streams_of_one_group_share_the_work(component: Factory, props: dict[str, str]) -> None:
    c = component("delayed")
    await c.init(props)
    s1, s2 = await c.subscribe("orders"), await c.subscribe("orders")
    for i in range(20):
        await c.publish("orders", str(i).encode())
    seen: list[bytes] = []
    while len(seen) < 20:
        for s in (s1, s2):
            while not s.received.empty():
                msg = s.received.get_nowait()
                seen.append(msg.data)
                await s.ack(msg.id)
        await asyncio.sleep(0.01)
    assert sorted(seen) == sorted(str(i).encode() for i in range(20))


# --- acks only for what a stream holds; bursts (issues 12 and 13) -------------


async def test_a_stream_cannot_ack_a_message_another_stream_holds(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init({**props, "concurrency": "1"})  # processingTimeout 500ms
    a = await c.subscribe("orders")
    await c.publish("orders", b"m0")
    held_by_a = await a.next()
    b = await c.subscribe("orders")
    await c.publish("orders", b"m1")
    held_by_b = await b.next()
    # b acks a's message (a misbehaving or confused client), then its own.
    await b.ack(held_by_a.id)
    await b.ack(held_by_b.id)
    await wait_until(lambda: redis_client.xpending("orders", "app1")["pending"] == 1)
    # a's client dies without acking: the message comes back, to b.
    await a.cancel()
    again = await b.next(within=5)
    assert (again.id, again.data, again.metadata["deliveryAttempt"]) == (held_by_a.id, b"m0", "2")
    await b.ack(again.id)
    await wait_until(lambda: redis_client.xpending("orders", "app1")["pending"] == 0)
    assert not b.ended.is_set()


async def test_garbage_and_repeated_acks_do_not_end_the_stream(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init(props)
    stream = await c.subscribe("orders")
    await c.publish("orders", b"m0")
    msg = await stream.next()
    for bogus in ("not-an-id", "0-0", "18446744073709551615-18446744073709551615", "x" * 10_000):
        await stream.ack(bogus)
    await stream.ack(msg.id)
    await stream.ack(msg.id)
    await c.publish("orders", b"m1")
    assert (await stream.next()).data == b"m1"
    assert not stream.ended.is_set()


async def test_a_burst_through_several_streams_arrives_exactly_once(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    n = 3000
    pipe = redis_client.pipeline(transaction=False)
    for i in range(n):
        pipe.xadd("orders", {"data": str(i).encode(), "metadata": b"{}"})
    pipe.execute()
    c = component("delayed")
    await c.init({**props, "concurrency": "50", "processingTimeout": "60s"})
    streams = [await c.subscribe("orders") for _ in range(3)]
    seen: list[bytes] = []

    async def drain(s: Any) -> None:
        while len(seen) < n:
            try:
                msg = await asyncio.wait_for(s.received.get(), 0.5)
            except TimeoutError:
                continue
            seen.append(msg.data)
            await s.ack(msg.id)

    await asyncio.wait_for(asyncio.gather(*(drain(s) for s in streams)), 60)
    assert sorted(seen, key=int) == [str(i).encode() for i in range(n)]
    for s in streams:
        assert await s.close() == grpc.StatusCode.OK
    # The orderly close XACKed every ack it had read: nothing comes back.
    assert redis_client.xpending("orders", "app1")["pending"] == 0
    late = await c.subscribe("orders")
    assert await late.nothing_for(0.3)


async def test_expired_messages_are_never_sent_on_the_stream(
    server: Any, component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    now_ms = int(time.time() * 1000)
    redis_client.xadd("orders", {"data": b"gone", "metadata": b"{}", "expiresAt": str(now_ms - 1000)})
    redis_client.xadd("orders", {"data": b"live", "metadata": b"{}", "expiresAt": str(now_ms + 60_000)})
    c = component("delayed")
    await c.init(props)
    stream = await c.subscribe("orders")
    msg = await stream.next()
    assert msg.data == b"live"
    await stream.ack(msg.id)
    assert await stream.nothing_for(0.8)  # past processingTimeout: not reclaimed either
    assert redis_client.xpending("orders", "app1")["pending"] == 0
    expired = server.metrics.registry.get_sample_value(
        "delayed_pubsub_expired_messages_total", {"instance": "delayed"}
    )
    assert expired == 1


# --- instances ---------------------------------------------------------------


async def test_instances_on_one_socket_are_isolated(
    component: Factory, props: dict[str, str], redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    a, b = component("a"), component("b")
    await a.init({**props, "redisDB": "1", "consumerID": "app-a"})
    await b.init({**props, "redisDB": "2", "consumerID": "app-b"})
    await a.publish("orders", b"for-a")
    await b.publish("orders", b"for-b")
    db1 = redis.Redis(port=redis_server.port, db=1)
    db2 = redis.Redis(port=redis_server.port, db=2)
    assert [f[b"data"] for _, f in entries(db1, "orders")] == [b"for-a"]
    assert [f[b"data"] for _, f in entries(db2, "orders")] == [b"for-b"]

    sa = await a.subscribe("orders")
    assert (await sa.next()).data == b"for-a"
    # Re-initializing b (even badly) leaves a alone.
    with pytest.raises(grpc.aio.AioRpcError):
        await b.init({**props, "redisDB": "x"})
    await b.init({**props, "redisDB": "3", "consumerID": "app-b"})
    await a.publish("orders", b"a-again")
    assert (await sa.next()).data == b"a-again"
    assert db2.xlen("orders") == 1
    db1.close()
    db2.close()


async def test_two_instances_of_one_app_share_a_topic_as_two_consumers_each_message_once(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    # Several component YAMLs of one app (same consumerID) subscribed to one topic are how a
    # backlog drains faster through daprd (docs/targets.md): one consumer group, one consumer
    # per stream. Were the two streams one consumer, either could take the other's pending
    # entries, and closing one would count the other's as its own.
    a, b = component("delayed"), component("delayed1")
    await a.init({**props, "consumerID": "shared"})
    await b.init({**props, "consumerID": "shared"})
    sa, sb = await a.subscribe("orders"), await b.subscribe("orders")
    for i in range(40):
        await a.publish("orders", f"m{i}".encode())
    got: list[bytes] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 15
    while len(got) < 40 and loop.time() < deadline:
        for stream in (sa, sb):
            while not stream.received.empty():
                msg = stream.received.get_nowait()
                got.append(msg.data)
                await stream.ack(msg.id)
        await asyncio.sleep(0.01)
    assert await sa.nothing_for(0.5)
    assert await sb.nothing_for(0)
    assert sorted(got) == sorted(f"m{i}".encode() for i in range(40))
    consumers = {c["name"] for c in redis_client.xinfo_consumers("orders", "shared")}
    assert len(consumers) == 2, consumers


async def test_second_init_replaces_the_first(
    component: Factory, props: dict[str, str], redis_server: RedisServer
) -> None:
    c = component("delayed")
    await c.init({**props, "redisDB": "4"})
    await c.init({**props, "redisDB": "5"})
    await c.publish("orders", b"x")
    db5 = redis.Redis(port=redis_server.port, db=5)
    db4 = redis.Redis(port=redis_server.port, db=4)
    assert db5.xlen("orders") == 1
    assert db4.exists("orders") == 0
    db4.close()
    db5.close()


async def test_the_ack_pump_stops_reading_once_its_subscription_is_closed(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    # Not by cancellation alone: redis-py can swallow the CancelledError meant
    # for an ack in flight, and the pump would go on reading daprd's acks.
    client = aioredis.Redis(port=redis_server.port)
    settings = parse_settings({"redisHost": f"127.0.0.1:{redis_server.port}", "consumerID": "app1"})
    sub = Broker(client, settings, SystemClock()).subscription("orders", "c1")
    await sub.start()
    pulled = []

    async def requests() -> AsyncIterator[pubsub_pb2.PullMessagesRequest]:
        for i in range(3):
            pulled.append(i)
            yield pubsub_pb2.PullMessagesRequest(ack_message_id=f"0-{i + 1}")

    try:
        sub.stop()
        await asyncio.wait_for(_pump_acks(requests(), sub), 5)
        assert pulled == [0]
    finally:
        await sub.close()
        await client.aclose()


# --- huge and out-of-range values still come back as INVALID_ARGUMENT --------------


async def _refused(call: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value.code(), err.value.details() or ""


@pytest.mark.parametrize("key", ["scheduledSendDelay", "scheduledSendTime", "scheduleId"])
async def test_a_16kb_bad_publish_value_is_invalid_argument_with_the_value_cut(
    component: Factory, props: dict[str, str], redis_client: redis.Redis, key: str
) -> None:
    c = component("delayed")
    await c.init({**props, "enableDelayedMessaging": "true"})
    before = sorted(redis_client.scan_iter())  # what Init itself creates (the outbox)
    value = "9" * 16 * 1024 + "x"
    metadata = {"scheduledSendDelay": "1s"} if key == "scheduleId" else {}
    code, details = await _refused(c.publish("orders", b"x", {**metadata, key: value}))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert key in details
    assert f"...({len(value)} bytes)" in details
    assert len(details) < 2100
    assert sorted(redis_client.scan_iter()) == before  # nothing stored


async def test_a_16kb_bad_init_value_is_invalid_argument_with_the_value_cut(
    component: Factory, props: dict[str, str]
) -> None:
    code, details = await _refused(component("delayed").init({**props, "queueDepth": "7" * 16_384}))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "queueDepth" in details
    assert "...(16384 bytes)" in details


async def test_a_16kb_topic_gets_a_short_status(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init(props)
    topic = "t" * 16 * 1024
    redis_client.set(topic, "not a stream")
    code, details = await _refused(c.publish(topic, b"x"))
    # The real code arrives (not RESOURCE_EXHAUSTED from an oversized trailer), the topic cut.
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"...({len(topic)} bytes)" in details
    assert len(details) <= 2048 + 30
    assert redis_client.get(topic) == b"not a stream"


async def test_a_topic_whose_key_is_not_a_stream_gets_failed_precondition_naming_it(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init(props)
    topic = "t" * 1000
    redis_client.set(topic, "not a stream")  # XADD fails WRONGTYPE
    code, details = await _refused(c.publish(topic, b"x"))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert topic in details
    assert len(details) <= 2048 + 30


@pytest.mark.parametrize(
    ("key", "value"),
    [("maxLenApprox", str(2**63)), ("processingTimeout", str(2**63)), ("redeliverInterval", "-1")],
)
async def test_init_refuses_out_of_range_numbers_and_connects_to_nothing(
    component: Factory, props: dict[str, str], redis_client: redis.Redis, key: str, value: str
) -> None:
    before = len(redis_client.client_list())
    code, details = await _refused(component("delayed").init({**props, key: value}))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert key in details
    assert value in details
    assert len(redis_client.client_list()) == before


async def test_the_largest_accepted_numbers_work_end_to_end(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    go_max_ms = str((2**63 - 1) // 1_000_000)
    c = component("delayed")
    await c.init(
        {
            **props,
            "maxLenApprox": str(2**63 - 1),
            "processingTimeout": go_max_ms,
            "redeliverInterval": go_max_ms,
            "readTimeout": go_max_ms,
            "dialTimeout": go_max_ms,
            "enableDelayedMessaging": "true",
            "maxDelay": "2562047h",
        }
    )
    stream = await c.subscribe("orders")
    await c.publish("orders", b"now")
    await c.publish("orders", b"soon", {"scheduledSendDelay": "100ms"})
    got = []
    for _ in range(2):
        msg = await stream.next(within=10)
        got.append(msg.data)
        await stream.ack(msg.id)
    assert sorted(got) == [b"now", b"soon"]


async def test_metadata_with_a_lone_surrogate_escape_is_delivered_with_the_rest(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    # JSON may escape a lone surrogate ("\ud800"), which no UTF-8 string holds: read as it is,
    # the message could not be sent, and the stream failed, over again each time the entry
    # was reclaimed (never delivered). It goes out with U+FFFD in its place, as pubsub.redis
    # (Go's JSON) reads it, and the messages behind it follow.
    c = component("delayed")
    await c.init(props)
    stream = await c.subscribe("orders")
    redis_client.xadd("orders", {"data": b"odd", "metadata": b'{"k":"a\\ud800b","\\udfff":"v","ok":"\\ud83d\\ude00"}'})
    await c.publish("orders", b"next", {"k": "v"})
    got = []
    for _ in range(2):
        msg = await stream.next()
        got.append((msg.data, dict(msg.metadata)))
        await stream.ack(msg.id)
    assert got == [
        (b"odd", {"k": "a\ufffdb", "\ufffd": "v", "ok": "\U0001f600", "deliveryAttempt": "1"}),
        (b"next", {"k": "v", "deliveryAttempt": "1"}),
    ]
    await wait_until(lambda: redis_client.xpending("orders", "app1")["pending"] == 0)
