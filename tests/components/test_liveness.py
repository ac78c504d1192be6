"""A dead fire loop is loud (ERROR, metrics, health NOT_SERVING) and comes back; a real stop is prompt.

The component runs in-process with a fast health check, on a Redis of the
test's own (one test freezes it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from delayed_middleware.clock import SystemClock
from delayed_pubsub.server import ComponentServer
from tests.components.driver import Component
from tests.redis_server import RedisServer

Factory = Callable[[str], Component]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
async def server(socket_path: Path) -> AsyncIterator[ComponentServer]:
    """The shared fixture's server, with a fast health check."""
    srv = ComponentServer(socket_path, SystemClock(), health_interval=0.2)
    await srv.start()
    yield srv
    await srv.stop(grace=1)


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    if server.proc is not None:
        server.proc.send_signal(signal.SIGCONT)  # in case the test left it frozen
    server.stop(kill=True)


def props(r: RedisServer) -> dict[str, str]:
    return {"redisHost": r.address, "consumerID": "app1", "enableDelayedMessaging": "true"}


async def health_becomes(channel: grpc.aio.Channel, want: int, within_s: float = 15) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + within_s
    while True:
        reply = await stub.Check(health_pb2.HealthCheckRequest(service="dapr.proto.components.v1.PubSub"))
        if reply.status == want:
            return
        assert time.monotonic() < deadline, f"health stayed {reply.status}, not {want}"
        await asyncio.sleep(0.05)


def sample(server: ComponentServer, name: str, labels: dict[str, str]) -> float | None:
    value: float | None = server.metrics.registry.get_sample_value(name, labels)
    return value


async def test_a_fire_loop_that_keeps_ending_is_not_serving_and_comes_back_when_it_can(
    server: ComponentServer,
    channel: grpc.aio.Channel,
    component: Factory,
    own_redis: RedisServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    c = component("delayed")
    await c.init(props(own_redis))
    stream = await c.subscribe("orders")
    await health_becomes(channel, SERVING)
    engine = server.instances.get("delayed").engine
    assert engine is not None
    # The fire loop's own fire step (the part it calls, not the engine's facade).
    firer = engine.engines[0].parts.firer
    real_fire_due = firer.fire_due

    async def stray_cancellation() -> tuple[int, int | None]:
        # What a request left on the task by a library looks like to the loop.
        raise asyncio.CancelledError

    firer.fire_due = stray_cancellation  # type: ignore[method-assign]
    await c.publish("orders", json.dumps({"n": 1}).encode(), {"scheduledSendDelay": "200ms"})
    await health_becomes(channel, NOT_SERVING)
    labels = {"instance": "delayed", "shard": "0"}
    assert sample(server, "delayed_pubsub_fire_loop_up", labels) == 0.0
    assert (sample(server, "delayed_pubsub_fire_loop_restarts_total", labels) or 0) >= 1
    assert any(
        "fire loop of app1-delayed ended unexpectedly" in r.getMessage()
        for r in caplog.records
        if r.levelno == logging.ERROR
    )

    firer.fire_due = real_fire_due  # type: ignore[method-assign]
    # Restarted (its backoff is capped at 5 s), it fires what waited meanwhile.
    msg = await stream.next(within=15)
    assert json.loads(msg.data) == {"n": 1}
    await health_becomes(channel, SERVING)
    assert sample(server, "delayed_pubsub_fire_loop_up", labels) == 1.0


async def test_a_subscription_loop_that_keeps_ending_is_not_serving_then_delivers_again(
    server: ComponentServer, channel: grpc.aio.Channel, component: Factory, own_redis: RedisServer
) -> None:
    c = component("delayed")
    await c.init(props(own_redis))
    stream = await c.subscribe("orders")
    await health_becomes(channel, SERVING)
    instance = server.instances.get("delayed")
    for _ in range(500):  # the stream's subscription is made as its first request is read
        if instance._subscriptions and next(iter(instance._subscriptions))._fetcher is not None:
            break
        await asyncio.sleep(0.01)
    [sub] = instance._subscriptions
    fetch = sub._fetcher
    assert fetch is not None
    for _ in range(500):
        if fetch.current_run is not None:
            break
        await asyncio.sleep(0.01)
    real_body = fetch._body

    async def failing(stop: asyncio.Event) -> None:
        raise ConnectionResetError("a bug in the fetch path")

    fetch._body = failing
    assert fetch.current_run is not None
    fetch.current_run.cancel()  # end the running one: the restarts run the failing body
    await health_becomes(channel, NOT_SERVING)
    labels = {"instance": "delayed", "loop": "fetch"}
    assert (sample(server, "delayed_pubsub_loop_restarts_total", labels) or 0) >= 2
    assert sample(server, "delayed_pubsub_loops_down", labels) == 1.0

    fetch._body = real_body
    await c.publish("orders", b"after")
    msg = await stream.next(within=15)
    assert msg.data == b"after"
    await health_becomes(channel, SERVING)
    assert sample(server, "delayed_pubsub_loops_down", labels) == 0.0


async def test_close_is_prompt_while_every_loop_is_stuck_in_a_redis_call(
    server: ComponentServer, component: Factory, own_redis: RedisServer
) -> None:
    """A real stop ends every loop by its flag, even when the cancellation lands
    inside a Redis call that never returns (the server is frozen)."""
    c = component("delayed")
    await c.init({**props(own_redis), "maxDeliveryAttempts": "3", "readTimeout": "0"})
    await c.subscribe("orders")
    await c.publish("orders", b"x", {"scheduledSendDelay": "1h"})
    await asyncio.sleep(0.5)  # every loop is in its read or its sleep
    instance = server.instances.get("delayed")
    assert own_redis.proc is not None
    own_redis.proc.send_signal(signal.SIGSTOP)
    try:
        await asyncio.sleep(1.5)  # every loop's next call is now stuck in Redis
        started = time.monotonic()
        await asyncio.wait_for(instance.close(), 30)
        took = time.monotonic() - started
    finally:
        own_redis.proc.send_signal(signal.SIGCONT)
    assert took < 6.0, f"close took {took:.1f}s"
