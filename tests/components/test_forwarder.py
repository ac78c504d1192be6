"""The forwarder against a real Redis and a real daprd: due messages reach another Dapr pub/sub.

The daprd here runs Dapr's built-in `pubsub.redis` (component `target`, on
database 1 of the test Redis, whose database 0 holds our outbox) and
`pubsub.in-memory` (component `mem`), and the example subscriber app listens on
both. Outbox entries are written in the documented format (delayed_middleware.outbox)
straight into Redis, as the engine's fire script does, so the forwarder is
proven on its own; the publish -> fire -> outbox path is the engine's test.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as acluster
from dapr.proto.runtime.v1 import dapr_pb2_grpc
from google.protobuf import empty_pb2
from prometheus_client import CollectorRegistry
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from delayed_middleware.clock import SystemClock
from delayed_middleware.deadletters import dead_letter_topics_key
from delayed_middleware.entry import StreamEntry, encode_entry
from delayed_middleware.history import Retention, decode_record
from delayed_middleware.keys import EngineKeys, delayed_topic, shard_index, shard_topics
from delayed_middleware.outbox import OutboxEntry, encode_outbox_entry
from delayed_middleware.retry import RetryPolicy
from delayed_pubsub.forwarder import (
    Forwarder,
    ForwarderConfig,
    HandOffPolicy,
    forwarder_config,
    resolve_dapr_address,
)
from delayed_pubsub.metrics import Metrics
from delayed_pubsub.redelivery import Retrier
from delayed_pubsub.settings import parse_settings
from tests.chaos.proxy import DelayingProxy, Pump, _Proxy
from tests.components.conftest import FAST
from tests.components.driver import Component, cli, cluster_conn
from tests.conftest import small_stream_nodes
from tests.e2e import harness
from tests.e2e.harness import DaprdPorts, ManagedProcess
from tests.redis_server import RedisCluster, RedisServer, free_port

APP_ID = "fwd-app"
KEYS = EngineKeys.for_topic(delayed_topic(APP_ID))
SUBSCRIPTIONS = ("target=orders", "target=bulk", "target=restart", "target=race", "mem=orders")
TARGET_DB = 1


# --- pure parts -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("configured", "env", "address"),
    [
        ("10.0.0.5:50009", {"DAPR_GRPC_PORT": "50002"}, "10.0.0.5:50009"),
        ("http://127.0.0.1:7000", {}, "127.0.0.1:7000"),
        ("unix:///run/dapr.sock", {}, "unix:///run/dapr.sock"),
        ("", {"DAPR_GRPC_PORT": "50002"}, "127.0.0.1:50002"),
        ("", {}, "127.0.0.1:50001"),
    ],
)
def test_sidecar_address(configured: str, env: dict[str, str], address: str) -> None:
    assert resolve_dapr_address(configured, env) == address


def test_config_takes_the_api_token_and_dead_letter_topic() -> None:
    cfg = forwarder_config(
        dapr_grpc_address="",
        dead_letter_topic="dlq",
        claim_idle_ms=60_000,
        call_timeout_ms=10_000,
        env={"DAPR_API_TOKEN": "s3cret"},
    )
    assert (cfg.address, cfg.api_token, cfg.policy.dead_letter_topic) == ("127.0.0.1:50001", "s3cret", "dlq")


def test_policy_backoff_grows_to_its_cap() -> None:
    policy = HandOffPolicy(base_s=1, cap_s=60, multiplier=2)
    assert [policy.delay_ms(n) for n in (1, 2, 3, 7, 8, 50)] == [1000, 2000, 4000, 60_000, 60_000, 60_000]


def test_from_settings_reads_the_component_metadata() -> None:
    settings = parse_settings(
        {
            "redisHost": "127.0.0.1:1",
            "consumerID": "app9",
            "daprGrpcAddress": "127.0.0.1:7777",
            "deadLetterTopic": "undeliverable",
            "processingTimeout": "90s",
            "handoffTimeout": "30s",
        }
    )
    fwd = Forwarder.from_settings(
        aioredis.Redis(port=1), settings, SystemClock(), None, name="d", env={"DAPR_API_TOKEN": "t"}
    )
    assert fwd.keys.outbox == "{app9-delayed}:outbox"
    assert fwd.config.address == "127.0.0.1:7777"
    assert fwd.config.api_token == "t"
    assert fwd.config.policy.dead_letter_topic == "undeliverable"
    assert fwd.config.claim_idle_ms == 90_000
    assert fwd.config.call_timeout_s == 30


# --- the real stack -------------------------------------------------------------


@dataclass
class Sidecar:
    """Redis + the subscriber app + daprd with the built-in target pub/subs."""

    daprd_path: str
    workdir: Path
    redis: RedisServer
    app_port: int
    ports: DaprdPorts
    resources: Path
    daprd: ManagedProcess
    subscriber: ManagedProcess

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.ports.grpc}"

    def start_daprd(self) -> None:
        self.daprd = harness.start_daprd(
            self.daprd_path,
            self.workdir,
            self.workdir / "sockets",
            APP_ID,
            self.app_port,
            self.resources,
            self.ports,
        )
        base = f"http://127.0.0.1:{self.ports.http}/v1.0/metadata"
        want = {tuple(s.split("=", 1)) for s in SUBSCRIPTIONS}

        def loaded() -> bool:
            meta = httpx.get(base, timeout=2).json()
            return want <= {(x["pubsubname"], x["topic"]) for x in meta.get("subscriptions", [])}

        harness.wait_until_blocking(loaded, "daprd to load the subscriptions", 30, process=self.daprd)

    def kill_daprd(self) -> None:
        """SIGKILL: no graceful drain, as a crash or an OOM kill."""
        proc = self.daprd.proc
        assert proc is not None
        proc.kill()
        proc.wait(timeout=10)
        self.daprd.stop()


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    daprd_path = harness.find_daprd()
    workdir = Path(tmp_path_factory.mktemp("fwd"))
    server = RedisServer(workdir / "redis")
    server.start()
    resources = workdir / "resources"
    resources.mkdir()
    (workdir / "sockets").mkdir()
    (resources / "target.yaml").write_text(
        harness.component_yaml(
            "target", {"redisHost": f"127.0.0.1:{server.port}", "redisDB": str(TARGET_DB)}, "pubsub.redis"
        )
    )
    (resources / "mem.yaml").write_text(harness.component_yaml("mem", {}, "pubsub.in-memory"))
    app_port = free_port()
    subscriber = harness.start_subscriber(workdir, app_port, SUBSCRIPTIONS)
    # daprd is filled in by start_daprd; the app stands in until then.
    s = Sidecar(daprd_path, workdir, server, app_port, DaprdPorts.free(), resources, subscriber, subscriber)
    try:
        s.start_daprd()
        yield s
    finally:
        s.daprd.stop()
        subscriber.stop()
        server.stop()


@pytest.fixture
def outbox_db(sidecar: Sidecar) -> Iterator[Any]:
    """Database 0 (our outbox, history, dead letters), emptied for each test."""
    client = sidecar.redis.client(db=0)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture
async def make_forwarder(sidecar: Sidecar, outbox_db: Any) -> AsyncIterator[Callable[..., Forwarder]]:
    made: list[Forwarder] = []
    clients: list[aioredis.Redis] = []
    metrics = Metrics(CollectorRegistry())

    def make(**overrides: Any) -> Forwarder:
        client = aioredis.Redis(host="127.0.0.1", port=sidecar.redis.port, db=0)
        clients.append(client)
        policy = overrides.pop("policy", HandOffPolicy(max_attempts=3, base_s=0.2, cap_s=1.0))
        settings: dict[str, Any] = {
            "address": sidecar.grpc_address,
            "block_ms": 200,
            "call_timeout_s": 5,
            "sidecar_backoff_base_s": 0.1,
            "sidecar_backoff_cap_s": 0.5,
        }
        config = ForwarderConfig(policy=policy, **{**settings, **overrides})
        fwd = Forwarder(client, KEYS, SystemClock(), config, metrics.forwarder, name="delayed")
        made.append(fwd)
        return fwd

    make.metrics = metrics  # type: ignore[attr-defined]
    yield make
    for f in made:
        await f.close()
    for c in clients:
        await c.aclose()


def cloudevent(marker: str, **data: Any) -> bytes:
    """A CloudEvent as daprd builds it around a publish to our component (compact, as Go writes it)."""
    return json.dumps(
        {
            "data": {"marker": marker, **data},
            "datacontenttype": "application/json",
            "id": str(uuid.uuid4()),
            "pubsubname": "delayed",
            "source": "publisher-app",
            "specversion": "1.0",
            "time": "2026-11-26T07:00:00Z",
            "topic": "orders",
            "traceid": "00-00000000000000000000000000000000-0000000000000000-00",
            "type": "com.dapr.event.sent",
        },
        separators=(",", ":"),
    ).encode()


def add(client: Any, entry: OutboxEntry) -> str:
    return str(client.xadd(KEYS.outbox, encode_outbox_entry(entry)).decode())


async def arrivals(sidecar: Sidecar, marker: str, route: str | None = None) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=10) as http:
        got: list[dict[str, Any]] = (await http.get(f"http://127.0.0.1:{sidecar.app_port}/arrivals")).json()
    return [a for a in got if marker in a["body"] and (route is None or a["route"] == route)]


async def wait_for(check: Callable[[], Awaitable[bool]], within: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not await check():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(0.05)


async def wait_arrivals(
    sidecar: Sidecar, marker: str, count: int, within: float = 15, route: str | None = None
) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []

    async def enough() -> bool:
        nonlocal found
        found = await arrivals(sidecar, marker, route)
        return len(found) >= count

    await wait_for(enough, within, f"{count} arrival(s) of {marker}")
    return found


def header(arrival: Mapping[str, Any], key: str) -> str | None:
    return next((str(v) for k, v in arrival["headers"].items() if k.lower() == key.lower()), None)


def history(client: Any) -> list[Any]:
    return [decode_record(i, f) for i, f in client.xrange(KEYS.history)]


def outbox_left(client: Any) -> tuple[int, int]:
    """(entries in the outbox, entries pending in its group)."""
    length = int(client.xlen(KEYS.outbox))
    try:
        pending = int(client.xpending(KEYS.outbox, "forwarder")["pending"])
    except redis.ResponseError:
        pending = 0
    return length, pending


pytestmark = pytest.mark.e2e


async def test_due_message_reaches_the_builtin_redis_byte_for_byte_with_its_cloudevent_id(
    sidecar: Sidecar, outbox_db: Any, make_forwarder: Callable[..., Forwarder]
) -> None:
    marker = f"one-{uuid.uuid4().hex[:8]}"
    data = cloudevent(marker)
    metadata = {"customer": "acme-42", "scheduler": "s-1", "scheduleNext": "purge"}
    entry_id = add(
        outbox_db, OutboxEntry(pubsub="target", topic="orders", data=data, id="s-1", metadata=metadata)
    )
    make_forwarder().start()
    [arrival] = await wait_arrivals(sidecar, marker, 1, route="/events/target/orders")
    sent = json.loads(data)
    assert arrival["id"] == sent["id"]
    assert arrival["data"] == sent["data"]
    # One CloudEvent, not one wrapped in another: the app sees the original's fields.
    assert json.loads(arrival["body"])["source"] == "publisher-app"
    assert header(arrival, "customer") == "acme-42"
    assert header(arrival, "scheduleNext") == "purge"
    assert header(arrival, "scheduler") == "s-1"
    # On the target's own Redis stream the bytes are the ones we were given.
    target: Any = sidecar.redis.client(db=TARGET_DB)
    stored = [f[b"data"] for _, f in target.xrange("orders") if marker.encode() in f[b"data"]]
    target.close()
    assert stored == [data]
    # Settled: acked and gone from the outbox, one hand-off record in the history.
    await wait_for(lambda: asyncio.sleep(0, outbox_left(outbox_db) == (0, 0)), 5, "the outbox to empty")
    [record] = history(outbox_db)
    assert (record.event, record.id, record.topic, record.size_bytes) == (
        "handedoff",
        "s-1",
        "orders",
        len(data),
    )
    assert entry_id not in {i.decode() for i, _ in outbox_db.xrange(KEYS.outbox)}
    await asyncio.sleep(1)
    assert len(await arrivals(sidecar, marker)) == 1, "delivered twice"


async def test_in_memory_target_receives_the_same_cloudevent(
    sidecar: Sidecar, outbox_db: Any, make_forwarder: Callable[..., Forwarder]
) -> None:
    marker = f"mem-{uuid.uuid4().hex[:8]}"
    data = cloudevent(marker)
    add(outbox_db, OutboxEntry(pubsub="mem", topic="orders", data=data, id="m1"))
    make_forwarder().start()
    [arrival] = await wait_arrivals(sidecar, marker, 1, route="/events/mem/orders")
    assert arrival["id"] == json.loads(data)["id"]
    assert arrival["data"] == {"marker": marker}


async def test_bulk_entries_go_out_together_and_are_recorded_as_one_hand_off(
    sidecar: Sidecar, outbox_db: Any, make_forwarder: Callable[..., Forwarder]
) -> None:
    marker = f"bulk-{uuid.uuid4().hex[:8]}"
    events = [cloudevent(marker, n=n) for n in range(5)]
    for n, data in enumerate(events):
        add(
            outbox_db,
            OutboxEntry(
                pubsub="target",
                topic="bulk",
                data=data,
                id="env-9",
                bulk="env-9",
                metadata={"n": str(n)},
                content_type="application/cloudevents+json",
            ),
        )
    make_forwarder().start()
    got = await wait_arrivals(sidecar, marker, 5, route="/events/target/bulk")
    assert sorted(a["data"]["n"] for a in got) == [0, 1, 2, 3, 4]
    assert {a["id"] for a in got} == {json.loads(e)["id"] for e in events}
    await wait_for(lambda: asyncio.sleep(0, outbox_left(outbox_db) == (0, 0)), 5, "the outbox to empty")
    [record] = history(outbox_db)
    assert (record.event, record.id, record.size_bytes) == ("handedoff", "env-9", sum(map(len, events)))


async def test_expired_entry_is_dropped_and_a_live_one_delivered(
    sidecar: Sidecar, outbox_db: Any, make_forwarder: Callable[..., Forwarder]
) -> None:
    stale, live = f"stale-{uuid.uuid4().hex[:8]}", f"live-{uuid.uuid4().hex[:8]}"
    now = SystemClock().now_ms()
    add(outbox_db, OutboxEntry("target", "orders", cloudevent(stale), id="x1", expires_at_ms=now - 1))
    add(outbox_db, OutboxEntry("target", "orders", cloudevent(live), id="x2", expires_at_ms=now + 60_000))
    make_forwarder().start()
    await wait_arrivals(sidecar, live, 1)
    await asyncio.sleep(0.5)
    assert await arrivals(sidecar, stale) == []
    events = {(r.id, r.event) for r in history(outbox_db)}
    assert events == {("x1", "expired"), ("x2", "handedoff")}


async def test_unknown_target_is_reported_and_dead_lettered_after_the_last_attempt_without_blocking_others(
    sidecar: Sidecar, outbox_db: Any, make_forwarder: Callable[..., Forwarder]
) -> None:
    bad, good = f"bad-{uuid.uuid4().hex[:8]}", f"good-{uuid.uuid4().hex[:8]}"
    bad_data = cloudevent(bad)
    add(outbox_db, OutboxEntry("no-such-pubsub", "orders", bad_data, id="b1", metadata={"customer": "c"}))
    add(outbox_db, OutboxEntry("target", "orders", cloudevent(good), id="g1"))
    fwd = make_forwarder(policy=HandOffPolicy(max_attempts=3, base_s=0.2, cap_s=0.5, dead_letter_topic="dlq"))
    fwd.start()
    # The good one is not held behind the bad one's retries.
    await wait_arrivals(sidecar, good, 1, within=5)

    async def dead_lettered() -> bool:
        # Written, then settled: the outbox entry goes after its dead letter is in.
        return int(outbox_db.xlen("dlq")) == 1 and outbox_left(outbox_db) == (0, 0)

    await wait_for(dead_lettered, 20, "the dead letter")
    [(_, fields)] = outbox_db.xrange("dlq")
    assert fields[b"data"] == bad_data
    meta = json.loads(fields[b"metadata"])
    assert meta["customer"] == "c"
    assert meta["deadLetterPubsub"] == "no-such-pubsub"
    assert "no-such-pubsub" in meta["deadLetterReason"]
    assert outbox_left(outbox_db) == (0, 0)
    records = [r for r in history(outbox_db) if r.id == "b1"]
    assert [(r.event, r.attempt) for r in records] == [("deadlettered", 3)]
    registry = make_forwarder.metrics.registry  # type: ignore[attr-defined]
    failures = registry.get_sample_value(
        "delayed_pubsub_handoff_failures_total", {"instance": "delayed", "reason": "unknown_target"}
    )
    assert failures == 3
    assert (
        registry.get_sample_value(
            "delayed_pubsub_handoff_dead_lettered_messages_total", {"instance": "delayed"}
        )
        == 1
    )


async def test_without_a_dead_letter_topic_a_refused_message_is_kept_and_retried(
    sidecar: Sidecar, outbox_db: Any, make_forwarder: Callable[..., Forwarder]
) -> None:
    add(outbox_db, OutboxEntry("no-such-pubsub", "orders", cloudevent("kept"), id="k1"))
    make_forwarder(policy=HandOffPolicy(max_attempts=2, base_s=0.1, cap_s=0.3)).start()

    async def tried_a_lot() -> bool:
        try:
            rows = outbox_db.xpending_range(KEYS.outbox, "forwarder", "-", "+", 10)
        except redis.ResponseError:  # the forwarder has not created its group yet
            return False
        return bool(rows) and int(rows[0]["times_delivered"]) >= 4

    await wait_for(tried_a_lot, 15, "more attempts than max_attempts")
    assert outbox_left(outbox_db) == (1, 1)
    assert history(outbox_db) == []


async def test_malformed_entry_is_dead_lettered_at_once(
    sidecar: Sidecar, outbox_db: Any, make_forwarder: Callable[..., Forwarder]
) -> None:
    outbox_db.xadd(KEYS.outbox, {"data": b"orphan", "topic": b"orders"})
    make_forwarder(policy=HandOffPolicy(dead_letter_topic="dlq")).start()

    async def dead_lettered() -> bool:
        # Written, then settled: the outbox entry goes after its dead letter is in.
        return int(outbox_db.xlen("dlq")) == 1 and outbox_left(outbox_db) == (0, 0)

    await wait_for(dead_lettered, 5, "the dead letter")
    [(_, fields)] = outbox_db.xrange("dlq")
    assert fields[b"data"] == b"orphan"
    assert outbox_left(outbox_db) == (0, 0)


async def test_entries_held_by_a_dead_replica_are_claimed_and_delivered(
    sidecar: Sidecar, outbox_db: Any, make_forwarder: Callable[..., Forwarder]
) -> None:
    marker = f"orphaned-{uuid.uuid4().hex[:8]}"
    outbox_db.xgroup_create(KEYS.outbox, "forwarder", id="0", mkstream=True)
    add(outbox_db, OutboxEntry("target", "orders", cloudevent(marker), id="d1"))
    # A replica read it and died before publishing.
    outbox_db.xreadgroup("forwarder", "dead-replica", {KEYS.outbox: ">"})
    make_forwarder(claim_idle_ms=1500).start()
    await asyncio.sleep(1.0)
    assert await arrivals(sidecar, marker) == [], "claimed before claim_idle_ms"
    await wait_arrivals(sidecar, marker, 1, within=10)
    await wait_for(lambda: asyncio.sleep(0, outbox_left(outbox_db) == (0, 0)), 5, "the outbox to empty")
    [record] = history(outbox_db)
    assert (record.event, record.attempt) == ("handedoff", 2)


async def test_three_replicas_hand_each_message_off_once(
    sidecar: Sidecar, outbox_db: Any, make_forwarder: Callable[..., Forwarder]
) -> None:
    marker = f"race-{uuid.uuid4().hex[:8]}"
    n = 200
    for i in range(n):
        add(outbox_db, OutboxEntry("target", "race", cloudevent(marker, n=i), id=f"r{i}"))
    for _ in range(3):
        make_forwarder(batch_size=10, claim_idle_ms=60_000).start()
    got = await wait_arrivals(sidecar, marker, n, within=60)
    await asyncio.sleep(1)
    got = await arrivals(sidecar, marker)
    assert sorted(a["data"]["n"] for a in got) == list(range(n))
    assert len([r for r in history(outbox_db) if r.event == "handedoff"]) == n


@pytest.mark.slow
async def test_daprd_killed_and_restarted_while_entries_wait_loses_nothing(
    sidecar: Sidecar, outbox_db: Any, make_forwarder: Callable[..., Forwarder]
) -> None:
    marker = f"restart-{uuid.uuid4().hex[:8]}"
    n = 30
    events = [cloudevent(marker, n=i) for i in range(n)]
    fwd = make_forwarder(policy=HandOffPolicy(max_attempts=2, base_s=0.2, cap_s=0.5, dead_letter_topic="dlq"))
    fwd.start()
    # The first third goes while daprd is up, the rest is due while it is dead.
    for i in range(10):
        add(outbox_db, OutboxEntry("target", "restart", events[i], id=f"e{i}"))
    await wait_arrivals(sidecar, marker, 10)
    await asyncio.to_thread(sidecar.kill_daprd)
    for i in range(10, n):
        add(outbox_db, OutboxEntry("target", "restart", events[i], id=f"e{i}"))
    await asyncio.sleep(3)  # many uncounted retries against a dead sidecar
    assert outbox_left(outbox_db)[0] == n - 10, "an entry was dropped or dead-lettered while daprd was down"
    await asyncio.to_thread(sidecar.start_daprd)
    got = await wait_arrivals(sidecar, marker, n, within=30)
    await asyncio.sleep(1)
    got = await arrivals(sidecar, marker)
    by_n: dict[int, set[str]] = {}
    for a in got:
        by_n.setdefault(a["data"]["n"], set()).add(a["id"])
    assert sorted(by_n) == list(range(n)), "a message never arrived"
    # Duplicates are allowed (at least once), but only with the original CloudEvent id.
    assert all(ids == {json.loads(events[k])["id"]} for k, ids in by_n.items())
    assert int(outbox_db.xlen("dlq")) == 0
    await wait_for(lambda: asyncio.sleep(0, outbox_left(outbox_db) == (0, 0)), 10, "the outbox to empty")


# --- a sidecar that answers late ------------------------------------------------


class LateSidecar(dapr_pb2_grpc.DaprServicer):
    """Dapr's runtime API posing as the sidecar: PublishEvent answers at once, except for
    data carrying `late_marker`, which it answers after `late_s` (past the forwarder's
    call timeout). Every call is recorded (loop time, data) as it comes in."""

    def __init__(self, late_marker: bytes, late_s: float) -> None:
        self.late_marker = late_marker
        self.late_s = late_s
        self.calls: list[tuple[float, bytes]] = []

    async def PublishEvent(self, request: Any, context: Any) -> empty_pb2.Empty:
        self.calls.append((asyncio.get_running_loop().time(), bytes(request.data)))
        if self.late_marker in request.data:
            await asyncio.sleep(self.late_s)
        return empty_pb2.Empty()

    def called(self, marker: str) -> list[float]:
        return [t for t, data in self.calls if marker.encode() in data]


@asynccontextmanager
async def late_sidecar_at(socket_path: Path, late_marker: str, late_s: float) -> AsyncIterator[LateSidecar]:
    server = grpc.aio.server()
    sidecar = LateSidecar(late_marker.encode(), late_s)
    dapr_pb2_grpc.add_DaprServicer_to_server(sidecar, server)  # type: ignore[no-untyped-call]
    server.add_insecure_port(f"unix://{socket_path}")
    await server.start()
    try:
        yield sidecar
    finally:
        await server.stop(0)


async def test_a_sidecar_answering_late_counts_each_call_and_dead_letters_without_holding_up_the_others(
    redis_server: RedisServer, redis_client: Any, socket_path: Path
) -> None:
    """A publish answered after the call timeout reached daprd (it may have been carried
    out): each one is an attempt, the message is dead-lettered after the last, and the
    messages behind it are handed off while its first call is still waiting."""
    slow, quick = f"slow-{uuid.uuid4().hex[:8]}", f"quick-{uuid.uuid4().hex[:8]}"
    timeout_s = 2.0
    metrics = Metrics(CollectorRegistry())
    client = aioredis.Redis(port=redis_server.port)
    config = ForwarderConfig(
        address=f"unix://{socket_path}",
        policy=HandOffPolicy(max_attempts=3, base_s=0.2, cap_s=0.5, dead_letter_topic="dlq"),
        block_ms=200,
        call_timeout_s=timeout_s,
    )
    fwd = Forwarder(client, KEYS, SystemClock(), config, metrics.forwarder, name="delayed")
    async with late_sidecar_at(socket_path, slow, late_s=2.5 * timeout_s) as sidecar:
        try:
            add(redis_client, OutboxEntry("target", "orders", cloudevent(slow), id="slow-1"))
            fwd.start()
            await wait_for(lambda: asyncio.sleep(0, bool(sidecar.called(slow))), 10, "the late call")
            for n in range(5):
                add(redis_client, OutboxEntry("target", "orders", cloudevent(quick, n=n), id=f"quick-{n}"))
            await wait_for(
                lambda: asyncio.sleep(0, len(sidecar.called(quick)) >= 5), 10, "the 5 calls behind it"
            )
            # On time: while the late call's first attempt was still waiting for its answer.
            first = sidecar.called(slow)[0]
            assert max(sidecar.called(quick)) < first + timeout_s, "held up behind the late call"
            assert len(sidecar.called(slow)) == 1

            async def dead_lettered() -> bool:
                return int(redis_client.xlen("dlq")) == 1 and outbox_left(redis_client) == (0, 0)

            await wait_for(dead_lettered, 30, "the late message's dead letter")
            await asyncio.sleep(1.5 * timeout_s)  # a fourth call would come now, if ever
        finally:
            await fwd.close()
            await client.aclose()
    calls = sidecar.called(slow)
    assert len(calls) == 3, f"{len(calls)} calls for 3 attempts"
    # Each attempt after the previous one's timeout: never two at once.
    assert all(b - a >= timeout_s for a, b in itertools.pairwise(calls))
    assert len(sidecar.called(quick)) == 5
    records = history(redis_client)
    assert sorted(r.id for r in records if r.event == "handedoff") == [f"quick-{n}" for n in range(5)]
    assert [(r.event, r.attempt) for r in records if r.id == "slow-1"] == [("deadlettered", 3)]
    [(_, fields)] = redis_client.xrange("dlq")
    assert "DEADLINE_EXCEEDED" in json.loads(fields[b"metadata"])["deadLetterReason"]
    timeouts = metrics.registry.get_sample_value(
        "delayed_pubsub_handoff_failures_total", {"instance": "delayed", "reason": "timeout"}
    )
    assert timeouts == 3


async def test_hand_offs_that_end_together_share_their_settles_and_reads(
    redis_server: RedisServer, redis_client: Any, socket_path: Path
) -> None:
    """Each hand-off is its own task, but its Redis work is not one round trip each: hand-offs
    answered together settle in one MULTI, and new entries are read many at a time. Every
    message still goes out once, with its own history record."""
    n = 400
    for i in range(n):
        add(redis_client, OutboxEntry("target", "orders", cloudevent("together", n=i), id=f"t-{i}"))
    client = aioredis.Redis(port=redis_server.port)
    config = ForwarderConfig(address=f"unix://{socket_path}", block_ms=200)
    fwd = Forwarder(client, KEYS, SystemClock(), config, name="delayed")
    async with late_sidecar_at(socket_path, "never-late", late_s=0) as sidecar:
        redis_client.config_resetstat()
        fwd.start()
        try:

            async def drained() -> bool:
                return outbox_left(redis_client) == (0, 0)

            await wait_for(drained, 60, "every hand-off to be settled")
        finally:
            await fwd.close()
            await client.aclose()
    stats = redis_client.info("commandstats")

    def calls(command: str) -> int:
        return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))

    assert len(sidecar.calls) == n
    assert len({data for _, data in sidecar.calls}) == n, "a message handed off twice"
    records = history(redis_client)
    assert sorted(r.id for r in records if r.event == "handedoff") == sorted(f"t-{i}" for i in range(n))
    # One settle per MULTI and a read per freed slot would be n of each.
    assert calls("exec") <= n // 3, f"{calls('exec')} MULTIs for {n} hand-offs"
    assert calls("xreadgroup") <= n // 10, f"{calls('xreadgroup')} reads for {n} hand-offs"


class _CutsTheFirstSettle(_Proxy):
    """Forwards to Redis, except the first client->Redis chunk naming XACK once armed: that
    connection is closed with the chunk unsent, so the MULTI in it never runs."""

    def __init__(self, upstream_port: int) -> None:
        super().__init__(upstream_port)
        self.armed = False

    def _pumps(
        self,
        client_r: asyncio.StreamReader,
        client_w: asyncio.StreamWriter,
        redis_r: asyncio.StreamReader,
        redis_w: asyncio.StreamWriter,
    ) -> tuple[Pump, Pump]:
        async def upstream() -> None:
            while data := await client_r.read(65536):
                if self.armed and b"XACK" in data:
                    self.armed = False
                    return
                redis_w.write(data)
                await redis_w.drain()

        async def downstream() -> None:
            while data := await redis_r.read(65536):
                client_w.write(data)
                await client_w.drain()

        return upstream, downstream


async def test_a_shared_settle_that_fails_leaves_each_of_its_hand_offs_pending_and_retried(
    redis_server: RedisServer, redis_client: Any, socket_path: Path
) -> None:
    """Hand-offs answered together share one MULTI; when it never reaches Redis each of them
    fails as its own settle would: its entry stays pending under the forwarder's name and is
    handed off again after its backoff (at least once), never lost, then settled once."""
    n = 60
    for i in range(n):
        add(redis_client, OutboxEntry("target", "orders", cloudevent("cut", n=i), id=f"c-{i}"))
    proxy = _CutsTheFirstSettle(redis_server.port)
    await proxy.start()
    try:
        # No command sent twice, as the component's node clients: the cut fails the MULTI.
        client = aioredis.Redis(port=proxy.port, retry=Retry(NoBackoff(), 0))
        policy = HandOffPolicy(max_attempts=5, base_s=0.2, cap_s=0.5)
        config = ForwarderConfig(address=f"unix://{socket_path}", policy=policy, block_ms=200)
        fwd = Forwarder(client, KEYS, SystemClock(), config, name="delayed")
        async with late_sidecar_at(socket_path, "never-late", late_s=0) as sidecar:
            proxy.armed = True
            fwd.start()
            try:

                async def drained() -> bool:
                    return outbox_left(redis_client) == (0, 0)

                await wait_for(drained, 30, "every hand-off to be settled")
            finally:
                await fwd.close()
                await client.aclose()
    finally:
        await proxy.stop()
    assert not proxy.armed, "no settle was cut"
    per_message = collections.Counter(data for _, data in sidecar.calls)
    assert len(per_message) == n, "a message lost"
    twice = [data for data, count in per_message.items() if count == 2]
    # Every hand-off of the cut MULTI went out again; no other did.
    assert len(twice) >= 2, f"{len(twice)} handed off again: the cut MULTI held fewer than 2 settles"
    assert set(per_message.values()) <= {1, 2}
    records = [r for r in history(redis_client) if r.event == "handedoff"]
    assert sorted(r.id for r in records) == sorted(f"c-{i}" for i in range(n))
    assert sorted(r.attempt for r in records).count(2) == len(twice)


async def test_a_holder_stalled_past_the_takeover_time_does_not_publish_what_another_took_over(
    redis_server: RedisServer,
    redis_client: Any,
    socket_path: Path,
    slow_claims: DelayingProxy,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A forwarder that cannot keep its hand-off (its Redis holds every claim 4 s, past the
    1.5 s takeover time) loses it to a second forwarder, as a dead one would; when daprd
    answers, only the second publishes it: the first asks Redis before its attempt and
    drops what is no longer its own."""
    marker = f"stalled-{uuid.uuid4().hex[:8]}"
    add(redis_client, OutboxEntry("target", "orders", cloudevent(marker), id="stalled-1"))
    clients = [aioredis.Redis(port=slow_claims.port), aioredis.Redis(port=redis_server.port)]
    config = ForwarderConfig(
        address=f"unix://{socket_path}",
        block_ms=200,
        claim_idle_ms=1500,
        sidecar_backoff_base_s=0.1,
        sidecar_backoff_cap_s=0.3,
    )
    stalled, taker = (Forwarder(c, KEYS, SystemClock(), config, name="delayed") for c in clients)

    def holder() -> str | None:
        try:
            rows = redis_client.xpending_range(KEYS.outbox, "forwarder", "-", "+", 1)
        except redis.ResponseError:  # no group yet
            return None
        return rows[0]["consumer"].decode() if rows else None

    try:
        stalled.start()
        await wait_for(
            lambda: asyncio.sleep(0, holder() == stalled.consumer), 10, "the first forwarder's read"
        )
        slow_claims.delay_s, slow_claims.armed = 4.0, True
        taker.start()
        await wait_for(lambda: asyncio.sleep(0, holder() == taker.consumer), 10, "the takeover")
        async with late_sidecar_at(socket_path, "never-late", 0) as sidecar:

            async def settled_and_dropped() -> bool:
                return outbox_left(redis_client) == (0, 0) and "taken over by another replica" in caplog.text

            await wait_for(settled_and_dropped, 20, "the hand-off, and the first forwarder letting go")
            await asyncio.sleep(0.5)
    finally:
        for f in (stalled, taker):
            await f.close()
        for c in clients:
            await c.aclose()
    assert len(sidecar.called(marker)) == 1, "published by both forwarders"
    assert [(r.event, r.attempt) for r in history(redis_client)] == [("handedoff", 2)]


