"""The pending-per-topic gauge: exact per topic, bounded scan, wired into a live instance."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest
import redis
import redis.asyncio as aioredis

import delayed_pubsub.gauges
from delayed_middleware.clock import ManualClock
from delayed_middleware.engine import DelayEngine
from delayed_middleware.envelope import Envelope
from delayed_middleware.keys import EngineKeys, delayed_topic
from delayed_pubsub.gauges import PendingByTopic
from delayed_pubsub.metrics import Metrics
from delayed_pubsub.server import ComponentServer
from tests.components.driver import Component

T0 = 1_800_000_000_000


@pytest.fixture
async def client(redis_client: redis.Redis) -> AsyncIterator[aioredis.Redis]:
    c = aioredis.Redis(port=redis_client.connection_pool.connection_kwargs["port"])
    yield c
    await c.aclose()


async def schedule(client: aioredis.Redis, per_topic: dict[str, int]) -> None:
    engine = DelayEngine(client, EngineKeys.for_topic(delayed_topic("app")), ManualClock(T0))
    envs = [
        Envelope(id="", topic=topic, due_ms=T0 + 60_000 + i, published_at_ms=T0, message=b"x")
        for topic, n in per_topic.items()
        for i in range(n)
    ]
    await engine.schedule(envs)


def series(metrics: Metrics) -> dict[str, float]:
    return {
        s.labels["topic"]: s.value
        for family in metrics.pending_by_topic.collect()
        for s in family.samples
        if s.labels["instance"] == "i"
    }


async def test_exact_counts_top_topics_and_other(client: aioredis.Redis) -> None:
    # 25 topics: the 20 largest get a series each, the 5 smallest one "(other)".
    await schedule(client, {f"t{n:02d}": n + 1 for n in range(25)})
    metrics = Metrics()
    gauge = PendingByTopic(client, "app", metrics.for_instance("i"), ManualClock(T0))
    await gauge.refresh()
    got = series(metrics)
    assert len(got) == 21
    assert got["t24"] == 25
    assert got["t05"] == 6
    assert got["(other)"] == 1 + 2 + 3 + 4 + 5
    assert sum(got.values()) == sum(range(1, 26))


async def test_bounded_scan_reports_the_rest_as_other_and_drops_gone_topics(client: aioredis.Redis) -> None:
    await schedule(client, {"a": 30, "b": 30})
    metrics = Metrics()
    gauge = PendingByTopic(client, "app", metrics.for_instance("i"), ManualClock(T0), max_scan=40)
    await gauge.refresh()
    assert series(metrics) == {"a": 30, "b": 10, "(other)": 20}
    # Everything fires: the series go to nothing (no stale topic left behind).
    engine = DelayEngine(client, EngineKeys.for_topic(delayed_topic("app")), ManualClock(T0 + 10**6))
    while (await engine.fire_due())[0]:
        pass
    await gauge.refresh()
    assert series(metrics) == {}


async def test_a_live_instance_refreshes_the_gauge(
    server: ComponentServer,
    component: Callable[[str], Component],
    props: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(delayed_pubsub.gauges, "REFRESH_S", 0.1)
    c = component("i")
    await c.init({**props, "enableDelayedMessaging": "true"})
    for _ in range(3):
        await c.publish("orders", b"x", {"scheduledSendDelay": "1h"})
    await c.publish("billing", b"x", {"scheduledSendDelay": "1h"})
    deadline = time.monotonic() + 5
    while series(server.metrics) != {"orders": 3, "billing": 1}:
        assert time.monotonic() < deadline, series(server.metrics)
        await asyncio.sleep(0.05)
