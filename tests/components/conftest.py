"""A component server on a unix socket and a daprd-like driver for it."""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import grpc
import pytest

from delayed_middleware.clock import SystemClock
from delayed_pubsub.server import ComponentServer
from tests.components.driver import Component
from tests.redis_server import RedisServer

# Small timeouts keep redelivery tests fast; values a user could set.
FAST = {"processingTimeout": "500ms", "redeliverInterval": "200ms"}


@pytest.fixture
def socket_path(tmp_path: Path) -> Iterator[Path]:
    """A socket path in tmp_path, or in a short temp dir when tmp_path would
    exceed the 107-byte limit on unix socket paths."""
    path = tmp_path / "delayed-pubsub.sock"
    if len(str(path)) < 100:
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="dps-") as short:
        yield Path(short) / "delayed-pubsub.sock"


@pytest.fixture
def props(redis_server: RedisServer, redis_client: object) -> dict[str, str]:
    """Init metadata for the test Redis (flushed: redis_client is requested for that)."""
    return {"redisHost": f"127.0.0.1:{redis_server.port}", "consumerID": "app1", **FAST}


@pytest.fixture
async def server(socket_path: Path) -> AsyncIterator[ComponentServer]:
    srv = ComponentServer(socket_path, SystemClock())
    await srv.start()
    yield srv
    await srv.stop(grace=1)


@pytest.fixture
async def channel(server: ComponentServer) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"unix://{server.socket_path}") as ch:
        yield ch


@pytest.fixture
def component(channel: grpc.aio.Channel) -> Callable[[str], Component]:
    """Factory: the component instance `name` on the shared socket."""
    return lambda name: Component(channel, name)
