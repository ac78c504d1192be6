"""Recurring schedules, cancel, sampling and per-message TTL under a real daprd, driven with curl.

Written against the public contract (README's metadata table), the way a user checks it:
publish with ``curl -X POST .../publish/delayed/<topic>?metadata.schedule=@every%202s``, watch
the subscriber app. A recurring schedule's fires must come on its grid (never early, never
drifting: the ``scheduleNext`` header of each fire names the next due instant exactly), carry
the body unchanged with ``scheduler`` = the schedule's id, and stop once cancelled. Expired
messages (``ttlInSeconds`` / ``ttl``) never reach the app, CloudEvent or raw, fresh or
redelivered.
"""

from __future__ import annotations

import base64
import itertools
import json
import time

import pytest

from tests.e2e.harness import LATENESS, LATENESS_TOLERANCE_MS, Stack, carries, now_ms, rfc3339, unique
from tests.e2e.user import (
    TOPIC,
    assert_every_grid,
    assert_stops,
    cancel,
    curl_publish,
    header,
    instant_ms,
    ok_arrivals,
)

pytestmark = pytest.mark.e2e

RAW_TOPIC = "raw"  # subscribed with rawPayload=true


def test_every_2s_fires_on_its_grid_then_cancel_through_curl(stack: Stack) -> None:
    marker, schedule_id = unique("every"), unique("sched")
    payload = {"id": marker, "kind": "reminder"}
    t0 = now_ms()
    code, text = curl_publish(
        stack,
        TOPIC,
        {"schedule": "@every 2s", "scheduleId": schedule_id, "customer": "acme-42"},
        json.dumps(payload),
    )
    t1 = now_ms()
    assert code == 204, text
    # Nothing at once: the first fire is one interval after acceptance.
    assert ok_arrivals(stack, marker, 1, timeout=1.5) == [], "a recurring schedule fired at once"
    fires = ok_arrivals(stack, marker, 4, timeout=12)
    assert len(fires) >= 4, f"expected 4 fires of @every 2s in 12 s, got {len(fires)}"
    fires = fires[:4]
    for fire in fires:
        assert fire["data"] == payload  # the body, unchanged, at every fire
        assert header(fire, "scheduler") == schedule_id
        assert header(fire, "customer") == "acme-42"  # user metadata verbatim
    assert_every_grid(fires, 2000, t0, t1, "http schedule=@every 2s")

    cancelled = cancel(stack, TOPIC, schedule_id)
    assert_stops(stack, marker, cancelled, quiet_s=5)


def test_cron_every_3_seconds_fires_on_whole_seconds(stack: Stack) -> None:
    marker, schedule_id = unique("cron"), unique("sched")
    payload = {"id": marker}
    code, text = curl_publish(
        stack, TOPIC, {"schedule": "*/3 * * * * *", "scheduleId": schedule_id}, json.dumps(payload)
    )
    assert code == 204, text
    fires = ok_arrivals(stack, marker, 3, timeout=12)
    cancelled = cancel(stack, TOPIC, schedule_id)
    assert len(fires) >= 3, f"expected 3 fires of */3 in 12 s, got {len(fires)}"
    for fire in fires[:3]:
        nxt = instant_ms(header(fire, "scheduleNext"))
        due = nxt - 3000
        assert due % 3000 == 0, f"due {due} is not on a multiple of 3 s"
        lateness = fire["received_ms"] - due
        LATENESS.append(("http schedule=*/3 * * * * *", lateness))
        assert 0 <= lateness <= LATENESS_TOLERANCE_MS, lateness
        assert fire["data"] == payload
        assert header(fire, "scheduler") == schedule_id
    dues = [instant_ms(header(f, "scheduleNext")) - 3000 for f in fires[:3]]
    assert [b - a for a, b in itertools.pairwise(dues)] == [3000, 3000]
    assert_stops(stack, marker, cancelled, quiet_s=4)


