"""Chaos fixtures: a Redis of the test's own (frozen, killed, restarted at will)
and the component server of tests/components on a unix socket."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.components.conftest import channel, component, server, socket_path  # noqa: F401
from tests.redis_server import RedisServer


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A private redis-server with AOF `appendfsync always`: this test may stop, kill and restart it."""
    redis_server = RedisServer(tmp_path / "redis", extra_args=["--appendfsync", "always"])
    redis_server.start()
    yield redis_server
    if redis_server.proc is not None:
        redis_server.proc.send_signal(signal.SIGCONT)  # in case the test left it frozen
    redis_server.stop(kill=True)


def figure(name: str, value: float, unit: str) -> None:
    """A measured figure, printed for RELIABILITY.md (run with -s to see them)."""
    print(f"FIGURE {name} = {value:.3f} {unit}")