async def test_a_message_that_expires_while_waiting_for_a_call_slot_is_dropped_not_published(
    redis_server: RedisServer, redis_client: Any, socket_path: Path
) -> None:
    """With every call slot taken by a call the sidecar answers late, a message whose
    expiresAt passes while it waits for a slot is dropped as expired when its turn comes:
    never handed to the target after its expiry (with a made-up ttlInSeconds of 1)."""
    slow, short = f"slow-{uuid.uuid4().hex[:8]}", f"short-{uuid.uuid4().hex[:8]}"
    timeout_s = 2.0
    client = aioredis.Redis(port=redis_server.port)
    config = ForwarderConfig(
        address=f"unix://{socket_path}",
        policy=HandOffPolicy(max_attempts=3, base_s=5, cap_s=5),
        block_ms=200,
        concurrency=1,
        call_timeout_s=timeout_s,
    )
    fwd = Forwarder(client, KEYS, SystemClock(), config, name="delayed")
    async with late_sidecar_at(socket_path, slow, late_s=2 * timeout_s) as sidecar:
        try:
            add(redis_client, OutboxEntry("target", "orders", cloudevent(slow), id="slow-1"))
            fwd.start()
            await wait_for(lambda: asyncio.sleep(0, bool(sidecar.called(slow))), 10, "the late call")
            # Read while the only slot is taken; it expires long before the slot is free.
            expires = int(time.time() * 1000) + 500
            add(
                redis_client,
                OutboxEntry("target", "orders", cloudevent(short), id="short-1", expires_at_ms=expires),
            )

            async def short_settled() -> bool:
                return any(r.id == "short-1" for r in history(redis_client))

            await wait_for(short_settled, 10, "the expiring message's end")
        finally:
            await fwd.close()
            await client.aclose()
    assert sidecar.called(short) == [], "published after its expiry"
    assert [r.event for r in history(redis_client) if r.id == "short-1"] == ["expired"]


