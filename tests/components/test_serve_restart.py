"""`delayed-pubsub serve` killed with SIGKILL and started again, as an OOM kill or a
container restart does it: the new process serves daprd's next call from the Init
record, and tells about the subscription stream that died (log, metric, health)."""

from __future__ import annotations

import asyncio
import json
import re
import stat
import time
import urllib.request
from pathlib import Path

import grpc
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from delayed_pubsub.records import records_folder
from delayed_pubsub.server import SUBSCRIPTIONS_HEALTH_SERVICE
from tests.components.driver import Component
from tests.components.serve import start_serve, terminate, wait_for_socket
from tests.redis_server import RedisServer, free_port


def orphan_gauge(port: int) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        body = r.read().decode()
    m = re.search(r'^delayed_pubsub_orphaned_subscriptions\{instance="delayed"\} (\S+)$', body, re.M)
    return float(m.group(1)) if m else None


async def test_sigkill_then_restart_serves_publish_and_reports_the_orphaned_stream(
    folder: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    path = folder / "delayed-pubsub.sock"
    record = records_folder(path) / "delayed.json"
    props = {"redisHost": f"127.0.0.1:{redis_server.port}", "consumerID": "app1"}
    first = start_serve("--socket", str(path))
    try:
        wait_for_socket(first, path)
        async with grpc.aio.insecure_channel(f"unix://{path}") as channel:
            c = Component(channel, "delayed")
            await c.init({**props, "enableDelayedMessaging": "true"})
            await c.subscribe("orders")
            deadline = time.monotonic() + 10
            while json.loads(record.read_bytes())["topics"] != ["orders"]:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            assert stat.S_IMODE(record.stat().st_mode) == 0o600
    finally:
        first.kill()
        first.wait(10)

    metrics_port = free_port()
    second = start_serve("--socket", str(path), "--metrics-port", str(metrics_port))
    try:
        wait_for_socket(second, path)  # replaced the stale socket SIGKILL left
        async with grpc.aio.insecure_channel(f"unix://{path}") as channel:
            c = Component(channel, "delayed")
            # daprd's next calls, with no Init: they succeed.
            await c.publish("orders", b"plain")
            await c.publish("orders", b"delayed", {"scheduledSendDelay": "200ms"})
            health = health_pb2_grpc.HealthStub(channel)
            subs = await health.Check(health_pb2.HealthCheckRequest(service=SUBSCRIPTIONS_HEALTH_SERVICE))
            deadline = time.monotonic() + 5
            while subs.status != health_pb2.HealthCheckResponse.NOT_SERVING:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
                subs = await health.Check(health_pb2.HealthCheckRequest(service=SUBSCRIPTIONS_HEALTH_SERVICE))
            overall = await health.Check(health_pb2.HealthCheckRequest(service=""))
            assert overall.status == health_pb2.HealthCheckResponse.SERVING
            assert orphan_gauge(metrics_port) == 1.0
        deadline = time.monotonic() + 5
        while redis_client.xlen("orders") < 2:  # the delayed one fired
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
    finally:
        assert terminate(second) == 0
    out = second.stdout.read().decode() if second.stdout else ""
    told = [line for line in out.splitlines() if " ERROR " in line and "daprd never re-opens" in line]
    assert len(told) == 1, out
    assert "'orders'" in told[0]
    assert "re-initialized from its Init record" in out
