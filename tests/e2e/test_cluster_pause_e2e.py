"""schedulePause and scheduleIdPrefix under a real daprd on a real 3-master Redis Cluster with
`delayShards: "6"`, driven with curl as a user would: a schedule on a far shard pauses and
resumes, and a prefix cancel reaches the messages of every shard."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from delayed_middleware.keys import shard_index
from tests.e2e.cluster_stack import SHARDS, admin_client, cluster_stack
from tests.e2e.harness import Stack, carries, now_ms, unique
from tests.e2e.user import curl_publish, pause_then_resume
from tests.redis_server import RedisCluster

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(
    daprd_path: str, cluster: RedisCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """This module's own cluster stack (tests/e2e/cluster_stack.py)."""
    yield from cluster_stack(daprd_path, cluster, tmp_path_factory)


@pytest.fixture
def admin(cluster: RedisCluster) -> Iterator[Any]:
    yield from admin_client(cluster)

TOPIC = "later"


def far_id(prefix: str) -> str:
    """A scheduleId whose home shard is not shard 0."""
    for i in range(100):
        candidate = f"{prefix}-{i}"
        if shard_index(candidate, SHARDS) != 0:
            return candidate
    raise AssertionError("no id off shard 0")


def test_a_schedule_on_a_far_shard_pauses_and_resumes_through_curl(stack: Stack) -> None:
    pause_then_resume(stack, TOPIC, far_id(unique("c-sched")), unique("c-pause"), hold_s=3)



def test_a_prefix_cancel_through_curl_reaches_every_shard(stack: Stack) -> None:
    prefix = unique("c-tenant") + ":"
    ids = [f"{prefix}{i}" for i in range(24)]
    assert len({shard_index(i, SHARDS) for i in ids}) >= 3
    # Due well after the cancel can land, however slow 25 publishes through daprd are here.
    delay_ms = 15_000
    first = now_ms()
    markers = []
    for sid in ids:
        marker = unique("c-prefixed")
        markers.append(marker)
        code, text = curl_publish(
            stack,
            TOPIC,
            {"scheduledSendDelay": f"{delay_ms}ms", "scheduleId": sid},
            json.dumps({"id": marker}),
        )
        assert code == 204, text
    kept = unique("c-kept")
    code, text = curl_publish(
        stack,
        TOPIC,
        {"scheduledSendDelay": f"{delay_ms}ms", "scheduleId": far_id(unique("c-other"))},
        json.dumps({"id": kept}),
    )
    assert code == 204, text
    code, text = curl_publish(stack, TOPIC, {"scheduleCancel": "true", "scheduleIdPrefix": prefix})
    assert code == 204, text
    assert now_ms() - first < delay_ms, "the publishes took longer than their delay: nothing was pending"
    assert len(stack.wait_arrivals(carries(kept), 1, timeout=delay_ms / 1000 + 10)) == 1
    for m in markers:
        assert stack.wait_arrivals(carries(m), 1, timeout=0) == [], "a message cancelled by prefix fired"
