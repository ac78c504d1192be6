"""schedulePause and scheduleIdPrefix through the component, driven over gRPC as daprd drives it,
on a real Redis: what a subscriber receives, what the history and the metrics say, and that a
bad value is refused with INVALID_ARGUMENT naming the key and the value, storing nothing."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc
import pytest
import redis

from delayed_middleware.history import decode_record
from delayed_middleware.instants import parse_instant
from delayed_pubsub.server import ComponentServer
from delayed_pubsub_pb.dapr.proto.components.v1 import pubsub_pb2
from tests.components.driver import Component
from tests.redis_server import stream_entries

HISTORY = "{app1-delayed}:history"
IDS = "{app1-delayed}:ids"


@pytest.fixture
def delayed_props(props: dict[str, str]) -> dict[str, str]:
    return {**props, "enableDelayedMessaging": "true"}


def sample(server: ComponentServer, name: str, **labels: str) -> float:
    value = server.metrics.registry.get_sample_value(name, {"instance": "delayed", **labels})
    return 0.0 if value is None else value


def events(client: redis.Redis, id: str) -> list[str]:
    return [r.event for r in (decode_record(i, f) for i, f in stream_entries(client, HISTORY)) if r.id == id]


async def test_a_paused_schedule_stops_firing_and_resumes_without_catching_up(
    server: ComponentServer,
    component: Callable[[str], Component],
    delayed_props: dict[str, str],
    redis_client: redis.Redis,
) -> None:
    c = component("delayed")
    await c.init(delayed_props)
    stream = await c.subscribe("ticks")
    await c.publish("ticks", b"tick", {"schedule": "@every 1s", "scheduleId": "tick"})
    await stream.ack((await stream.next(within=3)).id)
    # No body needed.
    await c.publish("ticks", b"", {"schedulePause": "true", "scheduleId": "tick"})
    # A fire may have been under way when the pause landed; after it, nothing.
    await asyncio.sleep(0.3)
    while not stream.received.empty():
        await stream.ack((await stream.next()).id)
    fired_before = events(redis_client, "tick").count("fired")
    assert await stream.nothing_for(2.5)
    assert events(redis_client, "tick").count("fired") == fired_before
    resumed_at = time.time_ns() // 1_000_000
    await c.publish("ticks", b"", {"schedulePause": "false", "scheduleId": "tick"})
    first = await stream.next(within=2)
    await stream.ack(first.id)
    # The occurrence delivered is the first grid point after the resume (its due is one
    # interval before its scheduleNext), not one of those missed while paused.
    due = parse_instant(first.metadata["scheduleNext"]) - 1_000
    assert due >= resumed_at
    assert events(redis_client, "tick")[-3:] == ["paused", "resumed", "fired"]
    assert sample(server, "delayed_pubsub_pauses_total", result="paused") == 1
    assert sample(server, "delayed_pubsub_pauses_total", result="resumed") == 1
    await c.publish("ticks", b"", {"scheduleCancel": "true", "scheduleId": "tick"})
    await stream.close()


async def test_a_paused_one_shot_past_due_fires_at_once_on_resume(
    component: Callable[[str], Component], delayed_props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init(delayed_props)
    stream = await c.subscribe("orders")
    await c.publish("orders", b"order", {"scheduledSendDelay": "1s", "scheduleId": "o-1"})
    await c.publish("orders", b"", {"schedulePause": "true", "scheduleId": "o-1"})
    assert await stream.nothing_for(1.8)
    started = time.monotonic()
    await c.publish("orders", b"", {"schedulePause": "false", "scheduleId": "o-1"})
    msg = await stream.next(within=2)
    assert time.monotonic() - started < 1.0
    assert msg.data == b"order"
    await stream.ack(msg.id)
    assert events(redis_client, "o-1") == ["scheduled", "paused", "resumed", "fired"]
    await stream.close()


async def test_pausing_an_unknown_id_is_answered_ok_and_counted(
    server: ComponentServer, component: Callable[[str], Component], delayed_props: dict[str, str]
) -> None:
    c = component("delayed")
    await c.init(delayed_props)
    await c.publish("orders", b"", {"schedulePause": "true", "scheduleId": "nobody"})
    assert sample(server, "delayed_pubsub_pauses_total", result="unknown") == 1


async def test_a_prefix_cancel_withdraws_exactly_the_matching_ids_and_counts_them(
    server: ComponentServer,
    component: Callable[[str], Component],
    delayed_props: dict[str, str],
    redis_client: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    c = component("delayed")
    await c.init(delayed_props)
    stream = await c.subscribe("orders")
    for sid in ("tenant-1:a", "tenant-1:b", "tenant-10:a", "tenant-2:a"):
        await c.publish("orders", sid.encode(), {"scheduledSendDelay": "1s", "scheduleId": sid})
    await c.publish("orders", b"", {"schedule": "@every 1s", "scheduleId": "tenant-1:tick"})
    await c.publish("orders", b"", {"scheduleCancel": "true", "scheduleIdPrefix": "tenant-1:"})
    assert sample(server, "delayed_pubsub_prefix_cancelled_messages_total") == 3
    logged = [r.getMessage() for r in caplog.records if "scheduleIdPrefix" in r.getMessage()]
    assert logged == ["scheduleCancel with scheduleIdPrefix 'tenant-1:' on app1-delayed: cancelled 3"]
    got = set()
    for _ in range(2):
        msg = await stream.next(within=3)
        got.add(msg.data)
        await stream.ack(msg.id)
    assert got == {b"tenant-10:a", b"tenant-2:a"}
    assert await stream.nothing_for(1.5)
    # Nothing matching now: answered OK, 0 more.
    await c.publish("orders", b"", {"scheduleCancel": "true", "scheduleIdPrefix": "tenant-1:"})
    assert sample(server, "delayed_pubsub_prefix_cancelled_messages_total") == 3
    await stream.close()


@pytest.mark.parametrize(
    ("metadata", "key", "value"),
    [
        ({"schedulePause": "yes", "scheduleId": "x"}, "schedulePause", "yes"),
        ({"schedulePause": "true"}, "schedulePause", "true"),
        ({"schedulePause": "true", "scheduleId": "x", "schedule": "@every 1s"}, "schedule", "@every 1s"),
        ({"schedulePause": "true", "scheduleId": "x", "scheduleCancel": "true"}, "scheduleCancel", "true"),
        (
            {"schedulePause": "false", "scheduleId": "x", "scheduledSendDelay": "5s"},
            "scheduledSendDelay",
            "5s",
        ),
        ({"scheduleCancel": "true", "scheduleIdPrefix": ""}, "scheduleIdPrefix", ""),
        ({"scheduleIdPrefix": "a"}, "scheduleIdPrefix", "a"),
        ({"scheduleCancel": "true", "scheduleIdPrefix": "a", "scheduleId": "a1"}, "scheduleId", "a1"),
        ({"scheduleCancel": "true", "scheduleIdPrefix": "a\x01"}, "scheduleIdPrefix", "a\\x01"),
        ({"scheduleCancel": "true", "scheduleIdPrefix": "a", "ttl": "5s"}, "ttl", "5s"),
        (
            {"schedulePause": "true", "scheduleId": "x", "scheduleTimeZone": "Europe/Paris"},
            "scheduleTimeZone",
            "Europe/Paris",
        ),
        ({"scheduleCancel": "true", "scheduleIdPrefix": "a", "scheduleLimit": "3"}, "scheduleLimit", "3"),
        # scheduleTrigger and scheduleReschedule (tests/components/test_instance_timecontrol.py)
        ({"scheduleTrigger": "true"}, "scheduleTrigger", "true"),
        ({"scheduleTrigger": "yes", "scheduleId": "x"}, "scheduleTrigger", "yes"),
        ({"scheduleTrigger": "false", "scheduleId": "x"}, "scheduleTrigger", "false"),
        ({"scheduleReschedule": "soon", "scheduleId": "x"}, "scheduleReschedule", "soon"),
        ({"scheduleReschedule": "-5s", "scheduleId": "x"}, "scheduleReschedule", "-5s"),
        ({"scheduleReschedule": "2h"}, "scheduleReschedule", "2h"),
        ({"scheduleReschedule": "100000000h", "scheduleId": "x"}, "scheduleReschedule", "100000000h"),
        (
            {"scheduleTrigger": "true", "scheduleReschedule": "2h", "scheduleId": "x"},
            "scheduleReschedule",
            "2h",
        ),
        ({"scheduleTrigger": "true", "scheduleCancel": "true", "scheduleId": "x"}, "scheduleCancel", "true"),
        ({"scheduleReschedule": "2h", "scheduleCancel": "true", "scheduleId": "x"}, "scheduleCancel", "true"),
        ({"scheduleTrigger": "true", "schedulePause": "true", "scheduleId": "x"}, "schedulePause", "true"),
        (
            {"scheduleTrigger": "true", "scheduleId": "x", "scheduledSendDelay": "5s"},
            "scheduledSendDelay",
            "5s",
        ),
        ({"scheduleReschedule": "2h", "scheduleId": "x", "schedule": "@every 1s"}, "schedule", "@every 1s"),
        ({"scheduleTrigger": "true", "scheduleId": "x\x01"}, "scheduleId", "x\\x01"),
    ],
)
async def test_bad_control_values_are_refused_naming_key_and_value_and_nothing_changes(
    component: Callable[[str], Component],
    delayed_props: dict[str, str],
    redis_client: redis.Redis,
    metadata: dict[str, str],
    key: str,
    value: str,
) -> None:
    c = component("delayed")
    await c.init(delayed_props)
    await c.publish("orders", b"x", {"scheduledSendDelay": "1h", "scheduleId": "x"})
    await c.publish("orders", b"a1", {"scheduledSendDelay": "1h", "scheduleId": "a1"})
    before = (redis_client.hgetall(IDS), redis_client.xlen(HISTORY), redis_client.exists("orders"))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.publish("orders", b"body", metadata)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert key in (err.value.details() or "")
    assert value in (err.value.details() or "")
    assert (redis_client.hgetall(IDS), redis_client.xlen(HISTORY), redis_client.exists("orders")) == before


async def test_the_empty_prefix_refusal_says_it_would_cancel_everything(
    component: Callable[[str], Component], delayed_props: dict[str, str]
) -> None:
    c = component("delayed")
    await c.init(delayed_props)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.publish("orders", b"", {"scheduleCancel": "true", "scheduleIdPrefix": ""})
    assert "would cancel every pending message and schedule" in (err.value.details() or "")


async def test_control_keys_without_delayed_messaging_are_refused(
    component: Callable[[str], Component], props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init(props)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.publish("orders", b"x", {"schedulePause": "true", "scheduleId": "x"})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "schedulePause" in (err.value.details() or "")
    assert "enableDelayedMessaging" in (err.value.details() or "")
    assert not redis_client.exists("orders")


async def test_a_bulk_entry_with_a_control_key_fails_alone_and_stores_nothing_for_it(
    component: Callable[[str], Component], delayed_props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init(delayed_props)
    reply = await c.bulk_publish(
        "orders",
        [
            pubsub_pb2.BulkMessageEntry(entry_id="1", event=b"one"),
            pubsub_pb2.BulkMessageEntry(
                entry_id="2", event=b"two", metadata={"schedulePause": "true", "scheduleId": "x"}
            ),
        ],
    )
    assert [f.entry_id for f in reply.failed_entries] == ["2"]
    assert "schedulePause" in reply.failed_entries[0].error
    assert [f[b"data"] for _, f in stream_entries(redis_client, "orders")] == [b"one"]