async def test_a_forwarder_closed_during_a_call_lets_it_finish_and_settles_what_daprd_took(
    redis_server: RedisServer, redis_client: Any, socket_path: Path
) -> None:
    """close() while a publish call is on its way (the sidecar answers it 1 s later) waits for
    the answer and settles the entry: the forwarder that starts next publishes nothing again
    (before: the call was cut off, the entry left pending, and the next forwarder published it
    a second time once the takeover time had passed)."""
    marker = f"inflight-{uuid.uuid4().hex[:8]}"
    clients = [aioredis.Redis(port=redis_server.port) for _ in range(2)]
    config = ForwarderConfig(
        address=f"unix://{socket_path}", block_ms=200, claim_idle_ms=1500, call_timeout_s=5
    )
    first, second = (Forwarder(c, KEYS, SystemClock(), config, name="delayed") for c in clients)
    async with late_sidecar_at(socket_path, marker, late_s=1.0) as sidecar:
        try:
            add(redis_client, OutboxEntry("target", "orders", cloudevent(marker), id="inflight-1"))
            first.start()
            await wait_for(lambda: asyncio.sleep(0, bool(sidecar.called(marker))), 10, "the call")
            await first.close()
            left = outbox_left(redis_client)
            second.start()
            # Past the takeover time (1.5 s idle): a pending entry would be taken over and sent now.
            await asyncio.sleep(3.0)
        finally:
            for f in (first, second):
                await f.close()
            for c in clients:
                await c.aclose()
    assert left == (0, 0), "left pending by close()"
    assert len(sidecar.called(marker)) == 1, "published again after close()"
    assert [(r.id, r.event) for r in history(redis_client)] == [("inflight-1", "handedoff")]


