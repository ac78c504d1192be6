"""Delayed messaging under a real daprd on a real 3-master Redis Cluster, `delayShards: "6"`.

The component YAML a user writes for Cluster (`redisType: cluster`,
`enableDelayedMessaging: "true"`, `delayShards: "6"`), driven with curl/HTTP
through daprd as in the single-node suites: delayed publishes arrive on time
from every shard, an `@every` schedule fires on its grid and stops when
cancelled through curl, a failing app gets the retries and the dead letter,
and the operator CLI sees what waits on every shard.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator
from typing import Any

import pytest

from delayed_middleware.keys import EngineKeys, shard_index, shard_topics
from tests.e2e.cluster_stack import EXE, SHARDS, admin_client, cluster_stack
from tests.e2e.conftest import APP_ID, PUBSUB
from tests.e2e.harness import LATENESS, LATENESS_TOLERANCE_MS, Stack, carries, now_ms, unique
from tests.e2e.user import (
    assert_every_grid,
    assert_on_time,
    assert_stops,
    cancel,
    curl_publish,
    header,
    ok_arrivals,
)
from tests.redis_server import RedisCluster

pytestmark = pytest.mark.e2e



@pytest.fixture(scope="module")
def stack(
    daprd_path: str, cluster: RedisCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """Cluster + `delayed-pubsub serve` + subscriber app + daprd (this module's own stack)."""
    yield from cluster_stack(daprd_path, cluster, tmp_path_factory)


@pytest.fixture
def admin(cluster: RedisCluster) -> Iterator[Any]:
    yield from admin_client(cluster)


def histories(admin: Any) -> list[int]:
    """Entries of each shard's history stream (a shard that stored something wrote there)."""
    return [admin.xlen(EngineKeys.for_topic(t).history) for t in shard_topics(APP_ID, SHARDS)]


def operator(cluster: RedisCluster, *args: str) -> tuple[int, str, str]:
    """The operator CLI, as a user runs it beside the cluster."""

    async def run() -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            str(EXE),
            *args,
            "--redis-host",
            cluster.nodes[2].address,
            "--redis-type",
            "cluster",
            "--delay-shards",
            str(SHARDS),
            "--app-id",
            APP_ID,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        return proc.returncode or 0, out.decode(), err.decode()

    return asyncio.run(run())


def test_the_cluster_spreads_the_shards_over_every_master(cluster: RedisCluster) -> None:
    assert len({cluster.owner(t).port for t in shard_topics(APP_ID, SHARDS)}) == 3


def test_delayed_publishes_through_http_arrive_on_time_from_every_shard(stack: Stack, admin: Any) -> None:
    before = histories(admin)
    markers: list[tuple[str, int, dict[str, Any]]] = []
    # 12 calls without a scheduleId (one shard per call, in turn) and 6 with one (by its hash).
    for i in range(18):
        marker = unique(f"cl{i}")
        t0 = now_ms()
        payload = {"id": marker, "due_ms": t0 + 3000}
        md = {"scheduledSendDelay": "3s"}
        if i >= 12:
            md["scheduleId"] = marker
        response = stack.publish(PUBSUB, "later", payload, metadata=md)
        assert response.status_code == 204, response.text
        markers.append((marker, t0 + 3000, payload))
    used = [b > a for a, b in zip(before, histories(admin), strict=True)]
    assert all(used), f"shards that stored nothing: {[n for n, u in enumerate(used) if not u]}"
    assert_on_time(stack, "cluster http scheduledSendDelay=3s", *markers[0])
    for marker, due, payload in markers[1:]:
        [arrival] = stack.wait_arrivals(carries(marker), 1, timeout=10)
        lateness = arrival["received_ms"] - due
        LATENESS.append(("cluster http scheduledSendDelay=3s", lateness))
        assert arrival["data"] == payload
        assert 0 <= lateness <= LATENESS_TOLERANCE_MS, (marker, lateness)
    # Once each, and nothing is left on any shard.
    for marker, _, _ in markers:
        assert len(stack.wait_arrivals(carries(marker), 2, timeout=0.5)) == 1
    keys = [EngineKeys.for_topic(t) for t in shard_topics(APP_ID, SHARDS)]
    assert sum(int(admin.get(k.count) or 0) for k in keys) == 0


def test_every_2s_on_a_far_shard_fires_on_its_grid_then_cancel_through_curl_stops_it(
    stack: Stack, cluster: RedisCluster
) -> None:
    marker = unique("cl-every")
    # A scheduleId whose home is shard 4: the schedule lives away from shard 0 and its master.
    schedule_id = next(s for s in (f"{marker}-{i}" for i in range(1000)) if shard_index(s, SHARDS) == 4)
    t0 = now_ms()
    code, text = curl_publish(
        stack, "later", {"schedule": "@every 2s", "scheduleId": schedule_id}, json.dumps({"id": marker})
    )
    t1 = now_ms()
    assert code == 204, text

    # While it runs, the operator sees it on shard 4, recurring.
    rc, out, err = operator(cluster, "pending", "--json", "--limit", "0")
    assert rc == 0, err
    [row] = [r for r in json.loads(out) if r["id"] == schedule_id]
    assert row["kind"] == "recurring"
    rc, out, err = operator(cluster, "inspect", schedule_id)
    assert rc == 0, err
    assert f"{APP_ID}~4-delayed" in out

    fires = ok_arrivals(stack, marker, 4, timeout=12)
    assert len(fires) >= 4, f"expected 4 fires of @every 2s, got {len(fires)}"
    assert all(header(a, "scheduler") == schedule_id for a in fires)
    assert_every_grid(fires[:4], 2000, t0, t1, "cluster http schedule=@every 2s")

    cancelled = cancel(stack, "later", schedule_id)
    assert_stops(stack, marker, cancelled, quiet_s=5)
    rc, out, err = operator(cluster, "pending", "--json", "--limit", "0")
    assert rc == 0, err
    assert schedule_id not in {r["id"] for r in json.loads(out)}


def test_a_cancel_through_curl_of_a_pending_one_shot_on_another_shard(stack: Stack) -> None:
    marker = unique("cl-cancel")
    schedule_id = next(s for s in (f"{marker}-{i}" for i in range(1000)) if shard_index(s, SHARDS) == 5)
    code, text = curl_publish(
        stack, "later", {"scheduledSendDelay": "3s", "scheduleId": schedule_id}, json.dumps({"id": marker})
    )
    assert code == 204, text
    cancel(stack, "later", schedule_id)
    assert stack.wait_arrivals(carries(marker), 1, timeout=6) == [], "a cancelled message was delivered"


def test_a_delayed_message_the_app_fails_is_retried_with_backoff_then_dead_lettered(stack: Stack) -> None:
    ok, dead = unique("cl-retry"), unique("cl-dead")
    stack.arm_failure(ok, times=2)
    stack.arm_failure(dead, times=3)
    t0 = now_ms()
    for marker in (ok, dead):
        response = stack.publish(PUBSUB, "retry", {"id": marker}, metadata={"scheduledSendDelay": "1s"})
        assert response.status_code == 204, response.text

    got = stack.wait_arrivals(carries(ok), 3, timeout=20)
    assert [a["status"] for a in got] == [500, 500, 200], got
    assert [header(a, "deliveryAttempt") for a in got] == ["1", "2", "3"]
    assert got[0]["received_ms"] >= t0 + 1000, "delivered before its due time"
    gaps = [b["received_ms"] - a["received_ms"] for a, b in itertools.pairwise(got)]
    for gap, backoff in zip(gaps, (300, 600), strict=True):
        assert backoff <= gap <= backoff + 900, gaps

    arrivals = stack.wait_arrivals(carries(dead), 4, timeout=20)
    failed = [a for a in arrivals if a["route"] == f"/events/{PUBSUB}/retry"]
    letters = [a for a in arrivals if a["route"] == f"/events/{PUBSUB}/retry-dead"]
    assert [a["status"] for a in failed] == [500] * 3
    assert len(letters) == 1, arrivals
    assert header(letters[0], "deadLetterSourceTopic") == "retry"
    assert header(letters[0], "deadLetterAttempts") == "3"
