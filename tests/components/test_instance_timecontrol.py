"""scheduleTrigger and scheduleReschedule through the component, driven over gRPC (a real unix
socket) as daprd drives it, on a real Redis: what a subscriber receives and when, what the history
and the metrics say, FAILED_PRECONDITION for a move that came after the fire, INVALID_ARGUMENT for
a recurring one. (Bad values: the control keys' table in test_instance_pause.py.)"""

from __future__ import annotations

import json
import time

import grpc
import pytest
import redis

from delayed_middleware.history import decode_record
from delayed_middleware.instants import parse_instant
from delayed_pubsub.server import ComponentServer
from tests.components.driver import Component
from tests.components.test_operate_pause import app
from tests.redis_server import stream_entries

HISTORY = "{app1-delayed}:history"
IDS = "{app1-delayed}:ids"


__all__ = ["app"]  # the fixture: an instance with delayed messaging on (test_operate_pause.py)


def sample(server: ComponentServer, **labels: str) -> float:
    value = server.metrics.registry.get_sample_value(
        "delayed_pubsub_time_controls_total", {"instance": "delayed", **labels}
    )
    return 0.0 if value is None else value


def events(client: redis.Redis, id: str) -> list[str]:
    return [r.event for r in (decode_record(i, f) for i, f in stream_entries(client, HISTORY)) if r.id == id]


async def test_a_triggered_one_shot_arrives_now_once_and_the_body_sent_is_ignored(
    server: ComponentServer,
    app: Component,
    redis_client: redis.Redis,
) -> None:
    c = app
    stream = await c.subscribe("orders")
    await c.publish("orders", b"order", {"scheduledSendDelay": "1h", "scheduleId": "o-1"})
    started = time.monotonic()
    await c.publish("orders", b"ignored", {"scheduleTrigger": "true", "scheduleId": "o-1"})
    msg = await stream.next(within=2)
    assert time.monotonic() - started < 1.0
    assert msg.data == b"order"
    assert msg.metadata["scheduler"] == "o-1"
    await stream.ack(msg.id)
    assert await stream.nothing_for(1.0)
    assert events(redis_client, "o-1") == ["scheduled", "triggered", "fired"]
    assert sample(server, op="trigger", result="triggered") == 1
    # Again: nothing pending (it fired), answered OK and counted.
    await c.publish("orders", b"", {"scheduleTrigger": "TRUE", "scheduleId": "o-1"})
    assert sample(server, op="trigger", result="fired") == 1
    await c.publish("orders", b"", {"scheduleTrigger": "true", "scheduleId": "nobody"})
    assert sample(server, op="trigger", result="unknown") == 1
    await stream.close()


async def test_a_triggered_schedule_delivers_an_extra_occurrence_stamped_with_its_time(
    app: Component, redis_client: redis.Redis
) -> None:
    c = app
    stream = await c.subscribe("ticks")
    await c.publish("ticks", b"tick", {"schedule": "@every 1h", "scheduleId": "hourly"})
    before = redis_client.hget(IDS, "hourly")
    at = time.time_ns() // 1_000_000
    await c.publish("ticks", b"", {"scheduleTrigger": "true", "scheduleId": "hourly"})
    msg = await stream.next(within=2)
    await stream.ack(msg.id)
    assert msg.data == b"tick"
    assert msg.metadata["scheduler"] == "hourly"
    assert abs(parse_instant(msg.metadata["scheduleOccurrence"]) - at) < 2_000
    assert msg.metadata["scheduleOccurrence"].endswith("Z")
    assert len(msg.metadata["scheduleOccurrence"]) == len("2026-11-29T09:00:00.123Z")
    assert parse_instant(msg.metadata["scheduleNext"]) - at > 3_500_000
    # Its next occurrence stays where it was.
    assert redis_client.hget(IDS, "hourly") == before
    await stream.close()


async def test_a_rescheduled_one_shot_arrives_at_its_new_time(
    server: ComponentServer, app: Component, redis_client: redis.Redis
) -> None:
    c = app
    await c.publish("orders", b"late", {"scheduledSendDelay": "1h", "scheduleId": "m"})
    stream = await c.subscribe("orders")
    started = time.monotonic()
    moved_to = time.time_ns() // 1_000_000 + 1_500
    await c.publish("orders", b"", {"scheduleReschedule": "1500ms", "scheduleId": "m"})
    assert await stream.nothing_for(1.0)
    msg = await stream.next(within=2)
    assert 1.3 < time.monotonic() - started < 3.0
    assert msg.data == b"late"
    # Its occurrence is its new time (a move, not a copy of the old one).
    assert abs(parse_instant(msg.metadata["scheduleOccurrence"]) - moved_to) < 1_000
    await stream.ack(msg.id)
    assert events(redis_client, "m") == ["scheduled", "rescheduled", "fired"]
    assert sample(server, op="reschedule", result="rescheduled") == 1
    # It fired: moving it again is refused with FAILED_PRECONDITION naming the id.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.publish("orders", b"", {"scheduleReschedule": "2045-01-01T00:00:00Z", "scheduleId": "m"})
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "'m'" in (err.value.details() or "")
    assert "already fired" in (err.value.details() or "")
    await c.publish("orders", b"", {"scheduleReschedule": "5s", "scheduleId": "nobody"})
    assert sample(server, op="reschedule", result="unknown") == 1
    await stream.close()


async def test_rescheduling_a_recurring_schedule_is_refused_and_changes_nothing(
    app: Component, redis_client: redis.Redis
) -> None:
    c = app
    await c.publish("ticks", b"tick", {"schedule": "@every 1h", "scheduleId": "hourly"})
    before = (redis_client.hgetall(IDS), redis_client.xlen(HISTORY))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.publish("ticks", b"", {"scheduleReschedule": "10m", "scheduleId": "hourly"})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "scheduleReschedule" in (err.value.details() or "")
    assert "10m" in (err.value.details() or "")
    assert (redis_client.hgetall(IDS), redis_client.xlen(HISTORY)) == before


def cloud_event(id: str) -> bytes:
    """The data daprd publishes: its CloudEvent envelope, the same on each of its retries of one publish."""
    return json.dumps({"specversion": "1.0", "id": id, "source": "app", "type": "t", "data": ""}).encode()


async def test_a_trigger_publish_retried_with_its_cloudevent_id_delivers_once(app: Component) -> None:
    c = app
    stream = await c.subscribe("ticks")
    await c.publish("ticks", b"tick", {"schedule": "@every 1h", "scheduleId": "hourly"})
    trigger = {"scheduleTrigger": "true", "scheduleId": "hourly"}
    # daprd resends one publish after a timeout: both answered OK, one extra occurrence.
    await c.publish("ticks", cloud_event("ce-1"), trigger)
    await c.publish("ticks", cloud_event("ce-1"), trigger)
    msg = await stream.next(within=2)
    await stream.ack(msg.id)
    assert await stream.nothing_for(1.0)
    # Another publish (another CloudEvent id) is another occurrence.
    await c.publish("ticks", cloud_event("ce-2"), trigger)
    msg = await stream.next(within=2)
    await stream.ack(msg.id)
    assert msg.data == b"tick"
    await stream.close()