@pytest.fixture(scope="module")
def token_daprd(sidecar: Sidecar) -> Iterator[DaprdPorts]:
    """A second daprd that demands an API token, with only an in-memory pub/sub (`mem`)."""
    resources = sidecar.workdir / "token-resources"
    resources.mkdir()
    (resources / "mem.yaml").write_text(harness.component_yaml("mem", {}, "pubsub.in-memory"))
    workdir = sidecar.workdir / "token"
    workdir.mkdir()
    ports = DaprdPorts.free()
    with pytest.MonkeyPatch.context() as mp:
        # daprd demands the token on its APIs when started with it in its environment.
        mp.setenv("DAPR_API_TOKEN", "s3cret-token")
        # Its own app-id: the app's `target` subscriptions fail there (no such pub/sub) and
        # `mem` is its own in-memory bus, so the first daprd's tests see nothing of it.
        proc = harness.start_daprd(
            sidecar.daprd_path,
            workdir,
            sidecar.workdir / "sockets",
            "fwd-token",
            sidecar.app_port,
            resources,
            ports,
        )
    yield ports
    proc.stop()


async def test_the_api_token_is_sent_and_required(
    sidecar: Sidecar,
    token_daprd: DaprdPorts,
    outbox_db: Any,
    make_forwarder: Callable[..., Forwarder],
) -> None:
    marker = f"token-{uuid.uuid4().hex[:8]}"
    add(outbox_db, OutboxEntry("mem", "orders", cloudevent(marker), id="t1"))
    wrong = make_forwarder(
        address=f"127.0.0.1:{token_daprd.grpc}",
        policy=HandOffPolicy(max_attempts=1, base_s=0.1, cap_s=0.2, dead_letter_topic="dlq"),
    )
    wrong.start()

    async def refused() -> bool:
        # Written, then settled: the outbox entry goes after its dead letter is in.
        return int(outbox_db.xlen("dlq")) == 1 and outbox_left(outbox_db) == (0, 0)

    await wait_for(refused, 10, "the token-less hand-off to be refused")
    [(_, fields)] = outbox_db.xrange("dlq")
    assert "UNAUTHENTICATED" in json.loads(fields[b"metadata"])["deadLetterReason"]
    await wrong.close()

    add(outbox_db, OutboxEntry("mem", "orders", cloudevent(marker), id="t2"))
    make_forwarder(address=f"127.0.0.1:{token_daprd.grpc}", api_token="s3cret-token").start()
    [arrival] = await wait_arrivals(sidecar, marker, 1, route="/events/mem/orders")
    assert arrival["data"] == {"marker": marker}


