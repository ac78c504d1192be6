"""A component restarted under a running daprd: re-Init from the record, orphaned
subscriptions told in logs, metrics and health, Redis health, and the draining stop.

Each test plays daprd with the driver over a real unix socket and a real Redis:
one ComponentServer is Init'ed, stopped, and a second one is started on the same
socket, which daprd (here: the driver) calls without Init, as daprd does.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import stat
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import prometheus_client
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from delayed_middleware.clock import SystemClock
from delayed_pubsub.records import InitRecord
from delayed_pubsub.server import PUBSUB_SERVICE, SUBSCRIPTIONS_HEALTH_SERVICE, ComponentServer
from delayed_pubsub_pb.dapr.proto.components.v1 import pubsub_pb2
from tests.components.driver import Component
from tests.redis_server import RedisServer, free_port

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
RESTORED = "re-initialized from its Init record"

Start = Callable[..., Awaitable[ComponentServer]]


@pytest.fixture
async def start(socket_path: Path) -> AsyncIterator[Start]:
    """Starts a ComponentServer on the test's socket (one at a time, as `serve` would)."""
    running: list[ComponentServer] = []

    async def _start(**kwargs: Any) -> ComponentServer:
        srv = ComponentServer(socket_path, SystemClock(), **kwargs)
        await srv.start()
        running.append(srv)
        return srv

    yield _start
    for srv in running:
        await srv.stop(grace=0.5)


async def restart(old: ComponentServer, start: Start, **kwargs: Any) -> ComponentServer:
    await old.stop(grace=1)
    return await start(**kwargs)


def channel_to(srv: ComponentServer) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(f"unix://{srv.socket_path}")


async def health(channel: grpc.aio.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))
    return int(reply.status)


