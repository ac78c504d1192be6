"""`serve --health-port`: HTTP /healthz and /readyz, the probes Kubernetes can reach, answer what
grpc.health.v1 answers: readiness fails while Redis is down or subscriptions are orphaned, and
comes back by itself; liveness fails only when the component does not answer."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from delayed_middleware.clock import SystemClock
from delayed_pubsub.health_http import HealthHttpServer
from delayed_pubsub.records import records_folder
from delayed_pubsub.server import SUBSCRIPTIONS_HEALTH_SERVICE, ComponentServer
from tests.components.driver import Component
from tests.components.serve import wait_for_socket
from tests.redis_server import RedisServer, free_port

ROOT = Path(__file__).resolve().parents[2]


def get(port: int, path: str) -> tuple[int, dict[str, Any]]:
    """A kubelet-like probe: GET, status code and JSON body (connection errors raise)."""
    reply = httpx.get(f"http://127.0.0.1:{port}{path}", timeout=5)
    return reply.status_code, reply.json()


async def probe_becomes(port: int, path: str, code: int, within: float = 15.0) -> dict[str, Any]:
    """Poll `path` (from a thread: the component answers on this test's event loop) until it answers `code`."""
    deadline = time.monotonic() + within
    while True:
        got, body = await asyncio.to_thread(get, port, path)
        if got == code:
            return body
        assert time.monotonic() < deadline, f"{path} stayed {got} {body}, wanted {code}"
        await asyncio.sleep(0.1)


def serve_cli(sock: Path, *args: str) -> subprocess.Popen[bytes]:
    """`delayed-pubsub serve --socket sock ARGS`, as a container entry point runs it."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("proto", "middleware", "components")),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "delayed_pubsub", "serve", "--socket", str(sock), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


async def test_readiness_fails_while_redis_is_down_and_returns_with_it(
    socket_path: Path, tmp_path: Path
) -> None:
    own = RedisServer(tmp_path / "redis")  # its own Redis: stopping it disturbs no other test
    own.start()
    server = ComponentServer(socket_path, SystemClock(), health_interval=0.2)
    await server.start()
    front = HealthHttpServer(socket_path, 0)
    front.start()
    try:
        async with grpc.aio.insecure_channel(f"unix://{socket_path}") as channel:
            c = Component(channel, "delayed")
            await c.init({"redisHost": own.address, "consumerID": "app1", "dialTimeout": "200ms"})
            body = await probe_becomes(front.port, "/readyz", 200)
            assert body["services"] == {"": "SERVING", SUBSCRIPTIONS_HEALTH_SERVICE: "SERVING"}

            own.stop()
            body = await probe_becomes(front.port, "/readyz", 503)
            assert body["services"][""] == "NOT_SERVING"
            # Restarting the container would not bring Redis back: liveness holds.
            assert await asyncio.to_thread(get, front.port, "/healthz") == (
                200,
                {"status": "ok", "services": {"": "NOT_SERVING"}},
            )

            own.start()
            body = await probe_becomes(front.port, "/readyz", 200)
            assert body["services"][""] == "SERVING"
    finally:
        front.stop()
        await server.stop(grace=1)
        own.stop()


async def test_liveness_fails_when_no_component_answers_on_the_socket(socket_path: Path) -> None:
    front = HealthHttpServer(socket_path, 0, timeout=0.5)
    front.start()
    try:
        code, body = await asyncio.to_thread(get, front.port, "/healthz")
        assert code == 503
        assert "does not answer" in body["error"]
        assert (await asyncio.to_thread(get, front.port, "/readyz"))[0] == 503
        assert (await asyncio.to_thread(get, front.port, "/metrics"))[0] == 404

        server = ComponentServer(socket_path, SystemClock())
        await server.start()
        try:
            # No instance yet: nothing is down, so live and ready.
            await probe_becomes(front.port, "/healthz", 200)
            await probe_becomes(front.port, "/readyz", 200)
        finally:
            await server.stop(grace=1)
        # Stopping: gone from the socket, so no longer live.
        await probe_becomes(front.port, "/healthz", 503)
    finally:
        front.stop()


async def test_liveness_fails_while_the_components_event_loop_is_stalled(socket_path: Path) -> None:
    server = ComponentServer(socket_path, SystemClock())
    await server.start()
    front = HealthHttpServer(socket_path, 0, timeout=0.5)
    front.start()
    try:
        await probe_becomes(front.port, "/healthz", 200)
        loop = asyncio.get_running_loop()
        probe = loop.run_in_executor(None, get, front.port, "/healthz")
        time.sleep(2)  # noqa: ASYNC251 -- the stall itself: the component's loop (this test's) is blocked
        code, body = await probe
        assert code == 503
        assert "DEADLINE_EXCEEDED" in body["error"]
        await probe_becomes(front.port, "/healthz", 200)  # and live again once the loop runs
    finally:
        front.stop()
        await server.stop(grace=1)


async def test_idle_connections_do_not_keep_the_probes_from_an_answer(socket_path: Path) -> None:
    server = ComponentServer(socket_path, SystemClock())
    await server.start()
    front = HealthHttpServer(socket_path, 0)
    front.start()
    idle = [socket.create_connection(("127.0.0.1", front.port)) for _ in range(20)]
    try:
        # Twenty clients connected and silent: a probe is still answered.
        await probe_becomes(front.port, "/readyz", 200, within=5)
        # And the silent ones are dropped, not held open for good.
        idle[0].settimeout(15)
        assert await asyncio.to_thread(idle[0].recv, 1) == b""
    finally:
        for s in idle:
            s.close()
        front.stop()
        await server.stop(grace=1)


async def test_serve_health_port_readiness_fails_for_subscriptions_orphaned_by_a_restart(
    socket_path: Path, redis_server: RedisServer, redis_client: object
) -> None:
    sock = socket_path
    props = {"redisHost": redis_server.address, "consumerID": "app1"}
    first = serve_cli(sock)
    try:
        wait_for_socket(first, sock)
        async with grpc.aio.insecure_channel(f"unix://{sock}") as channel:
            c = Component(channel, "delayed")
            await c.init(props)
            await c.subscribe("orders")
            record = records_folder(sock) / "delayed.json"
            deadline = time.monotonic() + 10
            while not record.exists() or json.loads(record.read_bytes())["topics"] != ["orders"]:
                assert time.monotonic() < deadline, "the open stream was never recorded"
                await asyncio.sleep(0.02)
    finally:
        first.kill()  # an OOM kill: daprd's stream dies with it and daprd never re-opens it
        first.wait(10)

    port = free_port()
    second = serve_cli(sock, "--health-port", str(port))
    try:
        wait_for_socket(second, sock)
        async with grpc.aio.insecure_channel(f"unix://{sock}") as channel:
            # daprd's next call (a publish) re-Inits the instance from its record.
            await Component(channel, "delayed").publish("orders", b"y")
            body = await probe_becomes(port, "/readyz", 503)
            assert body["services"][SUBSCRIPTIONS_HEALTH_SERVICE] == "NOT_SERVING"
            assert body["services"][""] == "SERVING"
            # A container restart would report the same orphans: liveness holds.
            assert (await asyncio.to_thread(get, port, "/healthz"))[0] == 200

        second.send_signal(signal.SIGTERM)
        assert second.wait(15) == 0
        with pytest.raises(httpx.ConnectError):
            get(port, "/healthz")  # the listener closed with the process
    finally:
        if second.poll() is None:
            second.kill()
            second.wait(10)


def test_serve_refuses_a_health_port_already_taken(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = serve_cli(tmp_path / "s.sock", "--health-port", str(port))
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port} (--health-port)" in out.decode()


@pytest.mark.parametrize("value", ["70000", "0", "http"])
def test_serve_refuses_a_health_port_that_is_no_port(tmp_path: Path, value: str) -> None:
    proc = serve_cli(tmp_path / "s.sock", "--health-port", value)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert "argument --health-port: " in out.decode()
    assert value in out.decode()
    assert not (tmp_path / "s.sock").exists()