def test_schedule_at_is_a_one_shot(stack: Stack) -> None:
    marker = unique("at")
    due = (now_ms() // 1000 + 3) * 1000
    code, text = curl_publish(stack, TOPIC, {"schedule": f"@at {rfc3339(due)}"}, json.dumps({"id": marker}))
    assert code == 204, text
    [fire] = ok_arrivals(stack, marker, 1, timeout=10)
    lateness = fire["received_ms"] - due
    LATENESS.append(("http schedule=@at", lateness))
    assert 0 <= lateness <= LATENESS_TOLERANCE_MS
    assert header(fire, "scheduleNext") == "purge"
    time.sleep(3)
    assert len(ok_arrivals(stack, marker, 2, timeout=0)) == 1, "a one-shot fired twice"


def test_schedule_without_id_is_cancelled_by_its_scheduler_header(stack: Stack) -> None:
    """No scheduleId: fires carry the envelope id as `scheduler`, and that id cancels it."""
    marker = unique("anon")
    code, text = curl_publish(stack, TOPIC, {"schedule": "@every 2s"}, json.dumps({"id": marker}))
    assert code == 204, text
    [first] = ok_arrivals(stack, marker, 1, timeout=6)[:1]
    scheduler = header(first, "scheduler")
    assert scheduler, "a fire without a scheduler header"
    cancelled = cancel(stack, TOPIC, scheduler)
    assert_stops(stack, marker, cancelled, quiet_s=5)


def test_publishing_again_with_the_same_id_replaces_the_schedule(stack: Stack) -> None:
    schedule_id = unique("sched")
    old, new = unique("old"), unique("new")
    code, _ = curl_publish(
        stack, TOPIC, {"schedule": "@every 2s", "scheduleId": schedule_id}, json.dumps({"id": old})
    )
    assert code == 204
    assert ok_arrivals(stack, old, 1, timeout=6), "the first schedule never fired"
    code, _ = curl_publish(
        stack, TOPIC, {"schedule": "@every 2s", "scheduleId": schedule_id}, json.dumps({"id": new})
    )
    replaced = now_ms()
    assert code == 204
    fires = ok_arrivals(stack, new, 2, timeout=8)
    assert len(fires) >= 2, "the replacement does not fire"
    cancelled = cancel(stack, TOPIC, schedule_id)
    stale = [
        a for a in stack.arrivals() if carries(old)(a) and a["received_ms"] > replaced + LATENESS_TOLERANCE_MS
    ]
    assert stale == [], "the replaced schedule still fires"
    assert_stops(stack, new, cancelled, quiet_s=4)


def test_cancel_of_a_pending_one_shot(stack: Stack) -> None:
    marker, schedule_id = unique("pending"), unique("sched")
    code, _ = curl_publish(
        stack, TOPIC, {"scheduledSendDelay": "3s", "scheduleId": schedule_id}, json.dumps({"id": marker})
    )
    assert code == 204
    cancel(stack, TOPIC, schedule_id)
    assert stack.wait_arrivals(carries(marker), 1, timeout=6) == [], "a cancelled message was delivered"


def test_cancel_of_an_unknown_id_is_not_an_error(stack: Stack) -> None:
    code, text = curl_publish(stack, TOPIC, {"scheduleId": unique("nobody"), "scheduleCancel": "true"})
    assert code == 204, text


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("@every 500ms", "minimum"),
        ("* * * * *", "6 fields"),
        ("0 0 0 30 2 *", "never fires"),
        ("@sometimes", "@sometimes"),
    ],
)
def test_bad_schedule_is_refused_and_nothing_is_stored(stack: Stack, value: str, reason: str) -> None:
    marker = unique("badsched")
    code, text = curl_publish(stack, TOPIC, {"schedule": value}, json.dumps({"id": marker}))
    assert code >= 400, text
    assert "schedule" in text
    assert reason in text
    assert stack.wait_arrivals(carries(marker), 1, timeout=3) == []


def test_schedule_source_delivers_the_latest_message_of_a_topic(stack: Stack) -> None:
    """Sampling: each fire delivers the newest message of `scheduleSource`, not the schedule's body."""
    sensor = unique("sensor")  # a topic nobody subscribes to: only sampled
    reading = unique("reading")
    body_marker, schedule_id = unique("body"), unique("sched")
    for value in (1, 2):
        code, _ = curl_publish(stack, sensor, {}, json.dumps({"id": reading, "v": value}))
        assert code == 204
    code, text = curl_publish(
        stack,
        TOPIC,
        {"schedule": "@every 2s", "scheduleId": schedule_id, "scheduleSource": sensor},
        json.dumps({"id": body_marker}),
    )
    assert code == 204, text
    fires = ok_arrivals(stack, reading, 1, timeout=6)
    assert fires, "the sampled reading never arrived"
    assert fires[0]["data"] == {"id": reading, "v": 2}  # the latest, not the first
    code, _ = curl_publish(stack, sensor, {}, json.dumps({"id": reading, "v": 3}))
    assert code == 204
    published = now_ms()
    later = [
        f
        for f in ok_arrivals(stack, reading, len(fires) + 2, timeout=6)
        if f["received_ms"] > published + 2500
    ]
    cancelled = cancel(stack, TOPIC, schedule_id)
    assert later, "no fire after the new reading"
    assert all(f["data"] == {"id": reading, "v": 3} for f in later)
    assert stack.wait_arrivals(carries(body_marker), 1, timeout=0) == [], (
        "the schedule's own body was delivered"
    )
    assert_stops(stack, reading, cancelled, quiet_s=3)


def test_schedule_source_on_an_empty_topic_delivers_nothing(stack: Stack) -> None:
    marker, schedule_id = unique("empty-src"), unique("sched")
    code, text = curl_publish(
        stack,
        TOPIC,
        {"schedule": "@every 1s", "scheduleId": schedule_id, "scheduleSource": unique("nothing-here")},
        json.dumps({"id": marker}),
    )
    assert code == 204, text
    assert stack.wait_arrivals(carries(marker), 1, timeout=4) == []
    cancel(stack, TOPIC, schedule_id)