async def test_an_expiry_of_2_pow_63_is_no_overflow(
    sidecar: Sidecar, outbox_db: Any, make_forwarder: Callable[..., Forwarder]
) -> None:
    marker = f"far-{uuid.uuid4().hex[:8]}"
    add(outbox_db, OutboxEntry("target", "orders", cloudevent(marker), id="f1", expires_at_ms=2**63 - 1))
    make_forwarder().start()
    await wait_arrivals(sidecar, marker, 1)
    assert [r.event for r in history(outbox_db)] == ["handedoff"]


async def test_a_message_too_large_for_daprd_is_dead_lettered_not_retried_forever(
    sidecar: Sidecar, outbox_db: Any, make_forwarder: Callable[..., Forwarder]
) -> None:
    big = b'{"specversion":"1.0","id":"big","data":"' + b"x" * (5 << 20) + b'"}'
    add(outbox_db, OutboxEntry("target", "orders", big, id="big"))
    make_forwarder(
        policy=HandOffPolicy(max_attempts=2, base_s=0.1, cap_s=0.2, dead_letter_topic="dlq")
    ).start()

    async def dead_lettered() -> bool:
        # Written, then settled: the outbox entry goes after its dead letter is in.
        return int(outbox_db.xlen("dlq")) == 1 and outbox_left(outbox_db) == (0, 0)

    await wait_for(dead_lettered, 20, "the oversized message to be dead-lettered")
    [(_, fields)] = outbox_db.xrange("dlq")
    assert fields[b"data"] == big
    # daprd's gRPC server refuses it (4 MiB by default): a refusal, counted, not "sidecar down".
    assert "RESOURCE_EXHAUSTED" in json.loads(fields[b"metadata"])["deadLetterReason"]
    assert outbox_left(outbox_db) == (0, 0)


