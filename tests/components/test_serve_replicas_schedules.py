"""Recurring schedules across real `delayed-pubsub serve` processes sharing one Redis, one killed with -9:
every occurrence of every schedule fires exactly once, none early, none lost."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import defaultdict
from pathlib import Path

import pytest
import redis

from delayed_middleware.instants import parse_instant
from delayed_pubsub_pb.dapr.proto.components.v1 import pubsub_pb2
from tests.components.serve import Serve, instance, props_for
from tests.redis_server import RedisServer, stream_entries

pytestmark = pytest.mark.slow

INTERVAL_MS = 2000


def now_ms() -> int:
    return time.time_ns() // 1_000_000


async def test_two_replicas_one_killed_fire_each_occurrence_exactly_once(
    folder: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    n = 100
    a, b = Serve(folder, "a"), Serve(folder, "b")
    try:
        props = props_for(redis_server)
        async with instance(a, props) as ca, instance(b, props):
            reply = await ca.bulk_publish(
                "ticks",
                [
                    pubsub_pb2.BulkMessageEntry(
                        entry_id=str(i),
                        event=json.dumps({"n": i}).encode(),
                        metadata={"schedule": "@every 2s", "scheduleId": f"s{i}"},
                    )
                    for i in range(n)
                ],
            )
            assert list(reply.failed_entries) == []
            start = now_ms()
            await asyncio.sleep(5)
            a.kill9()  # mid-flight: whatever it was firing or refilling, b must finish
            await asyncio.sleep(6)
            end = now_ms()
            # Stop the schedules so nothing fires while we read.
            async with instance(b, props) as cb:
                reply = await cb.bulk_publish(
                    "ticks",
                    [
                        pubsub_pb2.BulkMessageEntry(
                            entry_id=str(i),
                            event=b"",
                            metadata={"scheduleCancel": "true", "scheduleId": f"s{i}"},
                        )
                        for i in range(n)
                    ],
                )
                assert list(reply.failed_entries) == []
    finally:
        a.stop()
        b.stop()

    dues: dict[str, list[int]] = defaultdict(list)
    for entry_id, fields in stream_entries(redis_client, "ticks"):
        md = json.loads(fields[b"metadata"])
        due = parse_instant(md["scheduleNext"]) - INTERVAL_MS
        landed = int(entry_id.split("-")[0])
        assert landed >= due, f"{md['scheduler']} fired {due - landed} ms early"
        dues[md["scheduler"]].append(due)
    assert set(dues) == {f"s{i}" for i in range(n)}
    for scheduler, fired in dues.items():
        assert len(fired) == len(set(fired)), f"{scheduler}: an occurrence fired twice"
        # Inside the window (away from its edges), every occurrence is there: a grid without holes.
        inside = sorted(d for d in fired if start + INTERVAL_MS <= d <= end - 2 * INTERVAL_MS)
        assert inside, f"{scheduler}: no fire inside the window"
        assert all(y - x == INTERVAL_MS for x, y in itertools.pairwise(inside)), (
            f"{scheduler}: occurrences lost: {inside}"
        )
