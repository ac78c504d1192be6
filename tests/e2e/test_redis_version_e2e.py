"""What a user sees when the component meets a Redis older than 6.2: daprd fails to start, saying why.

No such Redis is at hand: the component reaches the real one through a proxy that changes only the
`redis_version` INFO reports (tests/chaos/proxy.py), so everything else daprd and the component do is real.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chaos.proxy import VersionProxy
from tests.e2e import harness
from tests.redis_server import RedisServer, free_port

pytestmark = pytest.mark.e2e


@pytest.fixture
def old_redis(e2e_redis: RedisServer) -> Iterator[tuple[VersionProxy, str]]:
    """A proxy to the e2e Redis that reports version 6.0.x, served from a thread of its own."""
    real = str(e2e_redis.client().info("server")["redis_version"])
    shown = "6.0." + "9" * (len(real) - 4)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="version-proxy", daemon=True)
    thread.start()
    proxy = VersionProxy(e2e_redis.port, real, shown)
    asyncio.run_coroutine_threadsafe(proxy.start(), loop).result(10)
    try:
        yield proxy, shown
    finally:
        asyncio.run_coroutine_threadsafe(proxy.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_daprd_fails_to_start_naming_the_old_redis_and_the_version_needed(
    daprd_path: str, old_redis: tuple[VersionProxy, str], tmp_path: Path
) -> None:
    proxy, shown = old_redis
    socket_dir, resources = tmp_path / "sockets", tmp_path / "resources"
    resources.mkdir()
    (resources / "old.yaml").write_text(
        harness.component_yaml("old", harness.component_metadata(proxy.port, consumerID="old-app"))
    )
    component = harness.start_component(tmp_path, socket_dir)
    daprd = harness.ManagedProcess(
        "daprd",
        harness.daprd_args(daprd_path, "old-app", free_port(), resources, harness.DaprdPorts.free()),
        tmp_path / "daprd.log",
        env={
            "DAPR_COMPONENTS_SOCKETS_FOLDER": str(socket_dir),
            "HOME": str(tmp_path),
            "PATH": "/usr/bin:/bin",
        },
        cwd=tmp_path,
    ).start()
    try:
        harness.wait_until_blocking(
            lambda: not daprd.alive(), "daprd to give up on the component", 60, process=daprd
        )
        log = daprd.log_path.read_text(errors="replace")
        assert daprd.proc is not None
        assert daprd.proc.returncode != 0
        # daprd 1.18: "Failed to init component old (pubsub.delayed-pubsub/v1): ... rpc error:
        # code = FailedPrecondition desc = redis at ... is version 6.0.99; this component needs ..."
        assert "Failed to init component old (pubsub.delayed-pubsub/v1)" in log, daprd.log_tail()
        assert "code = FailedPrecondition" in log
        assert f"is version {shown}; this component needs Redis 6.2 or later" in log
        assert proxy.rewritten >= 1
        assert component.alive()  # the component refused one Init; it serves on
    finally:
        daprd.stop()
        component.stop()