async def eventually(check: Callable[[], Awaitable[bool]], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not await check():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def error_lines(caplog: pytest.LogCaptureFixture, pattern: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.ERROR and re.search(pattern, r.getMessage())
    ]


# --- publishing survives a restart --------------------------------------------


async def test_a_restarted_component_serves_every_call_without_a_new_init(
    start: Start, props: dict[str, str], redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    first = await start()
    async with channel_to(first) as ch:
        await Component(ch, "delayed").init({**props, "enableDelayedMessaging": "true"})
    record = first.records.path_for("delayed")
    assert record.parent == first.socket_path.parent / "delayed-pubsub.records"
    assert stat.S_IMODE(record.stat().st_mode) == 0o600

    second = await restart(first, start)
    caplog.set_level(logging.INFO)
    async with channel_to(second) as ch:
        c = Component(ch, "delayed")
        await c.publish("orders", b"plain")  # daprd calls straight away: no Init
        await c.publish("orders", b"delayed", {"scheduledSendDelay": "300ms"})
        reply = await c.bulk_publish(
            "orders", [pubsub_pb2.BulkMessageEntry(entry_id="1", event=b"bulk", content_type="text/plain")]
        )
        assert list(reply.failed_entries) == []
        assert await c.features() == ["BULK_PUBSUB", "MESSAGE_TTL"]
        await c.ping()
        stream = await c.subscribe("orders")
        got = [(await stream.next()).data for _ in range(3)]
    assert got == [b"plain", b"bulk", b"delayed"]
    assert sum(RESTORED in r.getMessage() for r in caplog.records) == 1


async def test_concurrent_first_calls_restore_once_and_all_succeed(
    start: Start, props: dict[str, str], redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    first = await start()
    async with channel_to(first) as ch:
        await Component(ch, "delayed").init(props)
    second = await restart(first, start)
    caplog.set_level(logging.INFO)
    async with channel_to(second) as ch:
        c = Component(ch, "delayed")
        await asyncio.gather(*(c.publish("orders", f"m{i}".encode()) for i in range(50)))
    assert redis_client.xlen("orders") == 50
    assert sum(RESTORED in r.getMessage() for r in caplog.records) == 1


async def test_a_later_init_from_daprd_replaces_the_record(
    start: Start, props: dict[str, str], redis_client: redis.Redis
) -> None:
    first = await start()
    async with channel_to(first) as ch:
        c = Component(ch, "delayed")
        await c.init(props)
        await c.init({**props, "consumerID": "app2"})
    doc = json.loads(first.records.path_for("delayed").read_bytes())
    assert doc["metadata"]["consumerID"] == "app2"
    second = await restart(first, start)
    async with channel_to(second) as ch:
        stream = await Component(ch, "delayed").subscribe("orders")
        await Component(ch, "delayed").publish("orders", b"x")
        await stream.next()
    groups = [g["name"] for g in redis_client.xinfo_groups("orders")]
    assert groups == [b"app2"]


async def test_without_a_record_a_call_still_says_call_init_first(start: Start) -> None:
    srv = await start()
    async with channel_to(srv) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await Component(ch, "never").publish("orders", b"x")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "call Init first" in (err.value.details() or "")


async def test_a_record_owned_by_another_user_is_refused_and_the_call_says_why(
    start: Start, props: dict[str, str], redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    first = await start()
    async with channel_to(first) as ch:
        await Component(ch, "delayed").init(props)
    os.chown(first.records.path_for("delayed"), 65534, 65534)
    second = await restart(first, start)
    async with channel_to(second) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await Component(ch, "delayed").publish("orders", b"x")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = err.value.details() or ""
    assert "refused" in details
    assert "owned by uid 65534" in details
    assert "restart daprd" in details
    assert error_lines(caplog, "owned by uid 65534")
    assert redis_client.xlen("orders") == 0


async def test_a_record_whose_redis_is_gone_fails_unavailable_naming_it_then_backs_off(
    start: Start, props: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    dead = free_port()
    first = await start()
    first.records.save(
        InitRecord("delayed", {**props, "redisHost": f"127.0.0.1:{dead}", "dialTimeout": "200ms"})
    )
    second = await restart(first, start)
    async with channel_to(second) as ch:
        c = Component(ch, "delayed")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.publish("orders", b"x")
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        details = err.value.details() or ""
        assert "Init record" in details
        assert str(second.records.path_for("delayed")) in details
        assert f"127.0.0.1:{dead}" in details
        # Within the backoff the same answer comes at once, without another connect.
        began = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as again:
            await c.publish("orders", b"y")
        assert again.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - began < 0.15
    assert len(error_lines(caplog, "Init record")) == 1


async def test_a_record_whose_metadata_no_longer_parses_fails_naming_the_key(
    start: Start, props: dict[str, str]
) -> None:
    first = await start()
    first.records.save(InitRecord("delayed", {**props, "processingTimeout": "soon"}))
    second = await restart(first, start)
    async with channel_to(second) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await Component(ch, "delayed").publish("orders", b"x")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "processingTimeout='soon'" in (err.value.details() or "")


# --- orphaned subscriptions ---------------------------------------------------


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        body = r.read().decode()
    found = {}
    for line in body.splitlines():
        m = re.match(r'delayed_pubsub_orphaned_subscriptions\{instance="([^"]*)"\} (\S+)', line)
        if m:
            found[m.group(1)] = float(m.group(2))
    return found


async def test_streams_open_before_a_restart_are_orphaned_until_daprd_reopens_them(
    start: Start, props: dict[str, str], redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    first = await start()
    async with channel_to(first) as ch:
        c = Component(ch, "delayed")
        await c.init(props)
        await c.subscribe("orders")
        await c.subscribe("bulk")
        # The driver returns once it asked; the server records the topic once subscribed.
        await eventually(lambda: _topics_are(first, ["bulk", "orders"]))
        second = await restart(first, start, orphan_grace=60)
    port = free_port()
    httpd, thread = prometheus_client.start_http_server(port, "127.0.0.1", registry=second.metrics.registry)
    try:
        async with channel_to(second) as ch:
            c = Component(ch, "delayed")
            # Suspected only: a daprd that restarted too would Init and re-subscribe now.
            assert await health(ch, SUBSCRIPTIONS_HEALTH_SERVICE) == SERVING
            await c.publish("orders", b"while orphaned")  # daprd alive, no Init: orphaned for sure
            await eventually(lambda: _is(ch, SUBSCRIPTIONS_HEALTH_SERVICE, NOT_SERVING))
            assert await health(ch, "") == SERVING
            assert await health(ch, PUBSUB_SERVICE) == SERVING
            assert scrape(port) == {"delayed": 2.0}
            await c.publish("orders", b"again")
            told = error_lines(caplog, "daprd never re-opens")
            assert len(told) == 2
            assert {"'orders'" in t for t in told} == {True, False}

            stream = await c.subscribe("orders")  # daprd restarted and subscribes again
            await eventually(lambda: _scraped(port, {"delayed": 1.0}))
            assert await health(ch, SUBSCRIPTIONS_HEALTH_SERVICE) == NOT_SERVING
            await c.subscribe("bulk")
            await eventually(lambda: _scraped(port, {"delayed": 0.0}))
            await eventually(lambda: _is(ch, SUBSCRIPTIONS_HEALTH_SERVICE, SERVING))
            # Nothing was lost meanwhile.
            assert {(await stream.next()).data for _ in range(2)} == {b"while orphaned", b"again"}
    finally:
        httpd.shutdown()
        thread.join(5)


async def _scraped(port: int, expected: dict[str, float]) -> bool:
    return scrape(port) == expected


async def _is(ch: grpc.aio.Channel, service: str, status: int) -> bool:
    return await health(ch, service) == status


async def test_suspects_are_orphaned_after_the_grace_even_without_any_call(
    start: Start, props: dict[str, str], redis_client: redis.Redis
) -> None:
    first = await start()
    async with channel_to(first) as ch:
        c = Component(ch, "delayed")
        await c.init(props)
        await c.subscribe("orders")
        await eventually(lambda: _topics_are(first, ["orders"]))
        second = await restart(first, start, orphan_grace=0.3)
    async with channel_to(second) as ch:
        await eventually(lambda: _is(ch, SUBSCRIPTIONS_HEALTH_SERVICE, NOT_SERVING), within=3)
    assert second.instances.orphaned() == {"delayed": frozenset({"orders"})}


async def test_an_init_from_a_restarted_daprd_clears_the_suspects(
    start: Start, props: dict[str, str], redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    first = await start()
    async with channel_to(first) as ch:
        c = Component(ch, "delayed")
        await c.init(props)
        await c.subscribe("orders")
        await eventually(lambda: _topics_are(first, ["orders"]))
        second = await restart(first, start, orphan_grace=0.3)
    async with channel_to(second) as ch:
        await Component(ch, "delayed").init(props)
        await asyncio.sleep(0.6)
        assert await health(ch, SUBSCRIPTIONS_HEALTH_SERVICE) == SERVING
    assert second.instances.orphaned() == {}
    assert not error_lines(caplog, "daprd never re-opens")
    assert json.loads(second.records.path_for("delayed").read_bytes())["topics"] == []


async def test_a_stream_daprd_closed_is_not_orphaned_by_a_restart(
    start: Start, props: dict[str, str], redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    first = await start()
    async with channel_to(first) as ch:
        c = Component(ch, "delayed")
        await c.init(props)
        stream = await c.subscribe("orders")
        await eventually(lambda: _topics_are(first, ["orders"]))
        await stream.close()  # daprd unsubscribed (or shut down) before we restarted
        await eventually(lambda: _topics_are(first, []))
        second = await restart(first, start, orphan_grace=0.2)
    async with channel_to(second) as ch:
        await Component(ch, "delayed").publish("orders", b"x")
        await asyncio.sleep(0.4)
        assert await health(ch, SUBSCRIPTIONS_HEALTH_SERVICE) == SERVING
    assert not error_lines(caplog, "daprd never re-opens")


async def _topics_are(srv: ComponentServer, topics: list[str], name: str = "delayed") -> bool:
    return bool(json.loads(srv.records.path_for(name).read_bytes())["topics"] == topics)


# --- Redis health --------------------------------------------------------------


async def test_health_is_not_serving_while_redis_is_unreachable_and_recovers(
    start: Start, tmp_path: Path
) -> None:
    own = RedisServer(tmp_path / "redis")
    own.start()
    try:
        srv = await start(health_interval=0.1)
        async with channel_to(srv) as ch:
            await Component(ch, "delayed").init(
                {"redisHost": f"127.0.0.1:{own.port}", "consumerID": "app1", "dialTimeout": "200ms"}
            )
            assert await health(ch, "") == SERVING
            own.stop()
            await eventually(lambda: _is(ch, "", NOT_SERVING))
            assert await health(ch, PUBSUB_SERVICE) == NOT_SERVING
            assert await health(ch, SUBSCRIPTIONS_HEALTH_SERVICE) == SERVING
            assert (
                srv.metrics.registry.get_sample_value("delayed_pubsub_redis_up", {"instance": "delayed"}) == 0
            )
            own.start()
            await eventually(lambda: _is(ch, "", SERVING), within=10)
            assert await health(ch, PUBSUB_SERVICE) == SERVING
            assert (
                srv.metrics.registry.get_sample_value("delayed_pubsub_redis_up", {"instance": "delayed"}) == 1
            )
    finally:
        own.stop()


# --- graceful stop ---------------------------------------------------------------


async def test_a_graceful_stop_lets_the_message_in_flight_be_acked_and_serves_publishes_meanwhile(
    start: Start, props: dict[str, str], redis_client: redis.Redis
) -> None:
    srv = await start()
    async with channel_to(srv) as ch:
        c = Component(ch, "delayed")
        await c.init(props)
        stream = await c.subscribe("orders")
        await c.publish("orders", b"in flight")
        msg = await stream.next()
        began = time.monotonic()
        stopping = asyncio.create_task(srv.stop(grace=6))
        await asyncio.sleep(0.3)
        assert not stopping.done()  # waiting for the ack
        await c.publish("orders", b"during the drain")  # still served
        await stream.ack(msg.id)
        await stopping
        took = time.monotonic() - began
        assert await stream.nothing_for(0.1)  # nothing new was sent during the drain
    assert took < 2.5, took
    pending: Any = redis_client.xpending("orders", "app1")
    assert pending["pending"] == 0  # the in-flight message was acked, not left behind
    assert redis_client.xlen("orders") == 2  # the drain-time publish is stored, for the next process


async def test_a_graceful_stop_leaves_a_never_acked_message_pending(
    start: Start, props: dict[str, str], redis_client: redis.Redis
) -> None:
    srv = await start()
    async with channel_to(srv) as ch:
        c = Component(ch, "delayed")
        await c.init(props)
        stream = await c.subscribe("orders")
        await c.publish("orders", b"never acked")
        await stream.next()
        began = time.monotonic()
        await srv.stop(grace=1)
        assert time.monotonic() - began < 2.5
    pending: Any = redis_client.xpending("orders", "app1")
    assert pending["pending"] == 1


async def test_a_component_daprd_no_longer_has_is_dropped_not_orphaned(
    start: Start, props: dict[str, str], redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """daprd restarted without the YAML of `gone`: it Inits `kept` only. `gone`'s recorded
    subscription must not stay orphaned (health NOT_SERVING) forever."""
    first = await start()
    async with channel_to(first) as ch:
        for name in ("kept", "gone"):
            await Component(ch, name).init(props)
            await Component(ch, name).subscribe(f"{name}-orders")
        await eventually(lambda: _topics_are(first, ["gone-orders"], "gone"))
        await eventually(lambda: _topics_are(first, ["kept-orders"], "kept"))
        second = await restart(first, start, orphan_grace=0.3)
    async with channel_to(second) as ch:
        await Component(ch, "kept").init(props)  # the restarted daprd
        await asyncio.sleep(0.8)
        assert await health(ch, SUBSCRIPTIONS_HEALTH_SERVICE) == SERVING
    assert second.instances.orphaned() == {}
    assert not error_lines(caplog, "daprd never re-opens")
    assert await _topics_are(second, [], "gone")  # the next restart will not suspect it either


async def test_a_restore_while_redis_is_down_recovers_once_redis_is_back(
    start: Start, tmp_path: Path
) -> None:
    own = RedisServer(tmp_path / "redis")
    own.start()
    try:
        first = await start()
        props = {"redisHost": f"127.0.0.1:{own.port}", "consumerID": "app1", "dialTimeout": "200ms"}
        async with channel_to(first) as ch:
            await Component(ch, "delayed").init(props)
        second = await restart(first, start)
        own.stop()
        async with channel_to(second) as ch:
            c = Component(ch, "delayed")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.publish("orders", b"x")
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # daprd (or its resiliency) may retry
            own.start()
            await asyncio.sleep(0.6)  # the first backoff step is 0.5 s
            await c.publish("orders", b"after redis came back")
        client = own.client()
        try:
            assert client.xlen("orders") == 1
        finally:
            client.close()
    finally:
        own.stop()


@pytest.mark.parametrize("name", ["../../../tmp/evil", "/etc/passwd", "x" * 300, ""])
async def test_hostile_instance_names_restore_nothing_and_write_nothing(start: Start, name: str) -> None:
    srv = await start()
    async with channel_to(srv) as ch:
        for _ in range(20):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await Component(ch, name).publish("orders", b"x")
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert not srv.records.folder.exists() or list(srv.records.folder.iterdir()) == []
