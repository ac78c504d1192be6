"""schedulePause and scheduleIdPrefix under a real daprd: HTTP `?metadata.` with curl, and the
Dapr Python SDK's publish_metadata, the way a user drives them (no body needed)."""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import PUBSUB
from tests.e2e.harness import LATENESS_TOLERANCE_MS, Stack, carries, dapr_client, now_ms, unique
from tests.e2e.user import TOPIC, curl_publish, pause_then_resume

pytestmark = pytest.mark.e2e


def test_pause_and_resume_a_schedule_through_curl(stack: Stack) -> None:
    pause_then_resume(stack, TOPIC, unique("paused-sched"), unique("pause"), hold_s=3.5)



def test_pause_and_resume_a_one_shot_through_the_sdk(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    marker, schedule_id = unique("sdk-pause"), unique("sdk-held")
    with dapr_client(stack, monkeypatch) as client:
        published = now_ms()
        client.publish_event(
            PUBSUB,
            "sdk",
            json.dumps({"id": marker}),
            data_content_type="application/json",
            publish_metadata={"scheduledSendDelay": "3s", "scheduleId": schedule_id},
        )
        client.publish_event(
            PUBSUB, "sdk", "{}", publish_metadata={"schedulePause": "true", "scheduleId": schedule_id}
        )
        assert now_ms() - published < 3_000, "the pause came after the message was due"
        # Past its due time, held.
        assert stack.wait_arrivals(carries(marker), 1, timeout=(published + 4_500 - now_ms()) / 1000) == []
        resumed = now_ms()
        client.publish_event(
            PUBSUB, "sdk", "{}", publish_metadata={"schedulePause": "false", "scheduleId": schedule_id}
        )
    got = stack.wait_arrivals(carries(marker), 1, timeout=5)
    assert len(got) == 1
    # Past due when resumed: it fires at once.
    assert got[0]["received_ms"] - resumed <= LATENESS_TOLERANCE_MS + 1_000


def test_cancel_by_prefix_through_curl(stack: Stack) -> None:
    prefix = unique("tenant") + ":"
    kept = unique("kept")
    markers = [unique("prefixed") for _ in range(3)]
    # Due well after the cancel can land, however slow the publishes through daprd are here.
    first = now_ms()
    for i, m in enumerate(markers):
        code, text = curl_publish(
            stack, TOPIC, {"scheduledSendDelay": "6s", "scheduleId": f"{prefix}{i}"}, json.dumps({"id": m})
        )
        assert code == 204, text
    code, text = curl_publish(
        stack, TOPIC, {"scheduledSendDelay": "6s", "scheduleId": f"x{prefix}"}, json.dumps({"id": kept})
    )
    assert code == 204, text
    code, text = curl_publish(stack, TOPIC, {"scheduleCancel": "true", "scheduleIdPrefix": prefix})
    assert code == 204, text
    assert now_ms() - first < 6_000, "the publishes took longer than their delay: nothing was pending"
    assert len(stack.wait_arrivals(carries(kept), 1, timeout=12)) == 1
    for m in markers:
        assert stack.wait_arrivals(carries(m), 1, timeout=0) == [], "a message cancelled by prefix fired"


def test_cancel_by_prefix_through_the_sdk(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    prefix = unique("sdk-tenant") + ":"
    marker = unique("sdk-prefixed")
    with dapr_client(stack, monkeypatch) as client:
        client.publish_event(
            PUBSUB,
            "sdk",
            json.dumps({"id": marker}),
            data_content_type="application/json",
            publish_metadata={"scheduledSendDelay": "3s", "scheduleId": f"{prefix}a"},
        )
        published = now_ms()
        client.publish_event(
            PUBSUB, "sdk", "{}", publish_metadata={"scheduleCancel": "true", "scheduleIdPrefix": prefix}
        )
        assert now_ms() - published < 3_000, "the cancel came after the message was due"
    assert stack.wait_arrivals(carries(marker), 1, timeout=6) == [], "a message cancelled by prefix fired"


@pytest.mark.parametrize(
    ("metadata", "key", "value"),
    [
        ({"schedulePause": "maybe", "scheduleId": "x"}, "schedulePause", "maybe"),
        ({"scheduleCancel": "true", "scheduleIdPrefix": ""}, "scheduleIdPrefix", ""),
    ],
)
def test_bad_control_values_are_refused_through_curl(
    stack: Stack, metadata: dict[str, str], key: str, value: str
) -> None:
    code, text = curl_publish(stack, TOPIC, metadata)
    assert code >= 400, text
    # daprd passes the component's INVALID_ARGUMENT on: the key and the value, as the component names them.
    assert "InvalidArgument" in text
    assert f"invalid metadata {key}={value!r}" in text
