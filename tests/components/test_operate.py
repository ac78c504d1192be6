"""The operator CLI, run as a real process against a Redis populated through the real component."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from delayed_middleware.clock import SystemClock
from delayed_middleware.engine import DelayEngine, EngineConfig
from delayed_middleware.instants import format_instant
from delayed_middleware.keys import EngineKeys, delayed_topic
from tests.components.driver import EXE, Component, cli
from tests.redis_server import RedisServer

Factory = Callable[[str], Component]


@pytest.fixture
def conn(redis_server: RedisServer) -> list[str]:
    return ["--redis-host", f"127.0.0.1:{redis_server.port}", "--app-id", "app1"]


@pytest.fixture
async def populated(component: Factory, props: dict[str, str]) -> Component:
    """7 on orders and 5 on billing, due in an hour; 3 on orders due in 10 minutes; 2 published now."""
    c = component("delayed")
    await c.init({**props, "enableDelayedMessaging": "true"})
    for i in range(7):
        await c.publish("orders", f'{{"order":{i}}}'.encode(), {"scheduledSendDelay": "1h"})
    for i in range(5):
        await c.publish(
            "billing", f"bill {i}".encode(), {"scheduledSendDelay": "1h", "scheduleId": f"bill-{i}"}
        )
    for i in range(3):
        await c.publish("orders", f"soon {i}".encode(), {"scheduledSendDelay": "10m"})
    await c.publish("orders", b"now")
    await c.publish("billing", b"now")
    return c


async def test_pending_json_lists_exactly_what_waits(populated: Component, conn: list[str]) -> None:
    result = await cli("pending", *conn, "--json")
    assert result.code == 0, result.err
    rows = result.json()
    assert len(rows) == 15
    assert {tuple(sorted(r)) for r in rows} == {
        (
            "attempts",
            "due",
            "dueLocal",
            "id",
            "kind",
            "paused",
            "pausedAt",
            "scheduleId",
            "size",
            "targetPubsub",
            "timeZone",
            "topic",
        )
    }
    assert sum(r["topic"] == "orders" for r in rows) == 10
    billing = sorted((r for r in rows if r["topic"] == "billing"), key=lambda r: r["id"])
    assert [(r["id"], r["scheduleId"]) for r in billing] == [(f"bill-{i}", f"bill-{i}") for i in range(5)]
    orders = [r for r in rows if r["topic"] == "orders"]
    assert all(r["scheduleId"] is None and r["id"].count("-") == 1 for r in orders)
    assert all(r["kind"] == "oneshot" and r["attempts"] == 0 and r["targetPubsub"] is None for r in rows)
    assert sorted(r["size"] for r in billing) == [6] * 5
    # Earliest first: the three due in ten minutes lead.
    assert [r["size"] for r in rows[:3]] == [6, 6, 6]
    assert rows == sorted(rows, key=lambda r: r["due"])


async def test_pending_filters_and_limit(populated: Component, conn: list[str]) -> None:
    soon = format_instant(int(time.time() * 1000) + 30 * 60_000)
    result = await cli("pending", *conn, "--due-before", soon, "--json")
    assert len(result.json()) == 3
    result = await cli("pending", *conn, "--topic", "billing", "--json")
    assert len(result.json()) == 5
    result = await cli("pending", *conn, "--limit", "4", "--json")
    assert len(result.json()) == 4


async def test_pending_table_for_people_with_counts_per_topic(populated: Component, conn: list[str]) -> None:
    result = await cli("pending", *conn, "--limit", "2")
    assert result.code == 0, result.err
    lines = [line.split() for line in result.out.splitlines()]
    assert ["orders", "10"] in lines
    assert ["billing", "5"] in lines
    assert ["total", "15"] in lines
    assert sum(1 for line in lines if len(line) == 6 and line[3] == "oneshot") == 2
    assert "showing the earliest 2 of 15" in result.err


async def test_inspect_shows_the_payload_and_metadata(populated: Component, conn: list[str]) -> None:
    result = await cli("inspect", *conn, "bill-3")
    assert result.code == 0, result.err
    assert "bill 3" in result.out
    assert "billing" in result.out
    assert "scheduledSendDelay" in result.out
    envelope_id = (await cli("pending", *conn, "--topic", "orders", "--limit", "1", "--json")).json()[0]["id"]
    result = await cli("inspect", *conn, envelope_id)
    assert result.code == 0, result.err
    assert "soon" in result.out

    missing = await cli("inspect", *conn, "no-such-id")
    assert missing.code == 1
    assert "no-such-id" in missing.err


async def test_cancel_by_schedule_id_and_envelope_id_is_never_delivered(
    component: Factory, props: dict[str, str], conn: list[str], redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init({**props, "enableDelayedMessaging": "true"})
    stream = await c.subscribe("orders")
    # The three CLI runs below must all end before the messages are due, however
    # loaded the machine: one run timed now sets the delay (8 s at least).
    started = time.monotonic()
    assert (await cli("pending", *conn, "--json")).json() == []
    delay_s = max(8, round(6 * (time.monotonic() - started)))
    delay = {"scheduledSendDelay": f"{delay_s}s"}
    published = time.monotonic()
    await c.publish("orders", b"cancel me by id", {**delay, "scheduleId": "x1"})
    await c.publish("orders", b"cancel me by envelope", delay)
    await c.publish("orders", b"keep me", {**delay, "scheduleId": "keep"})
    [by_envelope] = [
        r["id"] for r in (await cli("pending", *conn, "--json")).json() if r["scheduleId"] is None
    ]
    result = await cli("cancel", *conn, "x1", by_envelope, "ghost", "also-ghost")
    assert result.code == 1
    assert result.out.split("\n")[:2] == ["cancelled x1", f"cancelled {by_envelope}"]
    assert "ghost, also-ghost" in result.err
    assert [r["id"] for r in (await cli("pending", *conn, "--json")).json()] == ["keep"]
    assert time.monotonic() - published < delay_s, "the CLI runs outlasted the delay: raise its factor"

    msg = await stream.next(within=delay_s + 10)
    assert msg.data == b"keep me"
    assert await stream.nothing_for(1.5)
    # Cancelling again finds nothing: exit 1, naming it.
    again = await cli("cancel", *conn, "x1")
    assert again.code == 1
    assert "x1" in again.err
    # The history says who cancelled.
    hist = await cli("history", *conn, "--id", "x1")
    assert "cancelled" in hist.out
    assert "operator" in hist.out


async def test_dead_then_retry_dead_delivers_again(
    component: Factory, props: dict[str, str], conn: list[str]
) -> None:
    c = component("delayed")
    await c.init(
        {**props, "maxDeliveryAttempts": "2", "retryInitialInterval": "50ms", "deadLetterTopic": "dlq"}
    )
    stream = await c.subscribe("orders")
    await c.publish("orders", b"poison", {"k": "v"})
    for _ in range(2):
        await stream.nack((await stream.next()).id, "handler exploded")
    deadline = time.monotonic() + 5
    while "1 dead letters" not in (listing := await cli("dead", *conn)).out:
        assert time.monotonic() < deadline, listing
    assert "handler exploded" in listing.out
    assert "orders" in listing.out
    assert "0 dead letters" in (await cli("dead", *conn, "--topic", "billing")).out

    moved = await cli("retry-dead", *conn)
    assert moved.code == 0, moved.err
    assert "1 dead letters moved back" in moved.out
    back = await stream.next()
    assert back.data == b"poison"
    assert back.metadata["k"] == "v"
    assert back.metadata["deliveryAttempt"] == "1"
    assert "deadLetterReason" not in back.metadata
    await stream.ack(back.id)
    assert "0 dead letters" in (await cli("dead", *conn)).out


async def test_dead_and_pending_show_a_hostile_reason_and_topic_as_text(
    component: Factory, props: dict[str, str], conn: list[str]
) -> None:
    # A nack's reason is an app's error text, a topic anyone's name: neither may drive the
    # operator's terminal (escape sequences) or rich's markup ("[link=…]"), as in `history`.
    hostile = "\x1b]0;owned\x07\x1b[2J[bold]loud[/bold]"
    c = component("delayed")
    await c.init(
        {**props, "maxDeliveryAttempts": "1", "deadLetterTopic": "dlq", "enableDelayedMessaging": "true"}
    )
    stream = await c.subscribe("orders")
    await c.publish("orders", b"poison")
    await stream.nack((await stream.next()).id, hostile)
    await c.publish("orders[red]x", b"later", {"scheduledSendDelay": "1h"})
    deadline = time.monotonic() + 5
    while "1 dead letters" not in (listing := await cli("dead", *conn)).out:
        assert time.monotonic() < deadline, listing
    pending = await cli("pending", *conn)
    assert pending.code == 0, pending.err
    for out in (listing.out, pending.out):
        assert not any((ord(c) < 32 and c != "\n") or 0x7F <= ord(c) <= 0x9F for c in out)
    assert "[bold]loud[/bold]" in listing.out.replace("\n", "").replace(" ", "")
    assert "orders[red]x" in pending.out


async def test_history_shows_retries_since(
    component: Factory, props: dict[str, str], conn: list[str]
) -> None:
    c = component("delayed")
    await c.init({**props, "retryInitialInterval": "50ms"})
    stream = await c.subscribe("orders")
    await c.publish("orders", b"x")
    first = await stream.next()
    await stream.nack(first.id, "flaky")
    await stream.ack((await stream.next()).id)
    result = await cli("history", *conn, "--since", "1m")
    assert result.code == 0, result.err
    assert "retried" in result.out
    assert "flaky" in result.out
    assert "1 records" in result.out
    assert "0 records" in (await cli("history", *conn, "--since", "2099-01-01T00:00:00Z")).out
    bad = await cli("history", *conn, "--since", "yesterday")
    assert bad.code == 2
    assert "yesterday" in bad.err


async def test_component_yaml_with_secret_from_environment(
    tmp_path: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    redis_client.config_set("requirepass", "s3cret")
    try:
        yaml_path = tmp_path / "c.yaml"
        yaml_path.write_text(
            "apiVersion: dapr.io/v1alpha1\nkind: Component\nmetadata:\n  name: delayed\nspec:\n"
            "  type: pubsub.delayed-pubsub\n  version: v1\n  metadata:\n"
            f"    - name: redisHost\n      value: 127.0.0.1:{redis_server.port}\n"
            "    - name: redisPassword\n      secretKeyRef:\n        name: redis\n        key: redis-password\n"
            "    - name: enableDelayedMessaging\n      value: true\n"
        )
        ok = await cli(
            "pending",
            "--component",
            str(yaml_path),
            "--app-id",
            "app1",
            "--json",
            env={"REDIS_PASSWORD": "s3cret"},
        )
        assert ok.code == 0, ok.err
        assert ok.json() == []
        missing = await cli("pending", "--component", str(yaml_path), "--app-id", "app1")
        assert missing.code == 2
        assert "REDIS_PASSWORD" in missing.err
        wrong = await cli(
            "pending", "--component", str(yaml_path), "--app-id", "app1", env={"REDIS_PASSWORD": "no"}
        )
        assert wrong.code == 3
        assert "s3cret" not in wrong.err
    finally:
        redis_client.config_set("requirepass", "")


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["pending", "--app-id", "a"], 2, "--component"),
        (["pending", "--redis-host", "127.0.0.1:1", "--app-id", "a"], 3, "127.0.0.1:1"),
        (["pending", "--redis-host", "127.0.0.1:1"], 2, "--app-id"),
        (
            ["pending", "--redis-host", "127.0.0.1:1", "--app-id", "a", "--due-before", "tomorrow"],
            2,
            "tomorrow",
        ),
        (["pending", "--component", "/nonexistent.yaml", "--app-id", "a"], 2, "/nonexistent.yaml"),
        *(
            (
                ["pending", "--redis-host", "127.0.0.1:1", "--app-id", "a", "--delay-shards", bad],
                2,
                "delayShards",
            )
            for bad in ("0", "-1", "abc", "1025", "9" * 30)
        ),
        (
            ["pending", "--redis-host", "127.0.0.1:1", "--app-id", "a", "--redis-type", "ring"],
            2,
            "--redis-type",
        ),
    ],
)
async def test_clean_errors_and_exit_codes(args: list[str], code: int, message: str) -> None:
    result = await cli(*args)
    assert result.code == code, (result.out, result.err)
    assert message in result.err
    assert "Traceback" not in result.err


def test_the_shipped_component_yaml_loads_with_a_secret_from_the_environment() -> None:
    import argparse

    from delayed_pubsub.component_file import secret_env_names
    from delayed_pubsub.operate import load_settings

    shipped = Path(__file__).resolve().parents[2] / "dapr" / "components" / "delayed-pubsub.yaml"
    args = argparse.Namespace(component=shipped, redis_host=None, redis_password=None, app_id="myapp")
    settings = load_settings(args, {})
    assert settings.address == "localhost:6379"
    assert settings.consumer_id == "myapp"
    assert settings.enable_delayed_messaging
    assert secret_env_names({"name": "redis", "key": "redis-password"}) == [
        "REDIS_PASSWORD",
        "REDIS_REDIS_PASSWORD",
    ]
    assert secret_env_names({"name": "redis-tls", "key": "tls.key"}) == ["TLS_KEY", "REDIS_TLS_TLS_KEY"]
    assert secret_env_names({"name": "MY_ENV", "key": "MY_ENV"}) == ["MY_ENV"]


async def test_long_scan_shows_a_progress_bar_on_a_terminal(
    redis_server: RedisServer, conn: list[str]
) -> None:
    import pty

    import redis.asyncio as aioredis

    from delayed_middleware.clock import SystemClock
    from delayed_middleware.engine import DelayEngine
    from delayed_middleware.envelope import Envelope
    from delayed_middleware.keys import EngineKeys, delayed_topic

    client = aioredis.Redis(port=redis_server.port)
    engine = DelayEngine(client, EngineKeys.for_topic(delayed_topic("app1")), SystemClock())
    due = int(time.time() * 1000) + 3_600_000
    for _ in range(5):
        await engine.schedule(
            [Envelope(id="", topic="t", due_ms=due, published_at_ms=0, message=b"x") for _i in range(1000)]
        )
    await client.aclose()
    leader, follower = pty.openpty()
    try:
        proc = await asyncio.create_subprocess_exec(
            str(EXE), "pending", *conn, "--json", stdout=asyncio.subprocess.PIPE, stderr=follower
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
        os.close(follower)
        follower = -1
        drawn = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:
                break  # the terminal's other side is closed: all read
            if not chunk:
                break
            drawn += chunk
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)
    assert proc.returncode == 0
    assert len(json.loads(out)) == 100  # stdout stays pure JSON
    assert b"scanning" in drawn
    assert "━".encode() in drawn  # the bar itself


async def test_failed_messages_waiting_for_a_retry_are_listed_and_inspectable(
    component: Factory, props: dict[str, str], conn: list[str]
) -> None:
    c = component("delayed")
    await c.init({**props, "retryInitialInterval": "1h", "retryMaxInterval": "2h"})
    stream = await c.subscribe("orders")
    await c.publish("orders", b"try me later", {"k": "v"})
    msg = await stream.next()
    before = int(time.time() * 1000)
    await stream.nack(msg.id, "db down")
    deadline = time.monotonic() + 5
    while not (rows := (await cli("pending", *conn, "--json")).json()):
        assert time.monotonic() < deadline
    [row] = rows
    assert row["id"] == msg.id
    assert row["scheduleId"] is None
    assert (row["topic"], row["kind"], row["attempts"], row["size"]) == ("orders", "retry", 1, 12)
    assert row["due"] >= format_instant(before + 3_600_000 - 1000)
    assert (await cli("pending", *conn, "--json", "--topic", "billing")).json() == []
    shown = await cli("inspect", *conn, msg.id)
    assert shown.code == 0, shown.err
    assert "try me later" in shown.out
    assert "retry" in shown.out
    assert "db down" in shown.out  # its history: retried, with the app's error


async def test_delay_shards_on_a_single_node_are_all_read_and_a_missing_count_is_warned_of(
    component: Factory, props: dict[str, str], conn: list[str]
) -> None:
    c = component("delayed")
    await c.init({**props, "enableDelayedMessaging": "true", "delayShards": "3"})
    for i in range(6):  # one shard per call, in turn: every shard gets two
        await c.publish("orders", f"m{i}".encode(), {"scheduledSendDelay": "1h"})
    result = await cli("pending", *conn, "--delay-shards", "3", "--json")
    assert result.code == 0, result.err
    rows = result.json()
    assert len(rows) == 6
    assert sorted(r["id"].rpartition("@")[2] for r in rows) == ["0", "0", "1", "1", "2", "2"]
    assert "warning" not in result.err
    cancelled = await cli("cancel", *conn, "--delay-shards", "3", rows[0]["id"])
    assert cancelled.code == 0, cancelled.err
    assert len((await cli("pending", *conn, "--delay-shards", "3", "--json")).json()) == 5
    # Without the count: shard 0 alone, and a warning naming the shard stream beyond it.
    result = await cli("pending", *conn, "--json")
    assert result.code == 0, result.err
    assert len(result.json()) == sum(r["id"].endswith("@0") for r in rows[1:])
    assert "app1~1-delayed exists" in result.err


async def test_pending_inspect_and_cancel_name_messages_the_same_after_compaction(
    populated: Component, conn: list[str], redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """Compaction re-homes envelopes to the delayed topic's tail (new stream ids): the CLI
    goes on listing, inspecting and cancelling them by the ids it showed before, once each."""
    before = (await cli("pending", *conn, "--json")).json()
    keys = EngineKeys.for_topic(delayed_topic("app1"))
    client = aioredis.Redis(port=redis_server.port)
    try:
        # Any density counts as sparse here: the 15 envelopes share a node or two.
        engine = DelayEngine(client, keys, SystemClock(), config=EngineConfig(compact_min_nodes=1))
        assert await engine.compact()
    finally:
        await client.aclose()
    assert redis_client.hlen(keys.moved) == 15
    assert (await cli("pending", *conn, "--json")).json() == before
    envelope_id = next(r["id"] for r in before if r["scheduleId"] is None)
    shown = await cli("inspect", *conn, envelope_id)
    assert shown.code == 0, shown.err
    assert envelope_id in shown.out
    result = await cli("cancel", *conn, envelope_id, "bill-2")
    assert result.code == 0, result.err
    after = (await cli("pending", *conn, "--json")).json()
    assert after == [r for r in before if r["id"] not in (envelope_id, "bill-2")]
    assert redis_client.hlen(keys.moved) == 13
