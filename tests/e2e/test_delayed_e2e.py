"""Delayed messages under a real daprd, published the ways a user does (curl, the Python SDK).

What a user checks: the payload arrives intact, never before it is due, and soon after
(within LATENESS_TOLERANCE_MS). Due times are computed from the test's clock *before* the
publish call, so a correct engine can only be later than them, never earlier.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import PUBSUB
from tests.e2e.harness import (
    LATENESS,
    LATENESS_TOLERANCE_MS,
    Stack,
    carries,
    dapr_client,
    now_ms,
    rfc3339,
    unique,
)
from tests.e2e.user import assert_on_time, header, instant_ms

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("delay", ["2s", "3"], ids=["go-duration", "whole-seconds"])
def test_http_scheduled_send_delay(stack: Stack, delay: str) -> None:
    marker = unique("delay")
    delay_ms = int(delay.removesuffix("s")) * 1000
    t0 = now_ms()
    payload = {"id": marker, "due_ms": t0 + delay_ms}
    response = stack.publish(PUBSUB, "later", payload, metadata={"scheduledSendDelay": delay})
    assert response.status_code == 204, response.text
    assert_on_time(stack, f"http scheduledSendDelay={delay}", marker, t0 + delay_ms, payload)


def test_delivered_delayed_message_carries_its_metadata(stack: Stack) -> None:
    """User metadata verbatim, plus scheduleNext=purge (a one-shot) and deliveryAttempt=1 (HTTP headers)."""
    marker = unique("meta")
    t0 = now_ms()
    payload = {"id": marker, "due_ms": t0 + 1000}
    response = stack.publish(
        PUBSUB, "later", payload, metadata={"scheduledSendDelay": "1s", "customer": "acme-42"}
    )
    assert response.status_code == 204, response.text
    arrival = assert_on_time(stack, "http scheduledSendDelay=1s", marker, t0 + 1000, payload)
    assert header(arrival, "customer") == "acme-42"
    assert header(arrival, "deliveryAttempt") == "1"
    assert header(arrival, "scheduleNext") == "purge"
    # A one-shot's occurrence is its due time (the server's receipt plus the delay).
    occurrence = instant_ms(header(arrival, "scheduleOccurrence"))
    assert t0 + 1000 <= occurrence <= arrival["received_ms"]


@pytest.mark.parametrize("offset_hours", [0, -5], ids=["zulu", "offset"])
def test_http_scheduled_send_time(stack: Stack, offset_hours: int) -> None:
    marker = unique("at")
    due_ms = (now_ms() // 1000 + 3) * 1000  # a whole second, 2-3 s ahead
    payload = {"id": marker, "due_ms": due_ms}
    response = stack.publish(
        PUBSUB, "later", payload, metadata={"scheduledSendTime": rfc3339(due_ms, offset_hours)}
    )
    assert response.status_code == 204, response.text
    assert_on_time(stack, f"http scheduledSendTime {rfc3339(due_ms, offset_hours)}", marker, due_ms, payload)


def test_http_past_scheduled_send_time_is_delivered_at_once(stack: Stack) -> None:
    marker = unique("past")
    t0 = now_ms()
    payload = {"id": marker}
    response = stack.publish(PUBSUB, "later", payload, metadata={"scheduledSendTime": rfc3339(t0 - 60_000)})
    assert response.status_code == 204, response.text
    [arrival] = stack.wait_arrivals(carries(marker), 1, timeout=10)
    assert arrival["received_ms"] - t0 <= LATENESS_TOLERANCE_MS


def test_earlier_due_message_is_not_held_behind_a_later_one(stack: Stack) -> None:
    """Published second but due first: it must not wait for the first one's due time."""
    late, soon = unique("late"), unique("soon")
    t0 = now_ms()
    late_payload = {"id": late, "due_ms": t0 + 6000}
    assert (
        stack.publish(PUBSUB, "later", late_payload, metadata={"scheduledSendDelay": "6s"}).status_code == 204
    )
    t1 = now_ms()
    soon_payload = {"id": soon, "due_ms": t1 + 2000}
    assert (
        stack.publish(PUBSUB, "later", soon_payload, metadata={"scheduledSendDelay": "2s"}).status_code == 204
    )
    assert_on_time(stack, "http delay 2s behind a 6s one", soon, t1 + 2000, soon_payload)
    assert_on_time(stack, "http delay 6s", late, t0 + 6000, late_payload)