def test_schedule_ttl_expires_produced_messages_before_redelivery(stack: Stack) -> None:
    """scheduleTTL=500ms: a fire the app fails is never redelivered (redeliverInterval is 1 s)."""
    marker, schedule_id = unique("sttl"), unique("sched")
    stack.arm_failure(marker, 100)
    code, text = curl_publish(
        stack,
        TOPIC,
        {"schedule": "@every 2s", "scheduleId": schedule_id, "scheduleTTL": "500ms"},
        json.dumps({"id": marker}),
    )
    assert code == 204, text
    got = stack.wait_arrivals(carries(marker), 3, timeout=8)
    cancel(stack, TOPIC, schedule_id)
    assert len(got) >= 3, "the schedule did not fire"
    assert all(header(a, "deliveryAttempt") == "1" for a in got), "an expired fire was redelivered"


# ---------------------------------------------------------------------------------------------------------
# Per-message TTL enforced by the component (it advertises MESSAGE_TTL, so daprd leaves TTL to it).


def assert_redelivered_only_while_alive(
    stack: Stack, topic: str, metadata: dict[str, str], body: str
) -> None:
    """The app fails every delivery: the component redelivers (redeliverInterval 1 s) until the 3 s TTL
    ends, and never after. At least two attempts prove redelivery was exercised while it was alive."""
    marker = unique("ttl-redeliver")
    data = body.replace("MARKER", marker)
    # The app sees a raw payload base64-encoded inside daprd's CloudEvent: match what it sees.
    match = base64.b64encode(data.encode()).decode() if metadata.get("rawPayload") == "true" else marker
    stack.arm_failure(match, 20)
    code, text = curl_publish(stack, topic, {**metadata, "ttlInSeconds": "3"}, data)
    published = now_ms()
    assert code == 204, text
    time.sleep(8)
    got = stack.wait_arrivals(carries(marker), 1, timeout=0)
    attempts = [(a["received_ms"] - published, a["status"]) for a in got]
    assert len(got) >= 2, f"expected redeliveries while the message was alive, got {attempts}"
    assert all(status == 500 for _, status in attempts), attempts
    assert [t for t, _ in attempts if t > 3000 + 500] == [], f"delivered past its 3 s TTL: {attempts}"


def test_plain_message_expired_before_redelivery_is_never_delivered_again(stack: Stack) -> None:
    assert_redelivered_only_while_alive(stack, TOPIC, {}, json.dumps({"id": "MARKER"}))


def test_raw_payload_expired_before_redelivery_is_never_delivered_again(stack: Stack) -> None:
    """Raw payloads carry no CloudEvent `expiration`: only the component can enforce their TTL."""
    assert_redelivered_only_while_alive(stack, RAW_TOPIC, {"rawPayload": "true"}, "raw MARKER")


@pytest.mark.parametrize(
    ("topic", "metadata", "body"),
    [
        (TOPIC, {"scheduledSendDelay": "3s", "ttl": "1s"}, None),
        (RAW_TOPIC, {"scheduledSendDelay": "3s", "ttlInSeconds": "1", "rawPayload": "true"}, "raw"),
    ],
    ids=["ttl-go-duration", "raw-payload"],
)
def test_delayed_message_whose_ttl_ends_before_it_is_due_never_fires(
    stack: Stack, topic: str, metadata: dict[str, str], body: str | None
) -> None:
    marker = unique("ttl-index")
    data = f"{body} {marker}" if body else json.dumps({"id": marker})
    code, text = curl_publish(stack, topic, metadata, data)
    assert code == 204, text
    assert stack.wait_arrivals(carries(marker), 1, timeout=6) == [], "an expired delayed message fired"


@pytest.mark.parametrize("metadata", [{"ttl": "30s"}, {"ttlInSeconds": "never"}, {"ttl": "never"}])
def test_message_within_its_ttl_is_delivered(stack: Stack, metadata: dict[str, str]) -> None:
    marker = unique("ttl-ok")
    code, text = curl_publish(stack, TOPIC, metadata, json.dumps({"id": marker}))
    assert code == 204, text
    assert len(stack.wait_arrivals(carries(marker), 1, timeout=10)) == 1


@pytest.mark.parametrize(
    ("metadata", "key"),
    [
        ({"ttlInSeconds": "soon"}, "ttlInSeconds"),
        ({"ttlInSeconds": "-1"}, "ttlInSeconds"),
        ({"ttlInSeconds": "9223372036854775807"}, "ttlInSeconds"),
        ({"ttl": "1d"}, "ttl"),
        ({"ttl": "5s", "ttlInSeconds": "5"}, "ttl"),
        ({"scheduledSendDelay": "1s", "scheduleTTL": "soon"}, "scheduleTTL"),
    ],
)
def test_bad_ttl_is_refused_and_nothing_is_stored(stack: Stack, metadata: dict[str, str], key: str) -> None:
    marker = unique("badttl")
    code, text = curl_publish(stack, TOPIC, metadata, json.dumps({"id": marker}))
    assert code >= 400, text
    assert key in text
    # daprd relays the component's status: INVALID_ARGUMENT, never INTERNAL or UNKNOWN.
    assert "code = InvalidArgument" in text
    assert stack.wait_arrivals(carries(marker), 1, timeout=3) == []
