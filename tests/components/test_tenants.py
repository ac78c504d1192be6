"""Two apps on one Redis: whatever their consumerIDs, one app's publishes, same-id replaces, prefix
cancels, pauses and operator listings never reach the other's delayed messages.

Each app is its own `delayed-pubsub serve` process driven over gRPC as daprd drives it, both on one
real redis-server (or one Redis Cluster); the operator CLI runs as a real process. A consumerID that
could name another app's keys is refused at Init (INVALID_ARGUMENT naming consumerID and the value,
nothing stored) and by the CLI (exit 2); every other pair is isolated.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis

from delayed_middleware.history import decode_record
from delayed_middleware.instants import format_instant
from delayed_middleware.keys import EngineKeys, shard_topics
from tests.components.driver import Component, cli, now_ms
from tests.components.serve import Serve
from tests.redis_server import RedisCluster, RedisServer, stream_entries

N = 40
VICTIM_TOPIC = "victim-orders"
ATTACKER_TOPIC = "attacker-orders"
# What a consumerID must not hold: the shard mark and the hash tag's braces (the promise; the code's
# own list is not trusted here).
REFUSED_CHARS = "~{}"
# Every shard an operator could name: reads every stream `pending --delay-shards N` reads for N <= 8.
CLI_SHARDS = 8


def refused(consumer_id: str) -> bool:
    return any(c in consumer_id for c in REFUSED_CHARS)


async def init(serve: Serve, props: dict[str, str]) -> tuple[grpc.aio.Channel, Component | None, str]:
    """The instance `delayed` on `serve`, Init'ed with `props`: (channel, component, "") or, when
    Init is refused with INVALID_ARGUMENT, (channel, None, its details)."""
    channel = grpc.aio.insecure_channel(f"unix://{serve.socket}")
    c = Component(channel, "delayed")
    error: grpc.aio.AioRpcError | None = None
    try:
        await c.init(props)
    except grpc.aio.AioRpcError as e:
        error = e
    if error is None:
        return channel, c, ""
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    return channel, None, error.details() or ""


def keys_of(client: Any) -> set[bytes]:
    return set(client.scan_iter(count=1000))


def history_events(client: Any, consumer_id: str, shards: int) -> list[tuple[str, str]]:
    out = []
    for stream in shard_topics(consumer_id, shards):
        for i, f in stream_entries(client, EngineKeys.for_topic(stream).history):
            r = decode_record(i, f)
            out.append((r.event, r.id))
    return out


def ids_held(client: Any, consumer_id: str, shards: int) -> int:
    """How many scheduleIds the app holds (pending, paused or recurring) over its shards."""
    return sum(client.hlen(EngineKeys.for_topic(s).ids) for s in shard_topics(consumer_id, shards))


async def attack_and_check(
    client: Any,
    conn: list[str],
    victim: tuple[Component, str, int],
    attacker: tuple[Component, str, int],
) -> None:
    """The victim schedules N messages; the attacker uses every id-based operation on the same ids;
    the victim still gets each of its N messages once, as it published them."""
    v, victim_id, victim_shards = victim
    a, attacker_id, attacker_shards = attacker
    stream = await v.subscribe(VICTIM_TOPIC)
    due = now_ms() + 6_000
    for i in range(N):
        body = json.dumps({"from": victim_id, "n": i}).encode()
        await v.publish(
            VICTIM_TOPIC, body, {"scheduledSendTime": format_instant(due), "scheduleId": f"job-{i}"}
        )
    far = format_instant(now_ms() + 3_600_000)
    for i in range(N):
        # Same scheduleId: within one app this replaces; across apps it must not.
        await a.publish(ATTACKER_TOPIC, b"replaced", {"scheduledSendTime": far, "scheduleId": f"job-{i}"})
    await a.publish(ATTACKER_TOPIC, b"", {"schedulePause": "true", "scheduleId": "job-0"})

    listed = await cli("pending", *conn, "--app-id", attacker_id, "--delay-shards", str(CLI_SHARDS), "--json")
    assert listed.code == 0, listed.err
    rows = listed.json()
    assert {r["topic"] for r in rows} == {ATTACKER_TOPIC}, (
        "the attacker's listing shows the victim's messages"
    )
    assert sorted(r["scheduleId"] for r in rows) == sorted(f"job-{i}" for i in range(N))

    await a.publish(ATTACKER_TOPIC, b"", {"scheduleCancel": "true", "scheduleIdPrefix": "job-1"})
    cancelled = await cli(
        "cancel",
        *conn,
        "--app-id",
        attacker_id,
        "--delay-shards",
        str(CLI_SHARDS),
        "--prefix",
        "job-",
        "--yes",
    )
    assert cancelled.code == 0, cancelled.err
    # The attacker's operations did act, on its own messages: none of its own is left.
    assert ids_held(client, attacker_id, attacker_shards) == 0

    got: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + 30
    while len(got) < N:
        assert time.monotonic() < deadline, f"{len(got)} of {N} of {victim_id}'s messages delivered"
        msg = await stream.next(within=max(0.1, deadline - time.monotonic()))
        body = json.loads(msg.data)
        assert body["from"] == victim_id, body
        assert body["n"] not in got, f"{body} delivered twice"
        got[body["n"]] = body
        await stream.ack(msg.id)
    assert sorted(got) == list(range(N))
    events = history_events(client, victim_id, victim_shards)
    assert {e for e, _ in events} == {"scheduled", "fired"}, events
    assert await stream.nothing_for(0.5), "a message arrived twice"
    await stream.close()


PAIRS = [
    # (attacker, its delayShards, victim, its delayShards)
    ("tenant", 2, "tenant~1", 1),
    ("tenant~1", 1, "tenant", 2),
    ("a", 2, "{a}", 1),
    ("a}", 1, "a", 1),
    ("tenant", 2, "tenant-1", 1),
    ("a", 3, "a-delayed", 1),
    ("a-delayed", 1, "a", 2),
    ("a", 2, "a:x", 2),
    ("ab", 2, "a", 2),
    ("a*", 2, "a", 1),
]


@pytest.mark.parametrize(("attacker_id", "attacker_shards", "victim_id", "victim_shards"), PAIRS)
async def test_an_app_never_reaches_the_delayed_messages_of_another_on_the_same_redis(
    folder: Path,
    redis_server: RedisServer,
    redis_client: redis.Redis,
    attacker_id: str,
    attacker_shards: int,
    victim_id: str,
    victim_shards: int,
) -> None:
    base = {"redisHost": f"127.0.0.1:{redis_server.port}", "enableDelayedMessaging": "true"}
    await one_pair(
        folder,
        redis_client,
        base,
        ["--redis-host", f"127.0.0.1:{redis_server.port}"],
        (attacker_id, attacker_shards),
        (victim_id, victim_shards),
    )


@pytest.mark.parametrize(
    ("attacker_id", "attacker_shards", "victim_id", "victim_shards"),
    [("tenant", 3, "tenant~1", 2), ("tenant", 3, "tenant-1", 2), ("a", 3, "a:x", 2)],
)
async def test_an_app_never_reaches_the_delayed_messages_of_another_on_the_same_redis_cluster(
    folder: Path,
    cluster: RedisCluster,
    admin: Any,
    attacker_id: str,
    attacker_shards: int,
    victim_id: str,
    victim_shards: int,
) -> None:
    base = {"redisHost": cluster.nodes[0].address, "redisType": "cluster", "enableDelayedMessaging": "true"}
    conn = ["--redis-host", cluster.nodes[1].address, "--redis-type", "cluster"]
    await one_pair(folder, admin, base, conn, (attacker_id, attacker_shards), (victim_id, victim_shards))


async def one_pair(
    folder: Path,
    client: Any,
    base: dict[str, str],
    conn: list[str],
    attacker: tuple[str, int],
    victim: tuple[str, int],
) -> None:
    servers = {"attacker": Serve(folder, "attacker"), "victim": Serve(folder, "victim")}
    channels: list[grpc.aio.Channel] = []
    try:
        apps: dict[str, tuple[Component, str, int]] = {}
        for role, (consumer_id, shards) in (("victim", victim), ("attacker", attacker)):
            before = keys_of(client)
            props = {**base, "consumerID": consumer_id, "delayShards": str(shards)}
            channel, c, error = await init(servers[role], props)
            channels.append(channel)
            if c is None:
                # Refused with the setting, the value and what to do; nothing stored.
                assert refused(consumer_id), f"{consumer_id!r} refused: {error}"
                assert "consumerID" in error, error
                assert repr(consumer_id) in error, error
                assert "without" in error, error
                assert keys_of(client) == before
            else:
                apps[role] = (c, consumer_id, shards)
        if len(apps) == 2:
            await attack_and_check(client, conn, apps["victim"], apps["attacker"])
        # Refused exactly the ids with a reserved character, whatever their order of Init.
        refused_ids = {
            cid for role, (cid, _) in (("victim", victim), ("attacker", attacker)) if role not in apps
        }
        assert refused_ids == {cid for cid in (victim[0], attacker[0]) if refused(cid)}
    finally:
        for channel in channels:
            await channel.close(None)
        for s in servers.values():
            s.stop()


@pytest.mark.parametrize("consumer_id", ["tenant~1", "{a}", "a}", "x{y"])
async def test_the_cli_refuses_a_consumer_id_that_could_reach_another_apps_keys(
    tmp_path: Path, redis_server: RedisServer, redis_client: redis.Redis, consumer_id: str
) -> None:
    host = f"127.0.0.1:{redis_server.port}"
    for command in (["pending"], ["cancel", "--prefix", "job-", "--yes"]):
        result = await cli(*command, "--redis-host", host, "--app-id", consumer_id, "--delay-shards", "2")
        assert result.code == 2, result
        assert f"--app-id {consumer_id!r}" in result.err, result.err
        assert "another app" in result.err, result.err
    yaml = tmp_path / "component.yaml"
    yaml.write_text(
        "apiVersion: dapr.io/v1alpha1\nkind: Component\nmetadata:\n  name: delayed\nspec:\n"
        "  type: pubsub.delayed-pubsub\n  version: v1\n  metadata:\n"
        f"  - name: redisHost\n    value: {host}\n  - name: consumerID\n    value: {json.dumps(consumer_id)}\n"
    )
    result = await cli("pending", "--component", str(yaml))
    assert result.code == 2, result
    # A `{` in a YAML reads as a template daprd resolves: the CLI asks for the app id instead.
    reason = "--app-id is required" if "{" in consumer_id else "another app"
    assert repr(consumer_id) in result.err, result.err
    assert reason in result.err, result.err
    assert redis_client.dbsize() == 0


async def test_the_cli_lists_only_its_own_app_whatever_delay_shards_it_is_given(
    folder: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    # App `tenant-1` has pending messages; `pending` for `tenant` with 1..8 shards lists none of them.
    base = {"redisHost": f"127.0.0.1:{redis_server.port}", "enableDelayedMessaging": "true"}
    serve = Serve(folder, "victim")
    try:
        channel, c, error = await init(serve, {**base, "consumerID": "tenant-1", "delayShards": "8"})
        assert c is not None, error
        due = format_instant(now_ms() + 3_600_000)
        for i in range(N):
            await c.publish(VICTIM_TOPIC, b"x", {"scheduledSendTime": due, "scheduleId": f"job-{i}"})
        for shards in range(1, 9):
            host = f"127.0.0.1:{redis_server.port}"
            listed = await cli(
                "pending", "--redis-host", host, "--app-id", "tenant", "--delay-shards", str(shards), "--json"
            )
            assert (listed.code, listed.json()) == (0, []), listed.err
        own = await cli(
            "pending", "--redis-host", host, "--app-id", "tenant-1", "--delay-shards", "8", "--json"
        )
        assert len(own.json()) == N
        await channel.close(None)
    finally:
        serve.stop()
