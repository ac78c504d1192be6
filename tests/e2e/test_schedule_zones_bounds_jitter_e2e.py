"""Schedules under a real daprd: a time zone, start/end/limit bounds and jitter, published the two ways a
user does (curl with ``?metadata.`` and the Dapr Python SDK's ``publish_metadata``), checked the way a
user checks them: how many fires arrive, when, and what ``scheduleNext`` each one names."""

from __future__ import annotations

import json
import time

import pytest

from delayed_middleware.instants import format_instant
from tests.e2e.conftest import PUBSUB
from tests.e2e.harness import LATENESS_TOLERANCE_MS, Stack, carries, dapr_client, now_ms, rfc3339, unique
from tests.e2e.user import TOPIC, curl_publish, header, instant_ms, ok_arrivals
from tests.wallclock import steady_zones

pytestmark = pytest.mark.e2e


def test_http_zone_start_limit_and_jitter_through_query_metadata(stack: Stack) -> None:
    marker, schedule_id = unique("zonehttp"), unique("sched")
    start = (now_ms() // 1000 + 3) * 1000
    code, text = curl_publish(
        stack,
        TOPIC,
        {
            "schedule": "* * * * * *",
            "scheduleTimeZone": "Asia/Kathmandu",
            "scheduleStart": rfc3339(start, 5),
            "scheduleLimit": "2",
            "scheduleJitter": "400ms",
            "scheduleId": schedule_id,
        },
        json.dumps({"id": marker}),
    )
    assert code == 204, text
    fires = ok_arrivals(stack, marker, 2, timeout=10)
    assert len(fires) == 2, f"expected 2 fires, got {len(fires)}"
    # Nothing before the start; each within its second's jitter window (plus delivery).
    for k, fire in enumerate(fires):
        assert fire["received_ms"] >= start + k * 1000, "fired before its occurrence"
        assert fire["received_ms"] - (start + k * 1000) <= 400 + LATENESS_TOLERANCE_MS
        assert header(fire, "scheduler") == schedule_id
        # Which occurrence it is: its nominal time, before the jitter (a header, as every metadata key).
        assert header(fire, "scheduleOccurrence") == format_instant(start + k * 1000), fire["headers"]
    # The first names the second's jittered due time; the second (the limit) names none.
    nxt = instant_ms(header(fires[0], "scheduleNext"))
    assert start + 1000 <= nxt < start + 1400
    assert header(fires[1], "scheduleNext") == "purge"
    time.sleep(2.5)
    assert len(ok_arrivals(stack, marker, 3, timeout=0)) == 2, "fired past its limit"


def test_http_end_before_start_is_refused_naming_the_key(stack: Stack) -> None:
    marker = unique("zonebad")
    code, text = curl_publish(
        stack,
        TOPIC,
        {
            "schedule": "@daily",
            "scheduleStart": "2031-01-02T00:00:00Z",
            "scheduleEnd": "2031-01-01T00:00:00Z",
        },
        json.dumps({"id": marker}),
    )
    assert code >= 400, text
    assert "scheduleEnd" in text
    code, text = curl_publish(
        stack, TOPIC, {"schedule": "@daily", "scheduleTimeZone": "Nowhere/City"}, json.dumps({"id": marker})
    )
    assert code >= 400, text
    assert "scheduleTimeZone" in text
    assert "Nowhere/City" in text
    assert stack.wait_arrivals(carries(marker), 1, timeout=2) == []


def test_sdk_cron_tz_prefix_with_an_end_through_publish_metadata(
    stack: Stack, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker, schedule_id = unique("zonesdk"), unique("sched")
    # Europe/London, unless its clocks change within hours: the hour a fall-back repeats has no
    # fire left before the end (the publish would be refused); Asia/Kathmandu has no daylight saving.
    zone = steady_zones(("Europe/London", "Asia/Kathmandu"))[0]
    with dapr_client(stack, monkeypatch) as client:
        # Publish early in an even second, so acceptance and the first fire are not in a race.
        while not 50 <= now_ms() % 2000 <= 400:
            time.sleep(0.01)
        t0 = now_ms()
        end = (t0 // 1000 + 5) * 1000  # even-second fires up to here: two or three of them
        client.publish_event(
            PUBSUB,
            "sdk",
            json.dumps({"id": marker}),
            data_content_type="application/json",
            publish_metadata={
                "schedule": f"CRON_TZ={zone} */2 * * * * *",
                "scheduleTimeZone": zone,
                "scheduleEnd": rfc3339(end, 0),
                "scheduleId": schedule_id,
            },
        )
    expected = list(range((t0 // 2000 + 1) * 2000, end + 1, 2000))
    fires = ok_arrivals(stack, marker, len(expected), timeout=10)
    assert len(fires) == len(expected)
    for fire, due in zip(fires, expected, strict=True):
        assert 0 <= fire["received_ms"] - due <= LATENESS_TOLERANCE_MS
    assert header(fires[-1], "scheduleNext") == "purge"
    time.sleep(3)
    assert len(ok_arrivals(stack, marker, len(expected) + 1, timeout=0)) == len(expected), (
        "fired after its end"
    )
