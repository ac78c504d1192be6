"""Plain pub/sub over the gRPC socket against real Redis Cluster, Sentinel and TLS deployments.

Each deployment runs on private loopback ports for the module and is flushed
per test. The same scenarios (several topics, a bulk of 100, ack, nack) run
against each, plus each deployment's own ways of failing Init.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
import redis.cluster

from delayed_pubsub_pb.dapr.proto.components.v1 import pubsub_pb2
from tests.components.conftest import FAST
from tests.components.driver import Component
from tests.redis_server import (
    RedisCluster,
    RedisSentinel,
    TlsFiles,
    TlsRedisServer,
    make_tls_files,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

Factory = Callable[[str], Component]
GROUP = "app1"
# Short timeouts so a failing Init fails fast; retries off so the first error is the one reported.
FAIL_FAST = {"dialTimeout": "1s", "redisMaxRetries": "0"}


@dataclass
class Deployment:
    """What a test needs of a deployment: Init metadata and an admin client that sees every key."""

    props: dict[str, str]
    admin: redis.Redis | redis.cluster.RedisCluster
    topics: list[str] = field(default_factory=lambda: ["orders", "payments", "shipments"])


# --- the deployments ----------------------------------------------------------


@pytest.fixture(scope="module")
def sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisSentinel]:
    s = RedisSentinel(Path(tmp_path_factory.mktemp("sentinel")))
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(Path(tmp_path_factory.mktemp("tls")))


@pytest.fixture(scope="module")
def tls_sentinel(tmp_path_factory: pytest.TempPathFactory, tls_files: TlsFiles) -> Iterator[RedisSentinel]:
    """Sentinel and master both TLS only, both requiring a client certificate."""
    s = RedisSentinel(Path(tmp_path_factory.mktemp("tls-sentinel")), tls=tls_files)
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory, tls_files: TlsFiles) -> Iterator[TlsRedisServer]:
    """TLS only, and a client certificate signed by the test CA required."""
    server = TlsRedisServer(Path(tmp_path_factory.mktemp("tls-redis")), tls_files, auth_clients="yes")
    server.start()
    yield server
    server.stop()


def tls_props(server: TlsRedisServer) -> dict[str, str]:
    """enableTLS with the client certificate as PEM contents. The server's certificate
    is signed by a private CA, and settings.py takes no CA: skip verification."""
    return {
        "redisHost": server.address,
        "enableTLS": "true",
        "insecureSkipTLSVerify": "true",
        "clientCert": server.tls.client_cert.read_text(),
        "clientKey": server.tls.client_key.read_text(),
    }


def sentinel_props(s: RedisSentinel) -> dict[str, str]:
    props = {"redisHost": s.address, "failover": "true", "sentinelMasterName": s.master_name}
    if isinstance(s.master, TlsRedisServer):
        props = {**tls_props(s.master), **props}
    return props


def cluster_topics(c: RedisCluster) -> list[str]:
    """Two topics per master, so every node serves some of the test's topics (by CLUSTER KEYSLOT)."""
    per_node: dict[int, list[str]] = {n.port: [] for n in c.nodes}
    i = 0
    while any(len(t) < 2 for t in per_node.values()):
        topic = f"topic-{i}"
        owned = per_node[c.owner(topic).port]
        if len(owned) < 2:
            owned.append(topic)
        i += 1
    return [t for ts in per_node.values() for t in ts]


@pytest.fixture(params=["cluster", "sentinel", "tls", "sentinel-tls"])
def deployment(request: pytest.FixtureRequest) -> Iterator[Deployment]:
    """Each deployment in turn, flushed."""
    base = {"consumerID": GROUP, **FAST}
    d: Deployment
    if request.param == "cluster":
        c: RedisCluster = request.getfixturevalue("cluster")
        c.flushall()
        d = Deployment(
            {**base, "redisHost": ",".join(c.addresses), "redisType": "cluster"},
            c.client(),
            topics=cluster_topics(c),
        )
    elif request.param in ("sentinel", "sentinel-tls"):
        s: RedisSentinel = request.getfixturevalue(
            {"sentinel": "sentinel", "sentinel-tls": "tls_sentinel"}[request.param]
        )
        admin = s.master.client()
        admin.flushall()
        d = Deployment({**base, **sentinel_props(s)}, admin)
    else:
        server: TlsRedisServer = request.getfixturevalue("tls_server")
        admin = server.client()
        admin.flushall()
        d = Deployment({**base, **tls_props(server)}, admin)
    yield d
    d.admin.close()


# --- helpers --------------------------------------------------------------------


def pending(d: Deployment, topic: str) -> int:
    info: Any = d.admin.xpending(topic, GROUP)
    return int(info["pending"])


async def no_pending(d: Deployment, topic: str) -> None:
    """Until XPENDING of the group on `topic` is empty (acks travel asynchronously)."""
    await wait_until(lambda: pending(d, topic) == 0)


def payload(topic: str, i: int) -> bytes:
    # Every byte value, so any re-encoding on the way shows.
    return f"{topic}/{i}:".encode() + bytes(range(256))


