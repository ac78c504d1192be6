"""The e2e stack on a real Redis Cluster with delay shards, for the cluster e2e modules: Cluster +
`delayed-pubsub serve` + subscriber app + daprd. Each module wraps cluster_stack in a module-scoped
`stack` fixture of its own (its stack lives across that module's tests)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e import harness
from tests.e2e.conftest import APP_ID, PUBSUB
from tests.e2e.harness import Stack
from tests.redis_server import RedisCluster

SHARDS = 6
SUBSCRIPTIONS = (
    f"{PUBSUB}=later",
    f"{PUBSUB}=retry;maxDeliveryAttempts=3;retryInitialInterval=300ms;retryMultiplier=2"
    ";deadLetterTopic=retry-dead",
    f"{PUBSUB}=retry-dead",
)
EXE = Path(sys.executable).with_name("delayed-pubsub")


def cluster_stack(
    daprd_path: str, cluster: RedisCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """Start the stack, yield it, stop what was started (a fixture's body)."""
    workdir = Path(tmp_path_factory.mktemp("e2e-cluster-stack"))
    resources = workdir / "resources"
    resources.mkdir()
    metadata = harness.component_metadata(
        cluster.nodes[0].port, redisType="cluster", delayShards=str(SHARDS), consumerID=APP_ID
    )
    metadata["redisHost"] = ",".join(cluster.addresses)
    (resources / f"{PUBSUB}.yaml").write_text(harness.component_yaml(PUBSUB, metadata))
    with harness.started_stack(
        daprd_path,
        workdir,
        resources,
        redis_port=cluster.nodes[0].port,
        pubsubs=(PUBSUB,),
        subscriptions=SUBSCRIPTIONS,
        app_id=APP_ID,
    ) as s:

        def loaded() -> bool:
            meta = s.client.get(f"{s.dapr_url}/v1.0/metadata").json()
            subs = {(x["pubsubname"], x["topic"]) for x in meta.get("subscriptions", [])}
            return {(PUBSUB, "later"), (PUBSUB, "retry"), (PUBSUB, "retry-dead")} <= subs

        harness.wait_until_blocking(
            loaded, "daprd to load the cluster component's subscriptions", 30, process=s.daprd
        )
        yield s


def admin_client(cluster: RedisCluster) -> Iterator[Any]:
    """A Cluster client for checks (a fixture's body). Not tests/conftest.py's: a module's stack lives
    across its tests, so no flush."""
    c = cluster.client()
    yield c
    c.close()