def test_sdk_scheduled_send_delay(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = unique("sdk-delay")
    with dapr_client(stack, monkeypatch) as client:
        t0 = now_ms()  # after the client's own start-up (it probes the sidecar first)
        payload = {"id": marker, "due_ms": t0 + 2000}
        client.publish_event(
            PUBSUB,
            "sdk",
            json.dumps(payload),
            data_content_type="application/json",
            publish_metadata={"scheduledSendDelay": "2s"},
        )
    assert_on_time(stack, "sdk scheduledSendDelay=2s", marker, t0 + 2000, payload)


def test_sdk_scheduled_send_time(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = unique("sdk-at")
    due_ms = (now_ms() // 1000 + 3) * 1000
    payload = {"id": marker, "due_ms": due_ms}
    with dapr_client(stack, monkeypatch) as client:
        client.publish_event(
            PUBSUB,
            "sdk",
            json.dumps(payload),
            data_content_type="application/json",
            publish_metadata={"scheduledSendTime": rfc3339(due_ms, -5)},
        )
    assert_on_time(stack, "sdk scheduledSendTime", marker, due_ms, payload)


def test_bad_delay_metadata_is_refused(stack: Stack) -> None:
    """The contract: a bad value is refused (INVALID_ARGUMENT, surfaced by daprd as an error), nothing stored."""
    marker = unique("bad")
    response = stack.publish(PUBSUB, "later", {"id": marker}, metadata={"scheduledSendDelay": "soon-ish"})
    assert response.status_code >= 400, response.text
    assert "scheduledSendDelay" in response.text
    assert stack.wait_arrivals(carries(marker), 1, timeout=3) == []


def test_http_pulsar_deliver_after_arrives_when_due(stack: Stack) -> None:
    """An app written for pubsub.pulsar (`?metadata.deliverAfter=2s`) works unchanged."""
    marker = unique("pulsar-after")
    t0 = now_ms()
    payload = {"id": marker, "due_ms": t0 + 2000}
    response = stack.publish(PUBSUB, "later", payload, metadata={"deliverAfter": "2s"})
    assert response.status_code == 204, response.text
    arrival = assert_on_time(stack, "http deliverAfter=2s", marker, t0 + 2000, payload)
    assert header(arrival, "deliverAfter") == "2s"


def test_http_pulsar_deliver_at_arrives_when_due(stack: Stack) -> None:
    marker = unique("pulsar-at")
    due_ms = (now_ms() // 1000 + 3) * 1000
    payload = {"id": marker, "due_ms": due_ms}
    response = stack.publish(PUBSUB, "later", payload, metadata={"deliverAt": rfc3339(due_ms)})
    assert response.status_code == 204, response.text
    assert_on_time(stack, "http deliverAt", marker, due_ms, payload)


def test_pulsar_and_our_delay_key_together_are_refused_naming_both(stack: Stack) -> None:
    marker = unique("pulsar-both")
    response = stack.publish(
        PUBSUB, "later", {"id": marker}, metadata={"deliverAfter": "2s", "scheduledSendDelay": "2s"}
    )
    assert response.status_code >= 400, response.text
    assert "deliverAfter" in response.text
    assert "scheduledSendDelay" in response.text
    assert stack.wait_arrivals(carries(marker), 1, timeout=4) == []


def test_ttl_longer_than_the_delay_is_delivered(stack: Stack) -> None:
    marker = unique("ttl-ok")
    t0 = now_ms()
    payload = {"id": marker, "due_ms": t0 + 1000}
    response = stack.publish(
        PUBSUB, "later", payload, metadata={"scheduledSendDelay": "1s", "ttlInSeconds": "30"}
    )
    assert response.status_code == 204, response.text
    assert_on_time(stack, "http scheduledSendDelay=1s ttlInSeconds=30", marker, t0 + 1000, payload)


def test_ttl_shorter_than_the_delay_is_never_delivered(stack: Stack) -> None:
    """Expired while it waited: never delivered, not late, not at all."""
    marker = unique("ttl-expired")
    response = stack.publish(
        PUBSUB, "later", {"id": marker}, metadata={"scheduledSendDelay": "2s", "ttlInSeconds": "1"}
    )
    assert response.status_code == 204, response.text
    assert stack.wait_arrivals(carries(marker), 1, timeout=5) == []


def test_bulk_publish_delayed_as_one_batch(stack: Stack) -> None:
    """`/v1.0-alpha1/publish/bulk?metadata.scheduledSendDelay=…`: every entry arrives when due, once."""
    marker = unique("bulkdelay")
    t0 = now_ms()
    due = t0 + 2000
    entries = [
        {"entryId": str(i), "event": {"id": f"{marker}-{i}", "n": i}, "contentType": "application/json"}
        for i in range(5)
    ]
    response = stack.bulk_publish(PUBSUB, "later", entries, metadata={"scheduledSendDelay": "2s"})
    assert response.status_code == 204, response.text
    assert stack.wait_arrivals(carries(marker), 1, timeout=(due - now_ms()) / 1000 - 0.2) == [], (
        "arrived early"
    )
    got = stack.wait_arrivals(carries(marker), 5, timeout=10)
    assert sorted(a["data"]["n"] for a in got) == [0, 1, 2, 3, 4]
    for arrival in got:
        lateness = arrival["received_ms"] - due
        LATENESS.append(("http bulk scheduledSendDelay=2s", lateness))
        assert 0 <= lateness <= LATENESS_TOLERANCE_MS, lateness
        assert header(arrival, "scheduleNext") == "purge"
