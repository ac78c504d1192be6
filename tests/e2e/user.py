"""What a user does and checks through a real daprd: publish and cancel with curl, read an
arrival's headers, and assert that a delivery (or every fire of a schedule) came on time."""

from __future__ import annotations

import json
import subprocess
import time
from datetime import datetime
from typing import Any
from urllib.parse import quote

from tests.e2e.conftest import PUBSUB
from tests.e2e.harness import LATENESS, LATENESS_TOLERANCE_MS, Stack, carries, now_ms

# The topic the e2e subscriber takes CloudEvents on (tests/e2e/conftest.py).
TOPIC = "later"

def assert_on_time(
    stack: Stack, name: str, marker: str, due_ms: int, payload: dict[str, Any]
) -> dict[str, Any]:
    """Waits for the one arrival carrying `marker`; checks payload, not-before-due, lateness."""
    early_deadline = (due_ms - now_ms()) / 1000
    if early_deadline > 0.2:
        # Still well before due: nothing may have arrived yet.
        assert stack.wait_arrivals(carries(marker), 1, timeout=early_deadline - 0.2) == [], "arrived early"
    got = stack.wait_arrivals(carries(marker), 1, timeout=max(0.0, (due_ms - now_ms()) / 1000) + 10)
    assert len(got) == 1, f"expected one arrival of {marker}, got {got}"
    arrival = got[0]
    lateness = arrival["received_ms"] - due_ms
    LATENESS.append((name, lateness))
    assert arrival["data"] == payload
    assert lateness >= 0, f"arrived {-lateness} ms before due"
    assert lateness <= LATENESS_TOLERANCE_MS, f"arrived {lateness} ms after due"
    return arrival


def curl_publish(
    stack: Stack, topic: str, metadata: dict[str, str], body: bytes | str = b"{}", raw_query: str = ""
) -> tuple[int, str]:
    """`curl -X POST http://…/v1.0/publish/delayed/<topic>?metadata.K=V`, exactly as a user types it.

    Values are percent-encoded (a space is %20, '@' may stay); `raw_query` is appended as written.
    """
    query = "&".join(f"metadata.{k}={quote(v, safe='@*/:')}" for k, v in metadata.items())
    if raw_query:
        query = f"{query}&{raw_query}" if query else raw_query
    url = f"{stack.dapr_url}/v1.0/publish/{PUBSUB}/{topic}" + (f"?{query}" if query else "")
    data = body if isinstance(body, str) else body.decode()
    result = subprocess.run(
        [
            "curl",
            "-sS",
            "-o",
            "-",
            "-w",
            "\n%{http_code}",
            "-X",
            "POST",
            url,
            "-H",
            "Content-Type: application/json",
            "-d",
            data,
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, f"curl failed: {result.stderr}"
    text, _, code = result.stdout.rpartition("\n")
    return int(code), text


def cancel(stack: Stack, topic: str, schedule_id: str) -> int:
    """`?metadata.scheduleId=<id>&metadata.scheduleCancel=true` through curl; returns when it was acknowledged."""
    code, text = curl_publish(stack, topic, {"scheduleId": schedule_id, "scheduleCancel": "true"})
    assert code == 204, text
    return now_ms()


def header(arrival: dict[str, Any], key: str) -> str | None:
    """The arrival's header `key` (case-insensitive), or None."""
    for k, v in arrival["headers"].items():
        if k.lower() == key.lower():
            return str(v)
    return None


def instant_ms(text: str | None) -> int:
    """An RFC 3339 header value (scheduleNext) in ms."""
    assert text is not None, "no scheduleNext header"
    return int(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000)


def ok_arrivals(stack: Stack, marker: str, count: int, timeout: float) -> list[dict[str, Any]]:
    """The first `count` arrivals of `marker` the app answered 200, in arrival order."""
    found = stack.wait_arrivals(lambda a: carries(marker)(a) and a["status"] == 200, count, timeout)
    return sorted(found, key=lambda a: a["received_ms"])


def assert_stops(stack: Stack, marker: str, cancelled_ms: int, quiet_s: float) -> None:
    """After a cancel returns, nothing more arrives (one fire already in flight may land just after)."""
    time.sleep(quiet_s)
    late = [
        a
        for a in stack.arrivals()
        if carries(marker)(a) and a["received_ms"] > cancelled_ms + LATENESS_TOLERANCE_MS
    ]
    assert late == [], f"{len(late)} message(s) arrived after the schedule was cancelled"


def assert_every_grid(
    fires: list[dict[str, Any]], interval_ms: int, accepted_after: int, accepted_before: int, name: str
) -> None:
    """Fires k = 1..n due at accept + k*interval: scheduleNext names them exactly; none early or drifting."""
    nexts = [instant_ms(header(a, "scheduleNext")) for a in fires]
    start = nexts[0] - 2 * interval_ms  # fire 1 names fire 2 = start + 2 intervals
    # The schedule's start is the moment the component accepted it: inside the publish call.
    assert accepted_after - 5 <= start <= accepted_before + 5, (start, accepted_after, accepted_before)
    for k, (fire, nxt) in enumerate(zip(fires, nexts, strict=True), start=1):
        due = start + k * interval_ms
        assert nxt == due + interval_ms, f"fire {k}: scheduleNext {nxt} is not {due + interval_ms} (drift)"
        lateness = fire["received_ms"] - due
        LATENESS.append((name, lateness))
        assert lateness >= 0, f"fire {k} arrived {-lateness} ms before it was due"
        assert lateness <= LATENESS_TOLERANCE_MS, f"fire {k} arrived {lateness} ms after it was due"


def pause_then_resume(stack: Stack, topic: str, schedule_id: str, marker: str, hold_s: float) -> None:
    """An `@every 1s` schedule published with curl fires, is paused for `hold_s` (no occurrence due
    after the pause fires), then resumed: its first fire after the resume is a grid point after it,
    not a fire it missed while paused. Cancelled at the end."""
    code, text = curl_publish(
        stack, topic, {"schedule": "@every 1s", "scheduleId": schedule_id}, json.dumps({"id": marker})
    )
    assert code == 204, text
    assert len(ok_arrivals(stack, marker, 1, timeout=5)) == 1
    code, text = curl_publish(stack, topic, {"schedulePause": "true", "scheduleId": schedule_id})
    paused = now_ms()
    assert code == 204, text
    time.sleep(hold_s)
    # By each fire's own due time (one interval before its scheduleNext), not by when daprd
    # delivered it: a fire that went out just before the pause may reach the app later.
    late = [
        a
        for a in stack.arrivals()
        if carries(marker)(a) and instant_ms(header(a, "scheduleNext")) - 1_000 > paused
    ]
    assert late == [], f"{len(late)} occurrence(s) due after the pause fired"
    before = len([a for a in stack.arrivals() if carries(marker)(a)])
    resumed = now_ms()
    code, text = curl_publish(stack, topic, {"schedulePause": "false", "scheduleId": schedule_id})
    assert code == 204, text
    fires = ok_arrivals(stack, marker, before + 1, timeout=5)
    assert len(fires) == before + 1
    assert instant_ms(header(fires[-1], "scheduleNext")) - 1_000 >= resumed - 5
    code, text = curl_publish(stack, topic, {"scheduleCancel": "true", "scheduleId": schedule_id})
    assert code == 204, text
