"""Prometheus metrics: what an operator's dashboard reads, from real traffic."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import redis

from delayed_pubsub.server import ComponentServer
from tests.components.driver import Component
from tests.components.serve import start_serve, terminate, wait_for_socket
from tests.redis_server import free_port
from tests.waiting import wait_until


def sample(server: ComponentServer, name: str, **labels: str) -> float:
    value = server.metrics.registry.get_sample_value(name, {"instance": "delayed", **labels})
    return 0.0 if value is None else value


async def test_counters_follow_publish_fire_deliver_ack_nack(
    server: ComponentServer, component: Callable[[str], Component], props: dict[str, str]
) -> None:
    c = component("delayed")
    await c.init({**props, "enableDelayedMessaging": "true"})
    stream = await c.subscribe("orders")
    await c.publish("orders", b"now")
    for i in range(3):
        await c.publish("orders", f"later {i}".encode(), {"scheduledSendDelay": "300ms"})
    await c.publish("orders", b"much later", {"scheduledSendDelay": "1h"})
    assert sample(server, "delayed_pubsub_published_messages_total", mode="immediate") == 1
    assert sample(server, "delayed_pubsub_published_messages_total", mode="delayed") == 4

    first = await stream.next()
    await stream.nack(first.id)  # comes back after redeliverInterval
    for _ in range(4):
        await stream.ack((await stream.next()).id)
    assert sample(server, "delayed_pubsub_fired_messages_total") == 3
    assert sample(server, "delayed_pubsub_pending_messages") == 1
    assert sample(server, "delayed_pubsub_fire_lateness_seconds_count") >= 1
    # Fired on time: every batch's latest message within a second of due.
    assert sample(server, "delayed_pubsub_fire_lateness_seconds_bucket", le="1.0") == sample(
        server, "delayed_pubsub_fire_lateness_seconds_count"
    )
    assert sample(server, "delayed_pubsub_delivered_messages_total") == 5  # 4 messages, one twice
    assert sample(server, "delayed_pubsub_nacked_messages_total") == 1
    # Acks travel on the stream: the last one lands a moment after it is sent.
    deadline = time.monotonic() + 5
    while sample(server, "delayed_pubsub_acked_messages_total") < 4:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    assert sample(server, "delayed_pubsub_acked_messages_total") == 4


async def test_a_pending_message_deleted_outside_the_engine_is_counted_lost_once(
    server: ComponentServer,
    component: Callable[[str], Component],
    props: dict[str, str],
    redis_client: redis.Redis,
) -> None:
    c = component("delayed")
    await c.init({**props, "enableDelayedMessaging": "true"})
    for i in range(2):
        await c.publish("orders", f"later {i}".encode(), {"scheduledSendDelay": "300ms"})
    first_envelope = redis_client.xrange("app1-delayed", count=1)[0][0]  # type: ignore[index]
    redis_client.xdel("app1-delayed", first_envelope)  # type: ignore[arg-type]
    await wait_until(lambda: redis_client.xlen("orders") == 1, "the other message fired")
    await wait_until(lambda: sample(server, "delayed_pubsub_lost_messages_total") == 1, "the loss counted")
    await asyncio.sleep(0.5)  # later fire steps find nothing more to report
    assert sample(server, "delayed_pubsub_lost_messages_total") == 1
    assert sample(server, "delayed_pubsub_pending_messages") == 0


def test_serve_exposes_metrics_on_loopback() -> None:
    port = free_port()
    path = Path(f"/tmp/dps-metrics-{port}.sock")
    proc = start_serve("--socket", str(path), "--metrics-port", str(port))
    try:
        wait_for_socket(proc, path)
        body = ""
        deadline = time.monotonic() + 10
        while "delayed_pubsub_published_messages" not in body:
            assert time.monotonic() < deadline, body[:500]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    body = r.read().decode()
            except OSError:
                time.sleep(0.1)
        assert "# TYPE delayed_pubsub_fire_lateness_seconds histogram" in body
    finally:
        assert terminate(proc) == 0
