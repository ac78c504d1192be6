"""The pure retry policy: parsing, overrides, and the decision after each failed attempt."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from delayed_middleware.deadletters import dead_letter_topics_key
from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.keys import is_engine_key
from delayed_middleware.retry import (
    DeadLetter,
    Redeliver,
    RetryPolicy,
    parse_retry_policy,
    retry_key,
)

# A component's declared policy (its numbers come from metadata.yaml in the component; any will do here).
BASE = RetryPolicy(initial_ms=1_000, max_ms=60_000, multiplier=2.0, jitter=0.0)


def test_nothing_configured_is_inactive_and_unlimited() -> None:
    policy = parse_retry_policy({"redisHost": "x"}, BASE, component=True)
    assert policy == BASE
    assert not policy.active
    assert isinstance(policy.on_nack(10_000, "e"), Redeliver)


@pytest.mark.parametrize(
    ("attempt", "expected"),
    [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (5, 10.0), (500, 10.0)],
)
def test_delays_follow_the_backoff(attempt: int, expected: float) -> None:
    policy = parse_retry_policy(
        {"retryInitialInterval": "1s", "retryMaxInterval": "10s"}, BASE, component=True
    )
    decision = policy.on_nack(attempt, "e")
    assert decision == Redeliver(after_s=expected, next_attempt=attempt + 1)


def test_last_attempt_dead_letters_with_the_error() -> None:
    policy = parse_retry_policy({"maxDeliveryAttempts": "3", "deadLetterTopic": "dead"}, BASE, component=True)
    assert isinstance(policy.on_nack(2, "e"), Redeliver)
    assert policy.on_nack(3, "db down") == DeadLetter(reason="db down", attempts=3, topic="dead")
    # A reclaim after a crash may deliver past the limit: still a dead letter.
    assert policy.on_nack(7, "x") == DeadLetter(reason="x", attempts=7, topic="dead")


def test_huge_error_text_is_cut() -> None:
    decision = parse_retry_policy({"maxDeliveryAttempts": "1"}, BASE, component=True).on_nack(
        1, "x" * 100_000
    )
    assert isinstance(decision, DeadLetter)
    assert len(decision.reason) == 1025


def test_jitter_takes_a_fraction_off() -> None:
    policy = parse_retry_policy({"retryInitialInterval": "10s", "retryJitter": "0.5"}, BASE, component=True)
    assert policy.on_nack(1, "", rand=lambda: 1.0) == Redeliver(5.0, 2)
    assert policy.on_nack(1, "", rand=lambda: 0.0) == Redeliver(10.0, 2)


def test_subscription_overrides_only_what_it_names() -> None:
    component = parse_retry_policy(
        {"maxDeliveryAttempts": "5", "retryInitialInterval": "2s"}, BASE, component=True
    )
    sub = component.overridden({"maxDeliveryAttempts": "2", "rawPayload": "true"})
    assert sub.max_attempts == 2
    assert sub.initial_ms == 2000
    assert component.overridden({}) is component


def test_component_dead_letter_topic_alone_is_not_a_policy() -> None:
    # The component-level deadLetterTopic is also the forwarder's: alone it keeps
    # retries off, but a policy turned on by another key uses it.
    alone = parse_retry_policy({"deadLetterTopic": "dead"}, BASE, component=True)
    assert not alone.active
    assert alone.dead_letter_topic == "dead"
    with_attempts = parse_retry_policy(
        {"deadLetterTopic": "dead", "maxDeliveryAttempts": "2"}, BASE, component=True
    )
    assert with_attempts.active
    assert with_attempts.on_nack(2, "boom") == DeadLetter(reason="boom", attempts=2, topic="dead")
    assert alone.overridden({"retryJitter": "0.1"}).dead_letter_topic == "dead"


def test_subscription_alone_can_turn_the_policy_on() -> None:
    sub = BASE.overridden({"deadLetterTopic": "dead"})
    assert sub.active
    assert sub.max_attempts is None


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("maxDeliveryAttempts", "0"),
        ("maxDeliveryAttempts", "-1"),
        ("maxDeliveryAttempts", "9223372036854775808"),
        ("maxDeliveryAttempts", "9" * 16384),
        ("retryInitialInterval", "9" * 16384),
        ("retryMaxInterval", "9" * 5000 + "ms"),
        ("maxDeliveryAttempts", "٣"),
        ("retryInitialInterval", "1d"),
        ("retryInitialInterval", "-1s"),
        ("retryMaxInterval", "100000h"),
        ("retryMultiplier", "0.9"),
        ("retryMultiplier", "nan"),
        ("retryMultiplier", "inf"),
        ("retryJitter", "1.01"),
        ("retryJitter", "x"),
        ("deadLetterTopic", "app-delayed"),
        ("deadLetterTopic", "{app-delayed}:ids"),
    ],
)
def test_bad_values_name_the_key_and_value(key: str, value: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        parse_retry_policy({key: value}, BASE, component=True)
    assert err.value.key == key
    assert err.value.value == value


def test_max_below_initial_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="retryMaxInterval"):
        parse_retry_policy({"retryInitialInterval": "5s", "retryMaxInterval": "1s"}, BASE, component=True)


def test_keys_live_in_the_reserved_namespace() -> None:
    # A user topic can never collide with them: publishing there is refused.
    assert is_engine_key(retry_key("app", "orders"))
    assert is_engine_key(dead_letter_topics_key("app"))


@given(
    attempt=st.integers(min_value=1, max_value=10**6),
    initial=st.integers(min_value=0, max_value=10**6),
    extra=st.integers(min_value=0, max_value=10**7),
    mult=st.floats(min_value=1, max_value=1000),
    jitter=st.floats(min_value=0, max_value=1),
)
def test_delay_is_never_negative_nor_above_the_cap(
    attempt: int, initial: int, extra: int, mult: float, jitter: float
) -> None:
    policy = RetryPolicy(
        initial_ms=initial, max_ms=initial + extra, multiplier=mult, jitter=jitter, active=True
    )
    decision = policy.on_nack(attempt, "")
    assert isinstance(decision, Redeliver)
    assert 0 <= decision.after_s <= (initial + extra) / 1000


def test_a_huge_attempt_count_is_decided_at_once() -> None:
    # A message failing forever under an unlimited policy: 2^31 deliveries later
    # the decision still takes microseconds, and is the cap.
    for mult in ("1", "1.5"):
        policy = parse_retry_policy(
            {"retryMultiplier": mult, "retryMaxInterval": "30s"}, BASE, component=True
        )
        t = time.perf_counter()
        assert policy.on_nack(2**31, "e") == Redeliver(1.0 if mult == "1" else 30.0, 2**31 + 1)
        assert time.perf_counter() - t < 0.05