async def test_the_loop_survives_its_redis_restarting_and_losing_everything(
    sidecar: Sidecar, tmp_path: Path, make_forwarder: Callable[..., Forwarder]
) -> None:
    """The outbox on a Redis of its own (the target stays on the sidecar's): restarted, then wiped."""
    own = RedisServer(tmp_path / "outbox-redis")
    own.start()
    client = aioredis.Redis(port=own.port)
    sync: Any = own.client()
    fwd = Forwarder(
        client,
        KEYS,
        SystemClock(),
        ForwarderConfig(address=sidecar.grpc_address, block_ms=200),
        name="own",
    )
    try:
        fwd.start()
        markers = [f"survive{i}-{uuid.uuid4().hex[:8]}" for i in range(3)]
        add(sync, OutboxEntry("target", "orders", cloudevent(markers[0]), id="s0"))
        await wait_arrivals(sidecar, markers[0], 1)
        sync.close()
        await asyncio.to_thread(own.restart)  # SIGTERM: the AOF keeps what was acked and deleted
        sync = own.client()
        add(sync, OutboxEntry("target", "orders", cloudevent(markers[1]), id="s1"))
        await wait_arrivals(sidecar, markers[1], 1)
        sync.flushall()  # the group is gone too (NOGROUP): the forwarder must create it again
        await asyncio.sleep(0.5)
        add(sync, OutboxEntry("target", "orders", cloudevent(markers[2]), id="s2"))
        await wait_arrivals(sidecar, markers[2], 1)
        await asyncio.sleep(1)
        for marker in markers:
            assert len(await arrivals(sidecar, marker)) == 1, f"{marker} delivered twice"
    finally:
        await fwd.close()
        await client.aclose()
        sync.close()
        own.stop()


async def test_an_instance_with_delay_shards_forwards_every_shards_outbox_once(
    sidecar: Sidecar, outbox_db: Any, component: Callable[[str], Component]
) -> None:
    """delayShards: each shard fires into its own outbox (`{<shard stream>}:outbox`,
    its own hash slot on Cluster); the instance runs a forwarder per outbox, so a
    message bound for another pub/sub is handed off whichever shard fired it."""
    c = component("delayed")
    await c.init(
        {
            "redisHost": f"127.0.0.1:{sidecar.redis.port}",
            "consumerID": APP_ID,
            "enableDelayedMessaging": "true",
            "delayShards": "3",
            "daprGrpcAddress": sidecar.grpc_address,
            **FAST,
        }
    )
    marker = f"shards-{uuid.uuid4().hex[:8]}"
    shards = [EngineKeys.for_topic(t) for t in shard_topics(APP_ID, 3)]
    for i in range(9):
        entry = OutboxEntry(pubsub="target", topic="orders", data=cloudevent(marker, n=i), id=f"{marker}-{i}")
        outbox_db.xadd(shards[i % 3].outbox, encode_outbox_entry(entry))
    await wait_arrivals(sidecar, marker, 9, route="/events/target/orders")
    await asyncio.sleep(1)  # a second hand-off would land now, if ever
    got = await arrivals(sidecar, marker, route="/events/target/orders")
    assert sorted(a["data"]["n"] for a in got) == list(range(9))
    assert [len(outbox_db.xrange(k.outbox)) for k in shards] == [0, 0, 0]  # acked and deleted


async def test_a_delayed_publish_with_target_pubsub_fires_through_the_outbox_to_the_builtin_pubsub(
    sidecar: Sidecar, outbox_db: Any, component: Callable[[str], Component]
) -> None:
    """The whole path: publish (our component, over its gRPC socket) -> the engine holds it ->
    due -> the fire script appends it to the outbox -> the forwarder hands it to daprd ->
    the built-in pubsub.redis delivers it to the app, with the publisher's CloudEvent id."""
    c = component("delayed")
    await c.init(
        {
            "redisHost": f"127.0.0.1:{sidecar.redis.port}",
            "consumerID": KEYS.stream.removesuffix("-delayed"),
            "enableDelayedMessaging": "true",
            "daprGrpcAddress": sidecar.grpc_address,
        }
    )
    marker = f"e2e-{uuid.uuid4().hex[:8]}"
    data = cloudevent(marker)
    sent_at = time.time()
    await c.publish(
        "orders", data, {"scheduledSendDelay": "1s", "targetPubsub": "target", "customer": "acme-7"}
    )
    assert outbox_db.exists("orders") == 0  # never on our own topic
    [arrival] = await wait_arrivals(sidecar, marker, 1, route="/events/target/orders")
    assert time.time() - sent_at >= 1.0  # not before it was due
    assert arrival["id"] == json.loads(data)["id"]
    assert header(arrival, "customer") == "acme-7"
    assert header(arrival, "targetPubsub") is None  # our keys stay with us
    events = [r.event for r in history(outbox_db)]
    assert events == ["scheduled", "fired", "handedoff"]


