"""The component as a plain pub/sub under a real daprd: what a pubsub.redis user relies on."""

from __future__ import annotations

import base64
import itertools
import json
import time

import pytest
import redis

from tests.e2e.conftest import APP_ID, PUBSUB, PUBSUB_B
from tests.e2e.harness import REDELIVER_INTERVAL_S, Stack, carries, dapr_client, unique

pytestmark = pytest.mark.e2e


def test_http_publish_arrives_as_cloudevent(stack: Stack) -> None:
    marker = unique("order")
    payload = {"id": marker, "execute-order": "66", "items": [1, 2, 3]}
    response = stack.publish(PUBSUB, "orders", payload)
    assert response.status_code == 204, response.text

    [got] = stack.wait_arrivals(carries(marker), 1, timeout=15)
    assert got["status"] == 200
    assert got["route"] == f"/events/{PUBSUB}/orders"
    assert got["data"] == payload
    event = json.loads(got["body"])
    assert event["specversion"] == "1.0"
    assert event["pubsubname"] == PUBSUB
    assert event["topic"] == "orders"
    assert event["source"] == APP_ID
    assert event["datacontenttype"] == "application/json"


def test_raw_payload_is_byte_exact(stack: Stack) -> None:
    marker = unique("raw")
    # Not UTF-8, not JSON, with NULs and CR/LF: any re-encoding on the way would show.
    raw = b"\x00\xff\xfe" + marker.encode() + b"\r\n\x80 tail \x00"
    response = stack.publish(
        PUBSUB, "raw", raw, metadata={"rawPayload": "true"}, content_type="application/octet-stream"
    )
    assert response.status_code == 204, response.text

    [got] = stack.wait_arrivals(carries(marker), 1, timeout=15)
    assert got["route"] == f"/events/{PUBSUB}/raw"
    assert base64.b64decode(got["data_base64"]) == raw


def test_bulk_publish_delivers_every_entry_once(stack: Stack) -> None:
    marker = unique("bulk")
    entries = [
        {"entryId": str(i), "event": {"id": f"{marker}-{i}", "n": i}, "contentType": "application/json"}
        for i in range(5)
    ]
    response = stack.bulk_publish(PUBSUB, "bulk", entries)
    assert response.status_code == 204, response.text

    got = stack.wait_arrivals(carries(marker), 5, timeout=15)
    time.sleep(1)  # anything duplicated would show up now
    got = [a for a in stack.arrivals() if carries(marker)(a)]
    assert sorted(a["data"]["n"] for a in got) == [0, 1, 2, 3, 4]
    assert all(a["route"] == f"/events/{PUBSUB}/bulk" for a in got)


def test_app_error_is_redelivered_after_redeliver_interval(stack: Stack) -> None:
    marker = unique("flaky")
    stack.arm_failure(marker, times=2)
    response = stack.publish(PUBSUB, "flaky", {"id": marker})
    assert response.status_code == 204, response.text

    got = stack.wait_arrivals(carries(marker), 3, timeout=30)
    assert [a["status"] for a in got] == [500, 500, 200], got
    gaps = [b["received_ms"] - a["received_ms"] for a, b in itertools.pairwise(got)]
    # The component's policy: an ack_error comes back after redeliverInterval, not at once.
    assert all(gap >= REDELIVER_INTERVAL_S * 1000 * 0.9 for gap in gaps), gaps
    assert all(a["data"] == {"id": marker} for a in got)

    time.sleep(REDELIVER_INTERVAL_S * 3)  # once acked it stays acked
    assert len([a for a in stack.arrivals() if carries(marker)(a)]) == 3


def test_two_instances_on_one_socket_stay_isolated(stack: Stack) -> None:
    marker_a, marker_b = unique("iso-a"), unique("iso-b")
    assert stack.publish(PUBSUB, "iso", {"id": marker_a}).status_code == 204
    assert stack.publish(PUBSUB_B, "iso", {"id": marker_b}).status_code == 204

    [got_a] = stack.wait_arrivals(carries(marker_a), 1, timeout=15)
    [got_b] = stack.wait_arrivals(carries(marker_b), 1, timeout=15)
    assert got_a["route"] == f"/events/{PUBSUB}/iso"
    assert got_a["pubsub"] == PUBSUB
    assert got_b["route"] == f"/events/{PUBSUB_B}/iso"
    assert got_b["pubsub"] == PUBSUB_B

    time.sleep(1)  # neither leaks into the other instance
    assert len([a for a in stack.arrivals() if carries(marker_a)(a)]) == 1
    assert len([a for a in stack.arrivals() if carries(marker_b)(a)]) == 1


def test_sdk_publish_event(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = unique("sdk")
    with dapr_client(stack, monkeypatch) as client:
        client.publish_event(PUBSUB, "sdk", json.dumps({"id": marker}), data_content_type="application/json")
    [got] = stack.wait_arrivals(carries(marker), 1, timeout=15)
    assert got["data"] == {"id": marker}


def test_metadata_with_a_lone_surrogate_escape_reaches_the_app_through_daprd(stack: Stack) -> None:
    # An entry written by hand (or another client) whose metadata JSON escapes a lone surrogate:
    # the message goes to daprd with U+FFFD in its place, which Go's protobuf accepts as UTF-8.
    first = unique("raw")
    assert stack.publish(PUBSUB, "raw", first.encode(), metadata={"rawPayload": "true"}).status_code == 204
    stack.wait_arrivals(carries(first), 1, timeout=15)
    marker = unique("raw")
    client = redis.Redis(port=stack.redis_port)
    try:
        client.xadd("raw", {"data": marker.encode(), "metadata": b'{"rawPayload":"true","k":"a\\ud800b"}'})
    finally:
        client.close()
    [got] = stack.wait_arrivals(carries(marker), 1, timeout=15)
    assert base64.b64decode(got["data_base64"]) == marker.encode()
