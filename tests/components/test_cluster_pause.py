"""Pause, resume and prefix cancel on a real Redis Cluster with delayShards, through two real
`delayed-pubsub serve` replicas, one killed with -9 while schedules fire and pauses land: no
occurrence fires twice, none of a running schedule is lost, and a paused schedule fires nothing
after its pause returned."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import redis.cluster

from delayed_middleware.entry import decode_entry
from delayed_middleware.instants import parse_instant
from delayed_pubsub_pb.dapr.proto.components.v1 import pubsub_pb2
from tests.components.serve import Serve, instance
from tests.redis_server import RedisCluster

pytestmark = pytest.mark.slow

INTERVAL_MS = 1000
# The two-phase fire's default lease (EngineConfig.lease_ms).
LEASE_MS = 5000
N = 60


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def cluster_props(c: RedisCluster) -> dict[str, str]:
    return {
        "redisHost": c.nodes[0].address,
        "redisType": "cluster",
        "delayShards": "4",
        "consumerID": "app1",
        "enableDelayedMessaging": "true",
    }


def fires(admin: Any, topic: str) -> dict[str, list[tuple[int, int]]]:
    """scheduler -> (occurrence due ms, landed ms) of every message on `topic`."""
    out: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for entry_id, fields in admin.xrange(topic):
        entry = decode_entry(fields)
        due = parse_instant(entry.metadata["scheduleNext"]) - INTERVAL_MS
        out[entry.metadata["scheduler"]].append((due, int(entry_id.decode().split("-")[0])))
    return out


async def test_pauses_racing_fires_and_a_kill_9_on_cluster_hold_exactly(
    folder: Path, cluster: RedisCluster, admin: redis.cluster.RedisCluster
) -> None:
    props = cluster_props(cluster)
    a, b = Serve(folder, "a"), Serve(folder, "b")
    paused_at: dict[str, int] = {}
    try:
        async with instance(a, props) as ca, instance(b, props) as cb:
            reply = await ca.bulk_publish(
                "ticks",
                [
                    pubsub_pb2.BulkMessageEntry(
                        entry_id=str(i),
                        event=json.dumps({"n": i}).encode(),
                        metadata={"schedule": "@every 1s", "scheduleId": f"s{i}"},
                    )
                    for i in range(N)
                ],
            )
            assert list(reply.failed_entries) == []
            start = now_ms()
            await asyncio.sleep(3)

            async def pause_half() -> None:
                for i in range(0, N, 2):
                    await cb.publish("ticks", b"", {"schedulePause": "true", "scheduleId": f"s{i}"})
                    paused_at[f"s{i}"] = now_ms()

            pausing = asyncio.create_task(pause_half())
            await asyncio.sleep(0.05)
            a.kill9()  # mid-fire, while the pauses land: b takes over a's claims
            await pausing
            await asyncio.sleep(4)
            resumed = now_ms()
            for i in range(0, N, 2):
                await cb.publish("ticks", b"", {"schedulePause": "false", "scheduleId": f"s{i}"})
            await asyncio.sleep(3)
            end = now_ms()
            await cb.publish("ticks", b"", {"scheduleCancel": "true", "scheduleIdPrefix": "s"})
            await asyncio.sleep(0.5)
            after_cancel = admin.xlen("ticks")
            await asyncio.sleep(2)
            assert admin.xlen("ticks") == after_cancel, "a schedule fired after the prefix cancel"
    finally:
        a.stop()
        b.stop()

    got = fires(admin, "ticks")
    assert set(got) == {f"s{i}" for i in range(N)}
    for scheduler, occurrences in got.items():
        dues = [d for d, _ in occurrences]
        assert len(dues) == len(set(dues)), f"{scheduler}: an occurrence fired twice"
        if scheduler in paused_at:
            held = [d for d, landed in occurrences if paused_at[scheduler] < landed < resumed]
            assert held == [], f"{scheduler} fired {len(held)} time(s) while paused"
            # After the resume: the next grid points, none of those missed while paused.
            after = sorted(d for d, landed in occurrences if landed >= resumed)
            assert after, f"{scheduler} did not fire after its resume"
            # Its resume came after `resumed`; 100 ms for the replica's measure of the Redis clock.
            assert after[0] > resumed - 100, (scheduler, after[0], resumed)
        else:
            # Running throughout, on its grid. An occurrence the killed replica had claimed is taken
            # over when its lease ends (5 s): it fires then, once, and the grid points that passed
            # meanwhile are skipped (the missed-fires policy), so a gap is at most about a lease.
            inside = sorted(d for d in dues if start + INTERVAL_MS <= d <= end - 2 * INTERVAL_MS)
            assert inside, f"{scheduler}: no fire inside the window"
            assert all((y - x) % INTERVAL_MS == 0 for x, y in itertools.pairwise(inside))
            gaps = [y - x for x, y in itertools.pairwise(inside)]
            assert max(gaps, default=0) <= LEASE_MS + 2 * INTERVAL_MS, (
                f"{scheduler}: stopped firing: {inside}"
            )
            assert max(dues) >= end - 3 * INTERVAL_MS, f"{scheduler}: no fire near the end"
