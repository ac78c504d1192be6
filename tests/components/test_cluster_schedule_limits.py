"""Schedules in a time zone with a limit, on a real Redis Cluster with delay shards, through two
`delayed-pubsub serve` replicas: zoned cron schedules with a limit fire exactly their limit once each,
complete on every shard, and a kill -9 of a replica mid-fire doubles no occurrence and leaves no
schedule behind."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from delayed_middleware.entry import decode_entry
from delayed_middleware.history import decode_record
from delayed_middleware.keys import EngineKeys, shard_topics
from delayed_pubsub_pb.dapr.proto.components.v1 import pubsub_pb2
from tests.components.driver import CLUSTER_SHARDS as SHARDS
from tests.components.driver import cluster_props, engine_left
from tests.components.serve import Serve, instance
from tests.redis_server import RedisCluster
from tests.waiting import wait_until
from tests.wallclock import steady_zones

pytestmark = pytest.mark.slow

ZONES = ("America/New_York", "Asia/Kathmandu", "Australia/Sydney", "Europe/London")


def schedules(n: int, limit: int) -> list[pubsub_pb2.BulkMessageEntry]:
    # Within hours of a zone's fall-back its every-second cron may wait out the repeated hour:
    # that zone sits the run out (Asia/Kathmandu has no daylight saving, so one always remains).
    zones = steady_zones(ZONES)
    return [
        pubsub_pb2.BulkMessageEntry(
            entry_id=str(i),
            event=b"tick",
            metadata={
                "schedule": "* * * * * *",
                "scheduleTimeZone": zones[i % len(zones)],
                "scheduleLimit": str(limit),
                "scheduleId": f"z{i}",
            },
        )
        for i in range(n)
    ]


def deliveries(admin: Any, topic: str) -> list[tuple[str, str]]:
    """(scheduler, scheduleNext) of every message on the topic."""
    out = []
    for _, fields in admin.xrange(topic):
        md = decode_entry(fields).metadata
        out.append((md["scheduler"], md["scheduleNext"]))
    return out


def completed(admin: Any) -> Counter[str]:
    got: Counter[str] = Counter()
    for t in shard_topics("app1", SHARDS):
        for i, f in admin.xrange(EngineKeys.for_topic(t).history):
            r = decode_record(i, f)
            if r.event == "completed":
                got[r.id] += 1
    return got


@pytest.fixture
def replicas(folder: Path) -> Iterator[tuple[Serve, Serve]]:
    a, b = Serve(folder, "a"), Serve(folder, "b")
    try:
        yield a, b
    finally:
        a.stop()
        b.stop()


async def test_zoned_schedules_with_a_limit_fire_exactly_their_limit_on_every_shard(
    replicas: tuple[Serve, Serve], cluster: RedisCluster, admin: Any
) -> None:
    a, b = replicas
    props = cluster_props(cluster)
    async with instance(a, props) as ca, instance(b, props):
        reply = await ca.bulk_publish("zoned", schedules(200, limit=3))
        assert list(reply.failed_entries) == []
        await wait_until(lambda: sum(completed(admin).values()) >= 200, within_s=30, every_s=0.1)
        await asyncio.sleep(1.5)  # a fourth fire or a double would land now, if ever
        got = deliveries(admin, "zoned")
        assert Counter(s for s, _ in got) == {f"z{i}": 3 for i in range(200)}
        assert len(set(got)) == len(got)  # no occurrence twice
        assert Counter(n for _, n in got)["purge"] == 200  # each one's third says nothing follows
        assert completed(admin) == {f"z{i}": 1 for i in range(200)}
        assert engine_left(admin) == {"pending": 0, "inflight": 0, "envelopes": 0}


async def test_kill_9_of_a_replica_mid_fire_doubles_no_occurrence_and_every_schedule_completes(
    replicas: tuple[Serve, Serve], cluster: RedisCluster, admin: Any
) -> None:
    a, b = replicas
    props = cluster_props(cluster)
    async with instance(a, props) as ca, instance(b, props):
        reply = await ca.bulk_publish("zoned", schedules(300, limit=3))
        assert list(reply.failed_entries) == []
        await wait_until(lambda: admin.xlen("zoned") >= 100, within_s=15, every_s=0.1)
        a.kill9()
        assert admin.xlen("zoned") < 900, "the kill must land while occurrences are pending"
        # The dead replica's claims come back after their lease (5 s); the missed-fires policy
        # then fires each overdue occurrence once, and the limit's last occurrence has passed.
        await wait_until(lambda: sum(completed(admin).values()) >= 300, within_s=40, every_s=0.1)
        await asyncio.sleep(1.5)
        got = deliveries(admin, "zoned")
        assert len(set(got)) == len(got)  # no occurrence delivered twice
        per_schedule = Counter(s for s, _ in got)
        assert set(per_schedule) == {f"z{i}" for i in range(300)}  # none lost
        assert max(per_schedule.values()) <= 3
        assert completed(admin) == {f"z{i}": 1 for i in range(300)}
        left: dict[str, int] = {}

        def empty() -> bool:
            left.update(engine_left(admin))
            return left == {"pending": 0, "inflight": 0, "envelopes": 0}

        await wait_until(empty, within_s=10, every_s=0.1)
