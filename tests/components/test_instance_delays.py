"""Delayed publishing through the component, driven over gRPC as daprd drives it."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import redis

from delayed_middleware.entry import decode_entry
from delayed_middleware.envelope import decode_envelope
from delayed_middleware.instants import format_instant
from delayed_pubsub_pb.dapr.proto.components.v1 import pubsub_pb2
from tests.components.driver import Component
from tests.redis_server import RedisServer, stream_entries


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@pytest.fixture
def delayed_props(props: dict[str, str]) -> dict[str, str]:
    return {**props, "enableDelayedMessaging": "true"}


async def test_delay_refused_when_disabled_and_nothing_stored(
    component: Callable[[str], Component], props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("plain")
    await c.init(props)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.publish("orders", b"{}", {"scheduledSendDelay": "5s"})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "scheduledSendDelay" in (err.value.details() or "")
    assert "enableDelayedMessaging" in (err.value.details() or "")
    assert redis_client.dbsize() == 0


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("scheduledSendTime", "2045-11-05T08:15:30"),  # no offset
        ("scheduledSendTime", "tomorrow"),
        ("scheduledSendTime", "2045-13-05T08:15:30Z"),
        ("scheduledSendDelay", "90 seconds"),
        ("scheduledSendDelay", "-5s"),
        ("scheduledSendDelay", "1d"),
        ("scheduledSendDelay", ""),
    ],
)
async def test_bad_delay_values_refused_naming_key_and_value(
    component: Callable[[str], Component],
    delayed_props: dict[str, str],
    redis_client: redis.Redis,
    key: str,
    value: str,
) -> None:
    c = component("delayed")
    await c.init(delayed_props)
    before = redis_client.dbsize()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.publish("orders", b"{}", {key: value})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = err.value.details() or ""
    assert key in details
    assert repr(value) in details
    assert redis_client.dbsize() == before  # nothing stored
    assert not redis_client.exists("orders")


async def test_max_delay_enforced(
    component: Callable[[str], Component], delayed_props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init({**delayed_props, "maxDelay": "1h"})
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.publish("orders", b"{}", {"scheduledSendDelay": "2h"})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "2h" in (err.value.details() or "")
    await c.publish("orders", b"{}", {"scheduledSendDelay": "59m"})
    assert int(redis_client.get("{app1-delayed}:pending") or 0) == 1


async def test_delayed_message_arrives_on_time_byte_exact_once(
    component: Callable[[str], Component], delayed_props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init(delayed_props)
    stream = await c.subscribe("orders")
    data = b'{"specversion":"1.0","id":"66","data":{"execute-order":"66"}}'
    due = now_ms() + 1200
    md = {"scheduledSendTime": format_instant(due), "traceparent": "00-abc-01", "cloudevent.id": "66"}
    await c.publish("orders", data, md)

    # While it waits, it is an envelope on the <consumerID>-delayed topic.
    [(envelope_id, fields)] = stream_entries(redis_client, "app1-delayed")
    envelope = decode_envelope(decode_entry(fields).data)
    assert (envelope.topic, envelope.message, envelope.due_ms) == ("orders", data, due)
    assert envelope.pubsub_name == "delayed"
    assert await stream.nothing_for(0.8)

    msg = await stream.next(within=3)
    received = now_ms()
    assert received >= due, f"early by {due - received} ms"
    assert received - due < 300, f"late by {received - due} ms"
    assert msg.data == data
    assert msg.topic_name == "orders"
    assert {k: msg.metadata[k] for k in md} == md  # every user key verbatim
    assert msg.metadata["scheduleNext"] == "purge"  # a one-shot
    assert msg.metadata["scheduler"] == envelope_id  # traceable to the delayed topic
    assert msg.metadata["deliveryAttempt"] == "1"
    await stream.ack(msg.id)
    assert await stream.nothing_for(0.5)  # exactly once
    assert redis_client.xlen("app1-delayed") == 0
    await stream.close()


async def test_past_time_and_zero_delay_deliver_at_once(
    component: Callable[[str], Component], delayed_props: dict[str, str]
) -> None:
    c = component("delayed")
    await c.init(delayed_props)
    stream = await c.subscribe("orders")
    t0 = time.monotonic()
    await c.publish("orders", b"past", {"scheduledSendTime": "2001-01-01T00:00:00Z"})
    await c.publish("orders", b"zero", {"scheduledSendDelay": "0s"})
    got = {(await stream.next(within=2)).data for _ in range(2)}
    assert got == {b"past", b"zero"}
    assert time.monotonic() - t0 < 1.0


async def test_schedule_id_replaces_pending(
    component: Callable[[str], Component], delayed_props: dict[str, str]
) -> None:
    c = component("delayed")
    await c.init(delayed_props)
    stream = await c.subscribe("orders")
    await c.publish("orders", b"first", {"scheduledSendDelay": "600ms", "scheduleId": "order-66"})
    await c.publish("orders", b"second", {"scheduledSendDelay": "700ms", "scheduleId": "order-66"})
    msg = await stream.next(within=3)
    assert msg.data == b"second"
    assert msg.metadata["scheduler"] == "order-66"
    await stream.ack(msg.id)
    assert await stream.nothing_for(0.6)


async def test_bulk_delayed_as_one_batch_with_entry_override_and_bad_entry(
    component: Callable[[str], Component], delayed_props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init(delayed_props)
    entries = [
        pubsub_pb2.BulkMessageEntry(entry_id=f"e{i}", event=f"ev{i}".encode(), content_type="text/plain")
        for i in range(20)
    ]
    entries.append(
        pubsub_pb2.BulkMessageEntry(entry_id="late", event=b"late", metadata={"scheduledSendDelay": "1500ms"})
    )
    entries.append(
        pubsub_pb2.BulkMessageEntry(entry_id="bad", event=b"bad", metadata={"scheduledSendDelay": "soon"})
    )
    reply = await c.bulk_publish("orders", entries, {"scheduledSendDelay": "500ms"})
    assert [(f.entry_id, "soon" in f.error) for f in reply.failed_entries] == [("bad", True)]

    envelopes = [
        decode_envelope(decode_entry(f).data) for _, f in stream_entries(redis_client, "app1-delayed")
    ]
    assert sorted((e.is_bulk, len(e.bulk_entries)) for e in envelopes) == [(False, 0), (True, 20)]

    stream = await c.subscribe("orders")
    first = [await stream.next(within=3)]
    # One atomic batch: when the first entry is visible, all twenty are there.
    assert redis_client.xlen("orders") == 20
    await stream.ack(first[0].id)
    for _ in range(19):  # ack as we go: at most `concurrency` messages are in flight
        first.append(await stream.next(within=3))
        await stream.ack(first[-1].id)
    assert [m.data for m in first] == [f"ev{i}".encode() for i in range(20)]
    assert {m.content_type for m in first} == {"text/plain"}
    ids = [tuple(int(p) for p in m.id.split("-")) for m in first]
    assert ids == sorted(ids)  # in order
    late = await stream.next(within=3)
    assert late.data == b"late"
    await stream.ack(late.id)
    assert await stream.nothing_for(0.3)
    assert b"bad" not in json.dumps([m.data.decode() for m in first]).encode()


async def test_delayed_topic_is_a_topic_subscribers_can_pull(
    component: Callable[[str], Component], delayed_props: dict[str, str]
) -> None:
    c = component("delayed")
    await c.init(delayed_props)
    watcher = await c.subscribe("app1-delayed")
    await c.publish("orders", b"later", {"scheduledSendDelay": "1h", "scheduleId": "x"})
    msg = await watcher.next(within=3)
    envelope = decode_envelope(msg.data)
    assert (envelope.topic, envelope.message, envelope.schedule_id) == ("orders", b"later", "x")


async def test_overdue_fire_when_instance_starts(
    component: Callable[[str], Component], delayed_props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init(delayed_props)
    await c.publish("orders", b"soon", {"scheduledSendDelay": "300ms"})
    # The component goes down (re-Init closes the old instance) past the due time.
    await c.init({**delayed_props, "enableDelayedMessaging": "false"})
    await asyncio.sleep(0.6)
    assert not redis_client.exists("orders")  # overdue, but nothing fires it
    await c.init(delayed_props)
    stream = await c.subscribe("orders")
    msg = await stream.next(within=3)
    assert msg.data == b"soon"


async def test_retention_never_trims_pending_messages(
    component: Callable[[str], Component], delayed_props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init({**delayed_props, "maxLenApprox": "10"})
    for i in range(300):
        await c.publish("orders", f"later {i}".encode(), {"scheduledSendDelay": "1h"})
    await c.bulk_publish(
        "orders", [pubsub_pb2.BulkMessageEntry(entry_id=str(i), event=b"now") for i in range(300)]
    )
    assert redis_client.xlen("orders") < 300  # ordinary topics are trimmed as configured
    assert redis_client.xlen("app1-delayed") == 300  # the delayed topic never is
    assert int(redis_client.get("{app1-delayed}:pending") or 0) == 300
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.publish("app1-delayed", b"x")  # nor can a plain publish land there
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "app1-delayed" in (err.value.details() or "")
    assert redis_client.xlen("app1-delayed") == 300


async def test_request_schedule_id_is_the_batch_s_alone(
    component: Callable[[str], Component], delayed_props: dict[str, str]
) -> None:
    """A request-level scheduleId names the batch envelope; entries delayed on their own keep theirs."""
    c = component("delayed")
    await c.init(delayed_props)
    entries = [
        pubsub_pb2.BulkMessageEntry(
            entry_id=f"own{i}", event=f"own{i}".encode(), metadata={"scheduledSendDelay": "300ms"}
        )
        for i in range(3)
    ]
    entries += [pubsub_pb2.BulkMessageEntry(entry_id=f"b{i}", event=f"b{i}".encode()) for i in range(2)]
    entries.append(
        pubsub_pb2.BulkMessageEntry(
            entry_id="dup1", event=b"dup1", metadata={"scheduledSendDelay": "300ms", "scheduleId": "x"}
        )
    )
    entries.append(
        pubsub_pb2.BulkMessageEntry(
            entry_id="dup2", event=b"dup2", metadata={"scheduledSendDelay": "300ms", "scheduleId": "x"}
        )
    )
    reply = await c.bulk_publish("orders", entries, {"scheduleId": "batch-7", "scheduledSendDelay": "200ms"})
    assert [(f.entry_id, "scheduleId" in f.error and "'x'" in f.error) for f in reply.failed_entries] == [
        ("dup2", True)
    ]
    stream = await c.subscribe("orders")
    got = []
    for _ in range(6):
        msg = await stream.next(within=3)
        got.append(msg.data)
        await stream.ack(msg.id)
    assert sorted(got) == [b"b0", b"b1", b"dup1", b"own0", b"own1", b"own2"]  # none silently replaced
    assert await stream.nothing_for(0.3)


async def test_delayed_publish_to_a_stalled_redis_fails_within_the_call_timeout(
    component: Callable[[str], Component], tmp_path: Path
) -> None:
    private = RedisServer(tmp_path / "stalled")
    private.start()
    try:
        c = component("delayed")
        await c.init(
            {
                "redisHost": f"127.0.0.1:{private.port}",
                "consumerID": "app1",
                "enableDelayedMessaging": "true",
                "readTimeout": "500ms",
                "writeTimeout": "500ms",
            }
        )
        assert private.proc is not None
        private.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.publish("orders", b"later", {"scheduledSendDelay": "1h"})
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - t0 < 3
        finally:
            private.proc.send_signal(signal.SIGCONT)
    finally:
        private.stop()


# --- the reserved namespace and topics that are not streams ---------------------


@pytest.mark.parametrize(
    "topic",
    [
        "{app1-delayed}:due",
        "{app1-delayed}:ids",
        "{app1-delayed}:pending",
        "{app1-delayed}:history",
        "{other-delayed}:due:1",
        "other-delayed",  # another app's delayed topic
        "app1-delayed",
    ],
)
async def test_engine_keys_and_every_apps_delayed_topic_refuse_plain_publishes(
    component: Callable[[str], Component],
    delayed_props: dict[str, str],
    redis_client: redis.Redis,
    topic: str,
) -> None:
    c = component("delayed")
    # Another app (consumerID) with trimming on: it must not reach app1's keys.
    await c.init({**delayed_props, "consumerID": "intruder", "maxLenApprox": "1"})
    for call in (
        c.publish(topic, b"x"),
        c.publish(topic, b"x", {"scheduledSendDelay": "1s"}),
        c.bulk_publish(topic, [pubsub_pb2.BulkMessageEntry(entry_id="1", event=b"x")]),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert topic in (err.value.details() or "")
    assert redis_client.exists(topic) == 0


async def test_another_app_cannot_trim_a_delayed_topic(
    component: Callable[[str], Component], delayed_props: dict[str, str], redis_client: redis.Redis
) -> None:
    owner, other = component("owner"), component("other")
    await owner.init(delayed_props)
    await other.init({**delayed_props, "consumerID": "other", "maxLenApprox": "10"})
    for i in range(300):
        await owner.publish("orders", f"{i}".encode(), {"scheduledSendDelay": "1h"})
    with pytest.raises(grpc.aio.AioRpcError):
        await other.publish("app1-delayed", b"x")
    assert redis_client.xlen("app1-delayed") == 300


async def test_engine_keys_cannot_be_subscribed_but_delayed_topics_can(
    component: Callable[[str], Component], delayed_props: dict[str, str]
) -> None:
    c = component("delayed")
    await c.init(delayed_props)
    stream = await c.subscribe("{app1-delayed}:due")
    code, details = await stream.status()
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "{app1-delayed}:due" in details
    watcher = await c.subscribe("other-delayed")  # reading any delayed topic is allowed
    assert watcher is not None


async def test_topics_whose_key_is_not_a_stream_are_refused_clearly(
    component: Callable[[str], Component], delayed_props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init(delayed_props)
    redis_client.hset("a-hash", "f", "v")
    for call in (c.publish("a-hash", b"x"), c.publish("a-hash", b"x", {"scheduledSendDelay": "1s"})):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "a-hash" in (err.value.details() or "")
    assert redis_client.xlen("app1-delayed") == 0  # nothing stored
    assert redis_client.hgetall("a-hash") == {b"f": b"v"}
    # Subscribing answers at once instead of retrying XGROUP CREATE forever.
    stream = await c.subscribe("a-hash")
    code, details = await stream.status()
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "a-hash" in details


async def test_delayed_publish_records_its_history(
    component: Callable[[str], Component], delayed_props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init(delayed_props)
    await c.publish("orders", b"soon", {"scheduledSendDelay": "200ms", "scheduleId": "h1"})
    stream = await c.subscribe("orders")
    assert (await stream.next(within=5)).data == b"soon"
    events = [f[b"event"] for _, f in stream_entries(redis_client, "{app1-delayed}:history")]
    assert events == [b"scheduled", b"fired"]


# --- pubsub.pulsar's delay keys: an app moving from Pulsar changes no code ---


@pytest.mark.parametrize("key", ["deliverAfter", "deliverAt"])
async def test_pulsar_delay_key_delivers_when_due_not_at_once(
    component: Callable[[str], Component], delayed_props: dict[str, str], redis_client: redis.Redis, key: str
) -> None:
    c = component("delayed")
    await c.init(delayed_props)
    stream = await c.subscribe("orders")
    published = now_ms()
    value = "1200ms" if key == "deliverAfter" else format_instant(published + 1200)
    await c.publish("orders", b'{"n":1}', {key: value})

    # It waits as an envelope, not on the topic.
    assert redis_client.xlen("app1-delayed") == 1
    assert await stream.nothing_for(0.8)
    msg = await stream.next(within=3)
    assert now_ms() >= published + 1200
    assert msg.data == b'{"n":1}'
    assert msg.metadata[key] == value
    assert msg.metadata["scheduleNext"] == "purge"
    await stream.ack(msg.id)
    assert await stream.nothing_for(0.3)
    await stream.close()


@pytest.mark.parametrize(
    ("metadata", "first", "second"),
    [
        ({"scheduledSendDelay": "5s", "deliverAfter": "5s"}, "scheduledSendDelay", "deliverAfter"),
        (
            {"scheduledSendTime": "2045-11-05T08:15:30Z", "deliverAt": "2045-11-05T08:15:30Z"},
            "scheduledSendTime",
            "deliverAt",
        ),
        ({"deliverAt": "2045-11-05T08:15:30Z", "deliverAfter": "5s"}, "deliverAt", "deliverAfter"),
        ({"schedule": "@every 5s", "deliverAfter": "5s"}, "schedule", "deliverAfter"),
        (
            {"schedule": "@at 2045-11-05T08:15:30Z", "deliverAt": "2045-11-05T08:15:30Z"},
            "schedule",
            "deliverAt",
        ),
    ],
)
async def test_pulsar_delay_key_with_another_timing_is_refused_naming_both_and_nothing_stored(
    component: Callable[[str], Component],
    delayed_props: dict[str, str],
    redis_client: redis.Redis,
    metadata: dict[str, str],
    first: str,
    second: str,
) -> None:
    c = component("delayed")
    await c.init(delayed_props)
    before = redis_client.dbsize()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.publish("orders", b"{}", metadata)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = err.value.details() or ""
    assert f"{first}=" in details
    assert f"{second}=" in details
    assert redis_client.dbsize() == before
    assert not redis_client.exists("orders")


async def test_pulsar_delay_key_is_refused_while_delayed_messaging_is_disabled(
    component: Callable[[str], Component], props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("plain")
    await c.init(props)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.publish("orders", b"{}", {"deliverAfter": "5s"})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "deliverAfter='5s'" in (err.value.details() or "")
    assert "enableDelayedMessaging" in (err.value.details() or "")
    assert redis_client.dbsize() == 0