async def test_target_pubsub_without_a_delay_is_refused_and_nothing_stored(
    outbox_db: Any, sidecar: Sidecar, component: Callable[[str], Component]
) -> None:
    c = component("delayed")
    await c.init(
        {
            "redisHost": f"127.0.0.1:{sidecar.redis.port}",
            "consumerID": KEYS.stream.removesuffix("-delayed"),
            "enableDelayedMessaging": "true",
        }
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.publish("orders", b"x", {"targetPubsub": "target"})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "targetPubsub" in (err.value.details() or "")
    assert outbox_db.exists("orders") == 0


async def test_delayed_publishes_with_target_pubsub_over_delay_shards_arrive_once(
    sidecar: Sidecar, outbox_db: Any, component: Callable[[str], Component]
) -> None:
    """The whole path with delayShards 3: scheduleIds hash to every shard, each
    shard fires into its own outbox, and every message reaches the target once."""
    c = component("delayed")
    await c.init(
        {
            "redisHost": f"127.0.0.1:{sidecar.redis.port}",
            "consumerID": APP_ID,
            "enableDelayedMessaging": "true",
            "delayShards": "3",
            "daprGrpcAddress": sidecar.grpc_address,
            **FAST,
        }
    )
    marker = f"shards-{uuid.uuid4().hex[:8]}"
    for i in range(12):
        # Fixed ids (the database is emptied per test) that hash to all three shards.
        md = {"scheduledSendDelay": "1s", "targetPubsub": "target", "scheduleId": f"fwd-{i}"}
        await c.publish("orders", cloudevent(marker, n=i), md)
    assert {shard_index(f"fwd-{i}", 3) for i in range(12)} == {0, 1, 2}
    shards = [EngineKeys.for_topic(t) for t in shard_topics(APP_ID, 3)]
    assert all(outbox_db.xlen(k.history) for k in shards), "every shard holds some of the 12"
    await wait_arrivals(sidecar, marker, 12, route="/events/target/orders")
    await asyncio.sleep(1)  # a second hand-off would land now, if ever
    got = await arrivals(sidecar, marker, route="/events/target/orders")
    assert sorted(a["data"]["n"] for a in got) == list(range(12))
    assert outbox_db.exists("orders") == 0  # never on our own topic


# --- dead letters and waiting hand-offs, as the operator sees them ----------------------


def app_conn(sidecar: Sidecar) -> list[str]:
    return ["--redis-host", f"127.0.0.1:{sidecar.redis.port}", "--app-id", APP_ID]


async def test_a_hand_off_waiting_for_a_down_sidecar_is_listed_inspected_and_counted(
    sidecar: Sidecar, outbox_db: Any, make_forwarder: Callable[..., Forwarder]
) -> None:
    """While daprd does not answer, a fired message sits in the outbox: `pending --json` and
    `inspect` show it (kind handoff, its tries, its next try), the gauge counts it; once a
    sidecar answers it is handed off and the listing is empty again."""
    marker = f"down-{uuid.uuid4().hex[:8]}"
    add(outbox_db, OutboxEntry("target", "orders", cloudevent(marker), id="invoice-7", metadata={"k": "v"}))
    add(
        outbox_db, OutboxEntry("target", "orders", cloudevent(marker, n=2), id=f"{int(time.time() * 1000)}-0")
    )
    down = make_forwarder(address=f"127.0.0.1:{free_port()}")
    down.start()
    registry: CollectorRegistry = make_forwarder.metrics.registry  # type: ignore[attr-defined]

    def gauge() -> float | None:
        return registry.get_sample_value("delayed_pubsub_handoff_pending", {"instance": "delayed"})

    async def tried() -> bool:
        return outbox_left(outbox_db) == (2, 2)

    await wait_for(tried, 10, "both entries to be read")
    result = await cli("pending", *app_conn(sidecar), "--json")
    assert result.code == 0, result.err
    rows = result.json()
    assert sorted(r["kind"] for r in rows) == ["handoff", "handoff"]
    assert all(r["targetPubsub"] == "target" and r["topic"] == "orders" for r in rows)
    assert all(r["attempts"] == 1 for r in rows), rows
    named = next(r for r in rows if r["scheduleId"] == "invoice-7")
    assert named["id"] == "invoice-7"
    # The other had no scheduleId: named by its outbox entry id, not by its gone envelope.
    other = next(r for r in rows if r["scheduleId"] is None)
    assert other["id"] in {i.decode() for i, _ in outbox_db.xrange(KEYS.outbox)}
    table = await cli("pending", *app_conn(sidecar))
    assert "target/orders" in table.out
    assert "handoff" in table.out
    shown = await cli("inspect", *app_conn(sidecar), "invoice-7")
    assert shown.code == 0, shown.err
    assert "handoff" in shown.out
    assert KEYS.outbox in shown.out
    assert marker in shown.out
    by_entry = await cli("inspect", *app_conn(sidecar), other["id"])
    assert by_entry.code == 0, by_entry.err
    assert marker in by_entry.out
    await wait_for(lambda: asyncio.sleep(0, gauge() == 2), 5, "the handoff gauge to count 2")

    await down.close()
    make_forwarder(claim_idle_ms=500).start()
    await wait_arrivals(sidecar, marker, 2, route="/events/target/orders")
    await wait_for(lambda: asyncio.sleep(0, outbox_left(outbox_db) == (0, 0)), 10, "the outbox to empty")
    assert (await cli("pending", *app_conn(sidecar), "--json")).json() == []


async def test_a_dead_lettered_hand_off_is_listed_by_dead_and_retry_dead_hands_it_off_again(
    sidecar: Sidecar,
    token_daprd: DaprdPorts,
    outbox_db: Any,
    make_forwarder: Callable[..., Forwarder],
) -> None:
    """Refused (no API token) until dead-lettered; `dead` lists it with where it was bound;
    `retry-dead` puts it back in the outbox, and a forwarder with the token hands it off."""
    marker = f"again-{uuid.uuid4().hex[:8]}"
    data = cloudevent(marker)
    # As the engine writes it: the id is also the `scheduler` of the metadata.
    metadata = {"customer": "c9", "scheduler": "job-9", "scheduleNext": "purge"}
    add(outbox_db, OutboxEntry("mem", "orders", data, id="job-9", metadata=metadata))
    refused = make_forwarder(
        address=f"127.0.0.1:{token_daprd.grpc}",
        policy=HandOffPolicy(max_attempts=2, base_s=0.1, cap_s=0.2, dead_letter_topic="dlq"),
    )
    refused.start()
    settled = (1, (0, 0))
    await wait_for(
        lambda: asyncio.sleep(0, (int(outbox_db.xlen("dlq")), outbox_left(outbox_db)) == settled),
        15,
        "the dead letter, and its outbox entry settled",
    )
    await refused.close()

    listed = await cli("dead", *app_conn(sidecar))
    assert listed.code == 0, listed.err
    assert "1 dead letters" in listed.out
    assert "mem/orders" in listed.out
    assert "UNAUTHENTICATED" in listed.out
    assert "1 dead letters" in (await cli("dead", *app_conn(sidecar), "--topic", "orders")).out
    assert "0 dead letters" in (await cli("dead", *app_conn(sidecar), "--topic", "other")).out

    moved = await cli("retry-dead", *app_conn(sidecar))
    assert moved.code == 0, moved.err
    assert "1 dead letters moved back" in moved.out
    assert int(outbox_db.xlen("dlq")) == 0
    [(_, fields)] = outbox_db.xrange(KEYS.outbox)
    assert (fields[b"pubsub"], fields[b"topic"], fields[b"data"], fields[b"id"]) == (
        b"mem",
        b"orders",
        data,
        b"job-9",
    )
    assert not any(k.startswith("deadLetter") for k in json.loads(fields[b"metadata"]))

    make_forwarder(address=f"127.0.0.1:{token_daprd.grpc}", api_token="s3cret-token").start()
    [arrival] = await wait_arrivals(sidecar, marker, 1, route="/events/mem/orders")
    assert arrival["id"] == json.loads(data)["id"]
    assert header(arrival, "customer") == "c9"
    await wait_for(lambda: asyncio.sleep(0, outbox_left(outbox_db) == (0, 0)), 5, "the outbox to empty")
    assert [r.event for r in history(outbox_db) if r.id == "job-9"] == ["deadlettered", "handedoff"]


async def test_dead_and_retry_dead_list_and_move_a_subscriber_and_a_hand_off_dead_letter_alike(
    sidecar: Sidecar,
    token_daprd: DaprdPorts,
    outbox_db: Any,
    make_forwarder: Callable[..., Forwarder],
) -> None:
    """The retrier and the forwarder give up into the one `deadLetterTopic` through the one writer:
    `dead` lists both, and `retry-dead` puts each back where it came from (the subscribed
    topic, the outbox)."""
    # A subscriber gives up on an entry of `inbox` after its last delivery (the real retrier).
    outbox_db.xgroup_create("inbox", APP_ID, id="0", mkstream=True)
    outbox_db.xadd("inbox", encode_entry(StreamEntry(b"poison", {"k": "v"})))
    [[_, [(raw_id, _)]]] = outbox_db.xreadgroup(APP_ID, "c1", {"inbox": ">"})
    client = aioredis.Redis(port=sidecar.redis.port)
    retrier = Retrier(
        client,
        RetryPolicy(
            initial_ms=1_000,
            max_ms=60_000,
            multiplier=2.0,
            jitter=0.0,
            max_attempts=1,
            dead_letter_topic="dlq",
            active=True,
        ),
        topic="inbox",
        group=APP_ID,
        consumer="c1",
        clock=SystemClock(),
        metrics=Metrics(CollectorRegistry()).for_instance("both"),
        call_timeout=5.0,
    )
    try:
        await retrier.on_nack(raw_id.decode(), "handler exploded")
    finally:
        await retrier.close()
        await client.aclose()
    # A hand-off is refused (no API token) until the forwarder gives up on it.
    # As the engine writes it: the id is also the `scheduler` of the metadata.
    metadata = {"scheduler": "job-both", "scheduleNext": "purge"}
    add(outbox_db, OutboxEntry("mem", "orders", cloudevent("both"), id="job-both", metadata=metadata))
    refused = make_forwarder(
        address=f"127.0.0.1:{token_daprd.grpc}",
        policy=HandOffPolicy(max_attempts=1, base_s=0.1, cap_s=0.2, dead_letter_topic="dlq"),
    )
    refused.start()
    await wait_for(lambda: asyncio.sleep(0, int(outbox_db.xlen("dlq")) == 2), 15, "both dead letters")
    await refused.close()
    assert outbox_left(outbox_db) == (0, 0)

    listed = await cli("dead", *app_conn(sidecar))
    assert listed.code == 0, listed.err
    assert "2 dead letters" in listed.out
    assert "handler exploded" in listed.out
    assert "mem/orders" in listed.out
    assert "UNAUTHENTICATED" in listed.out
    for topic in ("inbox", "orders"):
        assert "1 dead letters" in (await cli("dead", *app_conn(sidecar), "--topic", topic)).out

    moved = await cli("retry-dead", *app_conn(sidecar))
    assert moved.code == 0, moved.err
    assert "2 dead letters moved back" in moved.out
    assert int(outbox_db.xlen("dlq")) == 0
    # The subscriber's on its topic again, as a new entry its group reads; the hand-off in the outbox.
    [(_, back)] = outbox_db.xrange("inbox", f"({raw_id.decode()}", "+")
    assert (back[b"data"], json.loads(back[b"metadata"])) == (b"poison", {"k": "v"})
    [(_, handoff)] = outbox_db.xrange(KEYS.outbox)
    assert (handoff[b"pubsub"], handoff[b"topic"], handoff[b"id"]) == (b"mem", b"orders", b"job-both")


class _DiesAfterItsDeadLetter(Forwarder):
    """A forwarder whose process dies right after it wrote a dead letter, before the settle."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dead = asyncio.Event()

    async def _settle(self, ids: Any, record: Any) -> None:
        if record is not None and record.get("event") == "deadlettered":
            self.dead.set()
            await asyncio.Event().wait()  # never returns: close() cancels it, as a kill would
        await super()._settle(ids, record)


async def crash_between_dead_letter_and_settle(
    client: Any, keys: EngineKeys, address: str, *, dlq: str
) -> None:
    """One forwarder dies between the two writes of a dead letter; another takes the entry over."""
    policy = HandOffPolicy(max_attempts=1, base_s=0.1, cap_s=0.2, dead_letter_topic=dlq)
    config = ForwarderConfig(address=address, policy=policy, block_ms=200, claim_idle_ms=800)
    first = _DiesAfterItsDeadLetter(client, keys, SystemClock(), config, name="first")
    first.start()
    async with asyncio.timeout(20):
        await first.dead.wait()
    await first.close()
    second = Forwarder(client, keys, SystemClock(), config, name="second")
    second.start()
    try:

        async def settled() -> bool:
            return int(await client.xlen(keys.outbox)) == 0

        await wait_for(settled, 20, "the second forwarder to settle the entry")
    finally:
        await second.close()


async def test_a_crash_between_the_dead_letter_and_the_settle_doubles_it_never_loses_it(
    sidecar: Sidecar, outbox_db: Any
) -> None:
    add(outbox_db, OutboxEntry("no-such-pubsub", "orders", cloudevent("crash"), id="c1"))
    client = aioredis.Redis(port=sidecar.redis.port)
    try:
        await crash_between_dead_letter_and_settle(client, KEYS, sidecar.grpc_address, dlq="dlq")
    finally:
        await client.aclose()
    # Written by both: twice, never zero times; the outbox is empty and nothing waits.
    assert int(outbox_db.xlen("dlq")) == 2
    assert outbox_left(outbox_db) == (0, 0)
    assert [r.event for r in history(outbox_db)] == ["deadlettered"]


async def test_history_off_writes_no_hand_off_expiry_or_dead_letter_record(
    sidecar: Sidecar, outbox_db: Any, make_forwarder: Callable[..., Forwarder]
) -> None:
    marker = f"nohist-{uuid.uuid4().hex[:8]}"
    now = SystemClock().now_ms()
    add(outbox_db, OutboxEntry("target", "orders", cloudevent(marker), id="h1"))
    add(outbox_db, OutboxEntry("target", "orders", cloudevent("stale"), id="h2", expires_at_ms=now - 1))
    add(outbox_db, OutboxEntry("no-such-pubsub", "orders", cloudevent("refused"), id="h3"))
    outbox_db.xadd(KEYS.outbox, {"data": b"malformed"})
    make_forwarder(
        policy=HandOffPolicy(max_attempts=1, base_s=0.1, cap_s=0.2, dead_letter_topic="dlq"),
        history=Retention(max_len=0),
    ).start()
    await wait_arrivals(sidecar, marker, 1)
    await wait_for(lambda: asyncio.sleep(0, outbox_left(outbox_db) == (0, 0)), 10, "every entry settled")
    assert int(outbox_db.xlen("dlq")) == 2
    assert outbox_db.exists(KEYS.history) == 0


async def test_a_small_history_max_len_bounds_the_hand_off_records(
    sidecar: Sidecar, outbox_db: Any, make_forwarder: Callable[..., Forwarder]
) -> None:
    marker = f"bounded-{uuid.uuid4().hex[:8]}"
    # Approximate trimming frees whole stream nodes: small nodes make the bound visible.
    with small_stream_nodes(outbox_db, 10):
        for i in range(60):
            add(outbox_db, OutboxEntry("target", "race", cloudevent(marker, n=i), id=f"b{i}"))
        make_forwarder(history=Retention(max_len=20)).start()
        await wait_arrivals(sidecar, marker, 60, within=60, route="/events/target/race")
        await wait_for(lambda: asyncio.sleep(0, outbox_left(outbox_db) == (0, 0)), 10, "every entry settled")
    assert 20 <= int(outbox_db.xlen(KEYS.history)) <= 30


async def test_with_history_off_the_whole_target_pubsub_path_writes_no_record(
    sidecar: Sidecar, outbox_db: Any, component: Callable[[str], Component]
) -> None:
    c = component("delayed")
    await c.init(
        {
            "redisHost": f"127.0.0.1:{sidecar.redis.port}",
            "consumerID": APP_ID,
            "enableDelayedMessaging": "true",
            "daprGrpcAddress": sidecar.grpc_address,
            "historyMaxLen": "0",
        }
    )
    marker = f"off-{uuid.uuid4().hex[:8]}"
    for i in range(5):
        await c.publish(
            "orders", cloudevent(marker, n=i), {"scheduledSendDelay": "1s", "targetPubsub": "target"}
        )
    await wait_arrivals(sidecar, marker, 5, route="/events/target/orders")
    await wait_for(lambda: asyncio.sleep(0, outbox_left(outbox_db)[0] == 0), 10, "the outbox to empty")
    assert outbox_db.exists(KEYS.history) == 0


# --- Redis Cluster: the dead letter in its own slot ----------------------------------------

CLUSTER_SHARDS = 6


def cluster_layout(c: RedisCluster) -> tuple[EngineKeys, str]:
    """(a shard's keys, a dead-letter topic): the shard's outbox, the dead-letter topic and the
    app's dead-letter set (shard 0's slot) each on another master, so any step that wrote two
    of them in one transaction would fail."""
    dead_set = c.owner(dead_letter_topics_key(APP_ID)).port
    shard = next(
        EngineKeys.for_topic(t)
        for t in shard_topics(APP_ID, CLUSTER_SHARDS)[1:]
        if c.owner(EngineKeys.for_topic(t).outbox).port != dead_set
    )
    taken = {dead_set, c.owner(shard.outbox).port}
    dlq = next(t for t in (f"undeliverable-{i}" for i in range(100)) if c.owner(t).port not in taken)
    return shard, dlq


async def test_on_redis_cluster_a_refused_hand_off_is_dead_lettered_listed_and_handed_back(
    sidecar: Sidecar, cluster: RedisCluster, admin: Any
) -> None:
    shard, dlq = cluster_layout(cluster)
    data = cloudevent("cluster-dead")
    entry = OutboxEntry("no-such-pubsub", "orders", data, id="cl-1", metadata={"scheduler": "cl-1"})
    admin.xadd(shard.outbox, encode_outbox_entry(entry))
    client = acluster.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
    policy = HandOffPolicy(max_attempts=2, base_s=0.1, cap_s=0.2, dead_letter_topic=dlq)
    fwd = Forwarder(
        client,
        shard,
        SystemClock(),
        ForwarderConfig(address=sidecar.grpc_address, policy=policy, block_ms=200),
        name="cluster",
    )
    fwd.start()
    try:

        async def dead_lettered() -> bool:
            return int(admin.xlen(dlq)) == 1 and int(admin.xlen(shard.outbox)) == 0

        await wait_for(dead_lettered, 20, "the dead letter on the cluster")
    finally:
        await fwd.close()
        await client.aclose()
    [(_, fields)] = admin.xrange(dlq)
    assert fields[b"data"] == data
    assert [decode_record(i, f).event for i, f in admin.xrange(shard.history)] == ["deadlettered"]

    listed = await cli("dead", *cluster_conn(cluster, APP_ID, CLUSTER_SHARDS))
    assert listed.code == 0, listed.err
    assert "1 dead letters" in listed.out
    assert "no-such-pubsub/orders" in listed.out
    moved = await cli("retry-dead", *cluster_conn(cluster, APP_ID, CLUSTER_SHARDS))
    assert moved.code == 0, moved.err
    assert "1 dead letters moved back" in moved.out
    assert int(admin.xlen(dlq)) == 0
    waiting = (await cli("pending", *cluster_conn(cluster, APP_ID, CLUSTER_SHARDS), "--json")).json()
    assert [(r["kind"], r["id"], r["targetPubsub"], r["attempts"]) for r in waiting] == [
        ("handoff", "cl-1", "no-such-pubsub", 0)
    ]


async def test_on_redis_cluster_a_crash_between_the_dead_letter_and_the_settle_doubles_it_never_loses_it(
    sidecar: Sidecar, cluster: RedisCluster, admin: Any
) -> None:
    shard, dlq = cluster_layout(cluster)
    admin.xadd(shard.outbox, encode_outbox_entry(OutboxEntry("no-such-pubsub", "orders", b"x", id="cl-2")))
    client = acluster.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
    try:
        await crash_between_dead_letter_and_settle(client, shard, sidecar.grpc_address, dlq=dlq)
    finally:
        await client.aclose()
    assert int(admin.xlen(dlq)) == 2
    assert int(admin.xlen(shard.outbox)) == 0
    assert [decode_record(i, f).event for i, f in admin.xrange(shard.history)] == ["deadlettered"]
