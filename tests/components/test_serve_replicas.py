"""Delayed messages across real `delayed-pubsub serve` processes: racing replicas, kill -9.

Each process is driven over its own unix socket the way daprd drives it; they
share one Redis, as replicas of one app do.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
import redis

from delayed_middleware.entry import decode_entry
from delayed_middleware.instants import format_instant
from delayed_pubsub_pb.dapr.proto.components.v1 import pubsub_pb2
from tests.components.driver import Component
from tests.redis_server import RedisServer, stream_entries

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture
def folder() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="dps-") as d:  # short: socket paths max 107 bytes
        yield Path(d)


class Serve:
    """One `delayed-pubsub serve` process with its log in a file."""

    def __init__(self, folder: Path, name: str) -> None:
        self.socket = folder / f"{name}.sock"
        self.log = folder / f"{name}.log"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("proto", "middleware", "components")),
        }
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "delayed_pubsub", "serve", "--socket", str(self.socket)],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 15
        while not self._listening():
            assert self.proc.poll() is None, f"serve exited: {self.log.read_text()}"
            assert time.monotonic() < deadline, f"{self.socket} never appeared"
            time.sleep(0.05)

    def _listening(self) -> bool:
        if not (self.socket.exists() and stat.S_ISSOCK(self.socket.stat().st_mode)):
            return False
        with socket.socket(socket.AF_UNIX) as s:
            try:
                s.connect(str(self.socket))
            except OSError:
                return False
        return True

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@asynccontextmanager
async def instance(serve: Serve, props: dict[str, str]) -> AsyncIterator[Component]:
    async with grpc.aio.insecure_channel(f"unix://{serve.socket}") as ch:
        c = Component(ch, "delayed")
        await c.init(props)
        yield c


def delayed_entries(n: int, first_due: int, spread_ms: int) -> list[pubsub_pb2.BulkMessageEntry]:
    """n messages, each its own envelope, due evenly over [first_due, first_due + spread_ms)."""
    return [
        pubsub_pb2.BulkMessageEntry(
            entry_id=str(i),
            event=json.dumps({"n": i}).encode(),
            metadata={"scheduledSendTime": format_instant(first_due + i * spread_ms // n)},
        )
        for i in range(n)
    ]


async def wait_for_len(client: redis.Redis, key: str, n: int, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while client.xlen(key) < n:
        assert time.monotonic() < deadline, f"{key}: {client.xlen(key)} of {n} after {within_s}s"
        await asyncio.sleep(0.05)


def delivered(client: redis.Redis, topic: str) -> list[int]:
    return [json.loads(decode_entry(f).data)["n"] for _, f in stream_entries(client, topic)]


def props_for(redis_server: RedisServer) -> dict[str, str]:
    return {
        "redisHost": f"127.0.0.1:{redis_server.port}",
        "consumerID": "app1",
        "enableDelayedMessaging": "true",
    }


def now_ms() -> int:
    return time.time_ns() // 1_000_000


async def test_two_replicas_fire_10k_each_exactly_once(
    folder: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    a, b = Serve(folder, "a"), Serve(folder, "b")
    try:
        props = props_for(redis_server)
        async with instance(a, props) as ca, instance(b, props):
            reply = await ca.bulk_publish("orders", delayed_entries(10_000, now_ms() + 8000, 1000))
            assert list(reply.failed_entries) == []
            assert int(redis_client.get("{app1-delayed}:pending") or 0) == 10_000
            await wait_for_len(redis_client, "orders", 10_000, within_s=45)
            await asyncio.sleep(1.0)  # a duplicate would land now, if ever
            assert sorted(delivered(redis_client, "orders")) == list(range(10_000))
            assert int(redis_client.get("{app1-delayed}:pending") or 0) == 0
            assert redis_client.xlen("app1-delayed") == 0
    finally:
        a.stop()
        b.stop()


async def test_kill_9_while_firing_loses_and_duplicates_nothing(
    folder: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    n = 5000
    a = Serve(folder, "a")
    try:
        props = props_for(redis_server)
        async with instance(a, props) as ca:
            reply = await ca.bulk_publish("orders", delayed_entries(n, now_ms() + 800, 3000))
            assert list(reply.failed_entries) == []
            await wait_for_len(redis_client, "orders", 500, within_s=10)  # firing is under way
            a.kill9()
        fired_before_kill = redis_client.xlen("orders")
        assert 0 < fired_before_kill < n, "the kill must land while messages are still pending"
        await asyncio.sleep(3.5)  # everything left is overdue while no replica runs
        assert redis_client.xlen("orders") == fired_before_kill

        b = Serve(folder, "b")
        try:
            async with instance(b, props):
                await wait_for_len(redis_client, "orders", n, within_s=20)
                await asyncio.sleep(1.0)
        finally:
            b.stop()
        assert sorted(delivered(redis_client, "orders")) == list(range(n))
        assert int(redis_client.get("{app1-delayed}:pending") or 0) == 0
    finally:
        a.stop()