async def init_fails(c: Component, props: dict[str, str]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.init(props)
    return err.value.code(), err.value.details() or ""


# --- the same scenarios against each deployment ------------------------------------


async def test_publish_to_several_topics_round_trips_byte_exact_and_ack_empties_the_pel(
    component: Factory, deployment: Deployment
) -> None:
    c = component("delayed")
    await c.init(deployment.props)
    await c.ping()
    streams = {t: await c.subscribe(t) for t in deployment.topics}
    for t in deployment.topics:
        for i in range(3):
            await c.publish(t, payload(t, i), {"traceid": f"{t}-{i}", "ü": "✓"})
    for t, stream in streams.items():
        for i in range(3):
            msg = await stream.next()
            assert (msg.topic_name, msg.data) == (t, payload(t, i))
            assert msg.metadata["traceid"] == f"{t}-{i}"
            assert msg.metadata["ü"] == "✓"
            assert msg.metadata["deliveryAttempt"] == "1"
            await stream.ack(msg.id)
    for t in deployment.topics:
        await no_pending(deployment, t)
        assert deployment.admin.xlen(t) == 3
    for stream in streams.values():
        assert await stream.close() == grpc.StatusCode.OK


async def test_topics_land_on_every_cluster_node(component: Factory, cluster: RedisCluster) -> None:
    cluster.flushall()
    topics = cluster_topics(cluster)
    owners = {t: cluster.owner(t) for t in topics}
    assert {o.port for o in owners.values()} == {n.port for n in cluster.nodes}
    c = component("delayed")
    await c.init({"consumerID": GROUP, "redisHost": ",".join(cluster.addresses), "redisType": "cluster"})
    for t in topics:
        await c.publish(t, payload(t, 0))
    for t, owner in owners.items():
        # Asked directly (no cluster client): the stream is on the node serving its slot.
        with owner.client() as node:
            assert node.xlen(t) == 1, f"{t} (slot {cluster.keyslot(t)}) not on {owner.address}"


async def test_cluster_is_found_from_any_one_node(component: Factory, cluster: RedisCluster) -> None:
    cluster.flushall()
    topics = cluster_topics(cluster)
    c = component("delayed")
    # Only the last node listed: the client discovers the others from it.
    await c.init({"consumerID": GROUP, "redisHost": cluster.addresses[-1], "redisType": "cluster"})
    for t in topics:
        await c.publish(t, b"x")
    with cluster.client() as admin:
        assert all(admin.xlen(t) == 1 for t in topics)


async def test_bulk_publish_of_100_lands_in_order_byte_exact(
    component: Factory, deployment: Deployment
) -> None:
    c = component("delayed")
    await c.init(deployment.props)
    topic = deployment.topics[-1]
    batch = [
        pubsub_pb2.BulkMessageEntry(
            entry_id=f"e{i}",
            event=payload(topic, i),
            content_type="application/octet-stream",
            metadata={"n": str(i)},
        )
        for i in range(100)
    ]
    reply = await c.bulk_publish(topic, batch, metadata={"batch": "b1"})
    assert list(reply.failed_entries) == []
    assert deployment.admin.xlen(topic) == 100
    stream = await c.subscribe(topic)
    for i in range(100):
        msg = await stream.next()
        assert (msg.data, msg.content_type) == (payload(topic, i), "application/octet-stream")
        assert (msg.metadata["n"], msg.metadata["batch"]) == (str(i), "b1")
        await stream.ack(msg.id)
    await no_pending(deployment, topic)


async def test_nack_redelivers_the_same_entry_with_attempt_2(
    component: Factory, deployment: Deployment
) -> None:
    c = component("delayed")
    await c.init({**deployment.props, "redeliverInterval": "300ms", "processingTimeout": "60s"})
    topic = deployment.topics[0]
    stream = await c.subscribe(topic)
    await c.publish(topic, b"flaky", {"k": "v"})
    first = await stream.next()
    assert first.metadata["deliveryAttempt"] == "1"
    assert pending(deployment, topic) == 1
    await stream.nack(first.id)
    second = await stream.next(within=5)
    assert (second.id, second.data, second.metadata["k"]) == (first.id, b"flaky", "v")
    assert second.metadata["deliveryAttempt"] == "2"
    await stream.ack(second.id)
    await no_pending(deployment, topic)


async def test_subscription_survives_a_whole_cluster_restart(component: Factory, tmp_path: Path) -> None:
    # A private cluster: restarting the module's would disturb the other tests.
    own = RedisCluster(tmp_path / "cluster")
    own.start()
    try:
        c = component("delayed")
        await c.init(
            {"consumerID": GROUP, "redisHost": ",".join(own.addresses), "redisType": "cluster", **FAST}
        )
        stream = await c.subscribe("orders")
        await c.publish("orders", b"before")
        await stream.ack((await stream.next()).id)
        # While no node answers, redis-py raises RedisClusterException (no RedisError):
        # the subscription must keep retrying through it, not die silently.
        # In a thread: the component runs on this event loop and must see the outage.
        await asyncio.to_thread(own.restart, 2.0)
        await c.publish("orders", b"after")
        assert (await stream.next(within=15)).data == b"after"
        assert not stream.ended.is_set()
    finally:
        own.stop()


# --- each deployment's own ways to fail Init --------------------------------------------


async def test_delayed_messages_arrive_on_every_deployment_subscribed_through_the_component(
    component: Factory, deployment: Deployment
) -> None:
    """Cluster (two-phase fire over shards), Sentinel, TLS: a delayed publish arrives once, when due."""
    c = component("delayed")
    await c.init({**deployment.props, "consumerID": GROUP, "enableDelayedMessaging": "true"})
    streams = {t: await c.subscribe(t) for t in deployment.topics}
    sent = time.monotonic()
    for t in deployment.topics:
        await c.publish(t, payload(t, 0), {"scheduledSendDelay": "1s"})
    for t, stream in streams.items():
        msg = await stream.next()
        assert (msg.topic_name, msg.data) == (t, payload(t, 0))
        assert msg.metadata["scheduleNext"] == "purge"
        await stream.ack(msg.id)
    assert time.monotonic() - sent >= 0.9
    await asyncio.sleep(0.5)
    for t in deployment.topics:
        assert deployment.admin.xlen(t) == 1
    for stream in streams.values():
        assert await stream.close() == grpc.StatusCode.OK


async def test_cluster_refuses_a_bad_delay_shards_naming_it(
    component: Factory, cluster: RedisCluster
) -> None:
    for bad in ("0", "-1", "x", "1025"):
        code, details = await init_fails(
            component("delayed"),
            {
                "consumerID": GROUP,
                "redisHost": ",".join(cluster.addresses),
                "redisType": "cluster",
                "enableDelayedMessaging": "true",
                "delayShards": bad,
            },
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert f"delayShards={bad!r}" in details


async def test_cluster_type_against_a_plain_node_is_unavailable(
    component: Factory, sentinel: RedisSentinel
) -> None:
    code, details = await init_fails(
        component("delayed"),
        {"consumerID": GROUP, "redisHost": sentinel.master.address, "redisType": "cluster", **FAIL_FAST},
    )
    assert code == grpc.StatusCode.UNAVAILABLE
    assert sentinel.master.address in details
    assert "cluster" in details.lower()


async def test_sentinel_with_unknown_master_name_is_unavailable_naming_it(
    component: Factory, sentinel: RedisSentinel
) -> None:
    c = component("delayed")
    code, details = await init_fails(
        c,
        {
            "consumerID": GROUP,
            "redisHost": sentinel.address,
            "failover": "true",
            "sentinelMasterName": "no-such-master",
            **FAIL_FAST,
        },
    )
    assert code == grpc.StatusCode.UNAVAILABLE
    assert "no-such-master" in details
    assert sentinel.address in details
    # A failed Init registers nothing.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.ping()
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_tls_without_the_client_certificate_the_server_requires_is_unavailable(
    component: Factory, tls_server: TlsRedisServer
) -> None:
    props = {k: v for k, v in tls_props(tls_server).items() if k not in ("clientCert", "clientKey")}
    code, details = await init_fails(component("delayed"), {"consumerID": GROUP, **props, **FAIL_FAST})
    assert code == grpc.StatusCode.UNAVAILABLE
    assert tls_server.address in details
    # The server's alert ("certificate required") is often lost to the reset; the hint is not.
    assert "clientCert" in details


async def test_tls_server_certificate_of_an_unknown_ca_is_refused_unless_skip_verify(
    component: Factory, tls_server: TlsRedisServer
) -> None:
    props = {**tls_props(tls_server), "insecureSkipTLSVerify": "false"}
    code, details = await init_fails(component("delayed"), {"consumerID": GROUP, **props, **FAIL_FAST})
    assert code == grpc.StatusCode.UNAVAILABLE
    assert tls_server.address in details
    assert "certificate verify failed" in details


async def test_plain_connection_to_a_tls_port_is_unavailable(
    component: Factory, tls_server: TlsRedisServer
) -> None:
    code, details = await init_fails(
        component("delayed"), {"consumerID": GROUP, "redisHost": tls_server.address, **FAIL_FAST}
    )
    assert code == grpc.StatusCode.UNAVAILABLE
    assert tls_server.address in details
    assert "enableTLS" in details


async def test_tls_with_optional_client_auth_works_without_a_client_certificate(
    component: Factory, tls_files: TlsFiles, tmp_path: Path
) -> None:
    server = TlsRedisServer(tmp_path / "redis", tls_files, auth_clients="optional")
    server.start()
    try:
        c = component("delayed")
        await c.init(
            {
                "consumerID": GROUP,
                "redisHost": server.address,
                "enableTLS": "true",
                "insecureSkipTLSVerify": "true",
            }
        )
        stream = await c.subscribe("orders")
        await c.publish("orders", b"over tls")
        msg = await stream.next()
        assert msg.data == b"over tls"
        await stream.ack(msg.id)
        with server.client() as admin:
            await wait_until(lambda: admin.xpending("orders", GROUP)["pending"] == 0)
        assert await stream.close() == grpc.StatusCode.OK
    finally:
        server.stop()
