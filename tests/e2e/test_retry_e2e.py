"""Retry with backoff and dead letters under a real daprd, driven by an HTTP app's 500s.

The `retry` subscription carries its own policy in its metadata (maxDeliveryAttempts=5,
retryInitialInterval=300ms, retryMultiplier=2, deadLetterTopic=retry-dead): daprd passes it
to the component in PullMessages, which is what a per-subscription override relies on.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest

from tests.e2e.conftest import PUBSUB
from tests.e2e.harness import Stack, carries, unique

pytestmark = pytest.mark.e2e

# Each wait is the backoff plus daprd's hop and the app call: never shorter, at most this much longer.
SLACK_MS = 900


def header(arrival: dict[str, Any], key: str) -> str | None:
    return next((str(v) for k, v in arrival["headers"].items() if k.lower() == key.lower()), None)


def test_three_500s_then_success_sees_attempts_1_to_4_with_backoff(stack: Stack) -> None:
    marker = unique("retry")
    stack.arm_failure(marker, times=3)
    assert stack.publish(PUBSUB, "retry", {"id": marker}).status_code == 204

    got = stack.wait_arrivals(carries(marker), 4, timeout=30)
    assert [a["status"] for a in got] == [500, 500, 500, 200], got
    assert [header(a, "deliveryAttempt") for a in got] == ["1", "2", "3", "4"]
    gaps = [b["received_ms"] - a["received_ms"] for a, b in itertools.pairwise(got)]
    for gap, backoff in zip(gaps, (300, 600, 1200), strict=True):
        assert backoff <= gap <= backoff + SLACK_MS, gaps
    time.sleep(2)  # acked: it never comes back, and nothing was dead-lettered
    assert len([a for a in stack.arrivals() if carries(marker)(a)]) == 4


def test_five_failures_go_to_the_dead_letter_topic_with_the_reason(stack: Stack) -> None:
    marker = unique("dead")
    stack.arm_failure(marker, times=5)
    assert stack.publish(PUBSUB, "retry", {"id": marker}).status_code == 204

    arrivals = stack.wait_arrivals(carries(marker), 6, timeout=40)
    failed = [a for a in arrivals if a["route"] == f"/events/{PUBSUB}/retry"]
    dead = [a for a in arrivals if a["route"] == f"/events/{PUBSUB}/retry-dead"]
    assert [a["status"] for a in failed] == [500] * 5
    assert len(dead) == 1, arrivals
    assert dead[0]["data"] == {"id": marker}
    assert header(dead[0], "deadLetterSourceTopic") == "retry"
    assert header(dead[0], "deadLetterAttempts") == "5"
    assert header(dead[0], "deadLetterConsumer")
    assert "500" in (header(dead[0], "deadLetterReason") or ""), dead[0]["headers"]
