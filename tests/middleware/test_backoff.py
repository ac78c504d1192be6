from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.backoff import ExponentialWithJitterBackoff

from delayed_middleware.backoff import REDIS_DIAL, REDIS_RECONNECT, Backoff, BackoffProfile, compute_backoff


@pytest.mark.parametrize(
    ("attempt", "expected"),
    [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (5, 10.0), (6, 10.0), (10_000, 10.0)],
)
def test_exponential_then_capped(attempt: int, expected: float) -> None:
    assert compute_backoff(attempt, base_s=1.0, cap_s=10.0) == expected


def test_multiplier_one_is_constant() -> None:
    assert [compute_backoff(a, base_s=0.5, cap_s=9, multiplier=1) for a in (1, 2, 50)] == [0.5, 0.5, 0.5]


def test_jitter_spreads_below_the_delay() -> None:
    assert compute_backoff(3, base_s=1, cap_s=10, jitter=0.5, rand=lambda: 0.0) == 4.0
    assert compute_backoff(3, base_s=1, cap_s=10, jitter=0.5, rand=lambda: 1.0) == 2.0


@pytest.mark.parametrize("bad", [{"attempt": 0}, {"jitter": 1.5}, {"jitter": -0.1}, {"multiplier": 0.5}])
def test_bad_arguments(bad: dict[str, float]) -> None:
    args: dict[str, float] = {"attempt": 1, "jitter": 0.0, "multiplier": 2.0, **bad}
    with pytest.raises(ValueError, match=next(iter(bad))):
        compute_backoff(
            int(args["attempt"]), base_s=1, cap_s=2, multiplier=args["multiplier"], jitter=args["jitter"]
        )


@given(
    attempt=st.integers(1, 100_000),
    base=st.floats(0, 100),
    cap=st.floats(0, 1000),
    mult=st.floats(1, 10),
    jitter=st.floats(0, 1),
    r=st.floats(0, 1),
)
def test_never_negative_never_above_cap(
    attempt: int, base: float, cap: float, mult: float, jitter: float, r: float
) -> None:
    d = compute_backoff(attempt, base_s=base, cap_s=cap, multiplier=mult, jitter=jitter, rand=lambda: r)
    assert 0 <= d <= cap


def test_stateful_backoff_resets() -> None:
    b = Backoff(base_s=1, cap_s=4)
    assert [b.next(), b.next(), b.next(), b.next()] == [1, 2, 4, 4]
    b.reset()
    assert b.next() == 1


def test_each_loop_gets_its_own_backoff_from_a_profile() -> None:
    """A named profile is shared by many loops: one loop's failures must not lengthen another's waits."""
    first, second = REDIS_RECONNECT.backoff(), REDIS_RECONNECT.backoff()
    assert [first.next(), first.next(), first.next()] == [0.05, 0.1, 0.2]
    assert second.next() == 0.05
    assert [REDIS_RECONNECT.delay(a) for a in (1, 2, 3, 100)] == [0.05, 0.1, 0.2, 2.0]


def test_a_profile_cannot_be_changed_in_place() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        REDIS_RECONNECT.cap_s = 60.0  # type: ignore[misc]


@pytest.mark.parametrize("bad", [{"multiplier": 0.5}, {"jitter": 1.5}, {"base_s": -1.0}, {"cap_s": -1.0}])
def test_a_bad_profile_is_refused_when_made(bad: dict[str, float]) -> None:
    """At import for the named ones, not at some loop's first failure in production."""
    args: dict[str, float] = {"base_s": 0.1, "cap_s": 1.0, **bad}
    with pytest.raises(ValueError, match="jitter" if "jitter" in bad else "multiplier|base|cap"):
        BackoffProfile(**args)


def test_redis_py_backoff_is_the_dial_retry_connection_had() -> None:
    """connection.py hands REDIS_DIAL to redis-py's Retry: the same backoff it built by hand
    (ExponentialWithJitterBackoff compares by base and cap), whose waits stay within [0, cap]."""
    backoff = REDIS_DIAL.redis_py()
    assert backoff == ExponentialWithJitterBackoff(base=0.05, cap=1.0)
    assert all(0 <= backoff.compute(failures) <= REDIS_DIAL.cap_s for failures in range(1, 60))
