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
from tests.e2e.harness import ManagedProcess, Stack
from tests.redis_server import RedisCluster, free_port

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
    socket_dir = workdir / "sockets"
    resources = workdir / "resources"
    resources.mkdir()
    metadata = harness.component_metadata(
        cluster.nodes[0].port, redisType="cluster", delayShards=str(SHARDS), consumerID=APP_ID
    )
    metadata["redisHost"] = ",".join(cluster.addresses)
    (resources / f"{PUBSUB}.yaml").write_text(harness.component_yaml(PUBSUB, metadata))
    started: list[ManagedProcess] = []
    try:
        component = harness.start_component(workdir, socket_dir)
        started.append(component)
        app_port = free_port()
        subscriber = harness.start_subscriber(workdir, app_port, SUBSCRIPTIONS)
        started.append(subscriber)
        ports = harness.DaprdPorts.free()
        daprd = harness.start_daprd(daprd_path, workdir, socket_dir, APP_ID, app_port, resources, ports)
        started.append(daprd)
        s = Stack(
            workdir=workdir,
            redis_port=cluster.nodes[0].port,
            app_port=app_port,
            ports=ports,
            pubsubs=(PUBSUB,),
            daprd=daprd,
            component=component,
            subscriber=subscriber,
        )

        def loaded() -> bool:
            meta = s.client.get(f"{s.dapr_url}/v1.0/metadata").json()
            subs = {(x["pubsubname"], x["topic"]) for x in meta.get("subscriptions", [])}
            return {(PUBSUB, "later"), (PUBSUB, "retry"), (PUBSUB, "retry-dead")} <= subs

        harness.wait_until(loaded, 30, "daprd to load the cluster component's subscriptions", s.daprd)
        yield s
        s.client.close()
    except harness.HarnessError as exc:
        pytest.fail(str(exc), pytrace=False)
    finally:
        for proc in reversed(started):
            proc.stop()


def admin_client(cluster: RedisCluster) -> Iterator[Any]:
    """A Cluster client for checks (a fixture's body). Not tests/conftest.py's: a module's stack lives
    across its tests, so no flush."""
    c = cluster.client()
    yield c
    c.close()
