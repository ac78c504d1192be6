"""Retry with backoff and dead letters under a real daprd, driven by an HTTP app's 500s.

The `retry` subscription carries its own policy in its metadata (maxDeliveryAttempts=5,
retryInitialInterval=300ms, retryMultiplier=2, deadLetterTopic=retry-dead): daprd passes it
to the component in PullMessages, which is what a per-subscription override relies on.
"""

from __future__ import annotations

import itertools
import time

import pytest
import redis

from tests.e2e.conftest import DL_TOPIC, PUBSUB, PUBSUB_DL
from tests.e2e.harness import Stack, carries, unique
from tests.e2e.user import header

pytestmark = pytest.mark.e2e

# Each wait is the backoff plus daprd's hop and the app call: never shorter, at most this much longer.
SLACK_MS = 900


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


def test_an_app_subscribed_to_the_component_dead_letter_topic_gets_its_dead_letters_and_retries_them(
    stack: Stack,
) -> None:
    """Component metadata maxDeliveryAttempts=2, deadLetterTopic=dl-dead; the app subscribes to
    dl-orders and to dl-dead. A message failed twice on dl-orders reaches the app on dl-dead; failed
    there three times more (past maxDeliveryAttempts), it keeps coming back, and is stored on
    dl-dead once: never dead-lettered into the topic it came from, never dropped."""
    marker = unique("dlq")
    stack.arm_failure(marker, times=5)
    assert stack.publish(PUBSUB_DL, "dl-orders", {"id": marker}).status_code == 204

    got = stack.wait_arrivals(carries(marker), 6, timeout=40)
    failed = [a for a in got if a["route"] == f"/events/{PUBSUB_DL}/dl-orders"]
    dead = [a for a in got if a["route"] == f"/events/{PUBSUB_DL}/{DL_TOPIC}"]
    assert [a["status"] for a in failed] == [500, 500], got
    assert [a["status"] for a in dead] == [500, 500, 500, 200], got
    assert [header(a, "deliveryAttempt") for a in dead] == ["1", "2", "3", "4"]
    assert all(header(a, "deadLetterSourceTopic") == "dl-orders" for a in dead)
    db = redis.Redis(port=stack.redis_port, db=2)
    try:
        assert db.xlen(DL_TOPIC) == 1
        time.sleep(1.5)  # acked: it never comes back
        assert len([a for a in stack.arrivals() if carries(marker)(a)]) == 6
        assert db.xpending(DL_TOPIC, "e2e-app")["pending"] == 0
    finally:
        db.close()
