"""grpc.health.v1 follows Redis: NOT_SERVING while an instance's Redis is unreachable.

The server's periodic check (server.ComponentServer.check_health) PINGs each
instance; here every 0.2 s instead of 5 s, so the test does not wait on it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from delayed_middleware.clock import SystemClock
from delayed_pubsub.server import ComponentServer
from tests.components.driver import Component
from tests.redis_server import RedisServer

Factory = Callable[[str], Component]


@pytest.fixture
async def server(socket_path: Path) -> AsyncIterator[ComponentServer]:
    """The shared fixture's server, with a fast health check."""
    srv = ComponentServer(socket_path, SystemClock(), health_interval=0.2)
    await srv.start()
    yield srv
    await srv.stop(grace=1)


async def test_health_is_not_serving_while_redis_is_down(
    server: ComponentServer, channel: grpc.aio.Channel, component: Factory, tmp_path: Path
) -> None:
    # Its own Redis, so stopping it disturbs no other test.
    own = RedisServer(tmp_path / "redis")
    own.start()
    try:
        c = component("delayed")
        await c.init({"redisHost": own.address, "consumerID": "app1", "dialTimeout": "200ms"})
        stub = health_pb2_grpc.HealthStub(channel)

        async def status_becomes(want: int) -> None:
            deadline = time.monotonic() + 10
            while True:
                for service in ("", "dapr.proto.components.v1.PubSub"):
                    reply = await stub.Check(health_pb2.HealthCheckRequest(service=service))
                    if reply.status != want:
                        break
                else:
                    return
                assert time.monotonic() < deadline, f"health stayed {reply.status}"
                await asyncio.sleep(0.1)

        await status_becomes(health_pb2.HealthCheckResponse.SERVING)
        own.stop()
        await status_becomes(health_pb2.HealthCheckResponse.NOT_SERVING)
        assert server.metrics.registry.get_sample_value(
            "delayed_pubsub_redis_errors_total", {"instance": "delayed"}
        )
        own.start()
        await status_becomes(health_pb2.HealthCheckResponse.SERVING)
    finally:
        own.stop()
