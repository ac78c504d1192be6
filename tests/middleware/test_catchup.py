"""The catch-up plan (catchup.py) as pure arithmetic over a schedule's occurrences, and the publish
keys that ask for it: only with a recurring schedule, bad values refused naming key and value."""

from __future__ import annotations

import pytest

from delayed_middleware.catchup import CATCHUP_PACE_MS, plan_advance, plan_wait
from delayed_middleware.envelope import Envelope
from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.instants import parse_instant
from delayed_middleware.kinds import Catchup
from delayed_middleware.plan import PlanContext, plan_publish
from delayed_middleware.schedules import EnvelopeRecurrence, Occurrences

NOW = parse_instant("2026-11-29T12:00:30Z")
MINUTE = 60_000
CTX = PlanContext(now_ms=NOW, pubsub_name="delayed", enabled=True)


def envelope(metadata: dict[str, str]) -> Envelope:
    [delayed] = plan_publish("orders", b"x", {"scheduleId": "tick", **metadata}, "", CTX).delayed
    return delayed.envelope


def minutes(expr: str = "0 * * * * *", **metadata: str) -> Occurrences:
    occ = EnvelopeRecurrence().occurrences(envelope({"schedule": expr, **metadata}), NOW)
    assert occ is not None
    return occ


def test_the_publish_keys_become_the_envelopes_policy_and_window() -> None:
    e = envelope({"schedule": "@every 1m", "scheduleCatchup": "ALL", "scheduleCatchupWindow": "90m"})
    assert (e.catchup, e.catchup_window_ms) == (Catchup.ALL, 90 * MINUTE)
    # Left out: `one` and the default window, and nothing on the wire (an older release's view).
    plain = envelope({"schedule": "@every 1m"})
    assert (plain.catchup, plain.catchup_window_ms) == (0, 0)


@pytest.mark.parametrize(
    ("key", "value"),
    [("scheduleCatchup", "all"), ("scheduleCatchupWindow", "1h")],
)
def test_a_one_shot_schedule_refuses_the_catchup_keys_naming_key_and_value(key: str, value: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        plan_publish("orders", b"x", {"schedule": "@at 2026-12-01T00:00:00Z", key: value}, "", CTX)
    assert (err.value.key, err.value.value) == (key, value)
    assert "recurring" in err.value.reason


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("scheduleCatchup", ""),
        ("scheduleCatchup", "both"),
        ("scheduleCatchupWindow", "-1h"),
        ("scheduleCatchupWindow", "24"),
        ("scheduleCatchupWindow", "1e400h"),
    ],
)
def test_bad_catchup_values_are_refused_naming_key_and_value(key: str, value: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        plan_publish("orders", b"x", {"schedule": "@every 1m", key: value}, "", CTX)
    assert (err.value.key, err.value.value) == (key, value)


def test_a_late_occurrence_is_not_missed_and_fires_under_every_policy() -> None:
    occ = minutes()
    due = NOW - 20_000  # 12:00:10, its successor 12:01:00 still ahead
    for policy in Catchup:
        plan = plan_wait(occ, policy, 0, (due, due), NOW)
        assert plan is not None
        assert plan.current is None
        assert plan.skip is None


def test_all_paces_missed_successors_and_never_slower_than_ten_a_second() -> None:
    occ = minutes()
    first = NOW - 30 * MINUTE - 30_000  # 11:30:00, thirty more missed after it
    plan = plan_wait(occ, Catchup.ALL, 0, (first, first), NOW)
    assert plan is not None
    assert plan.current is None
    assert plan.following == (first + MINUTE, NOW + CATCHUP_PACE_MS)
    current = plan.following
    for k in range(2, 31):
        nxt = plan_advance(occ, Catchup.ALL, 0, current, current[1]).following
        assert nxt == (first + k * MINUTE, current[1] + CATCHUP_PACE_MS)
        current = nxt
    # Caught up: the next one is on time, unpaced.
    assert plan_advance(occ, Catchup.ALL, 0, current, current[1]).following == (NOW + 30_000,) * 2
    assert 1000 // CATCHUP_PACE_MS >= 10


def test_jitter_moves_the_due_time_never_the_nominal_one() -> None:
    occ = minutes(scheduleJitter="30s")
    found = occ.nominal_after(NOW)
    assert found is not None
    nominal, due = found
    assert nominal == NOW + 30_000
    assert nominal <= due < nominal + 30_000
    assert occ.nominal_of(due) == nominal
