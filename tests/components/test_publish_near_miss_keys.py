"""A publish key spelt almost right (another case, a typo) is ignored, so the message goes out
without what it asked for: the component warns about it, once per key, naming the key it resembles."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import pytest
import redis

from delayed_middleware import publish_keys
from delayed_pubsub_pb.dapr.proto.components.v1 import pubsub_pb2
from tests.components.driver import Component
from tests.redis_server import stream_entries


@pytest.fixture(autouse=True)
def fresh_process() -> Iterator[None]:
    """The near-miss memory of a new process (it is process-wide, and other tests publish too)."""
    publish_keys.forget_near_misses()
    yield
    publish_keys.forget_near_misses()


def entry(metadata: dict[str, str]) -> pubsub_pb2.BulkMessageEntry:
    return pubsub_pb2.BulkMessageEntry(entry_id="e1", event=b"{}", metadata=metadata)


def near_miss_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "publish metadata key" in r.getMessage()
    ]


async def test_a_near_miss_of_a_publish_key_is_warned_about_once_naming_the_key_it_resembles(
    component: Callable[[str], Component],
    props: dict[str, str],
    redis_client: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    c = component("delayed")
    await c.init({**props, "enableDelayedMessaging": "true"})
    caplog.set_level(logging.WARNING)
    await c.publish("orders", b"one", {"scheduledsenddelay": "5s"})
    await c.publish("orders", b"two", {"scheduledsenddelay": "5s", "traceparent": "00-abc-01"})
    # Published as plain messages (the trap the warning points at), and warned about once.
    assert len(stream_entries(redis_client, "orders")) == 2
    assert near_miss_warnings(caplog) == [
        "publish metadata key 'scheduledsenddelay' is not read: keys are case-sensitive, "
        "did you mean scheduledSendDelay?"
    ]


async def test_a_near_miss_in_a_bulk_entry_or_its_request_is_warned_about_and_a_correct_delayed_publish_is_not(
    component: Callable[[str], Component],
    props: dict[str, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    c = component("delayed")
    await c.init({**props, "enableDelayedMessaging": "true"})
    caplog.set_level(logging.WARNING)
    await c.publish(
        "orders", b"{}", {"scheduledSendDelay": "5s", "traceparent": "00-abc-01", "customer": "7"}
    )
    await c.bulk_publish("orders", [entry({"scheduledSendDelay": "5s", "tenant": "a"})])
    assert near_miss_warnings(caplog) == []
    await c.bulk_publish("orders", [entry({"scheduleTimezone": "UTC"})])
    await c.bulk_publish("orders", [entry({"scheduleTimezone": "UTC"})])
    await c.bulk_publish("orders", [entry({})], {"deliverafter": "5s"})
    assert near_miss_warnings(caplog) == [
        "publish metadata key 'scheduleTimezone' is not read: keys are case-sensitive, "
        "did you mean scheduleTimeZone?",
        "publish metadata key 'deliverafter' is not read: keys are case-sensitive, did you mean deliverAfter?",
    ]
