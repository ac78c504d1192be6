"""scheduleTrigger and scheduleReschedule read by planning (pure): the request they become, the time a
reschedule names (an instant, or a duration from the publish's time; a past one is now), and the
bounds a delay keeps (the component's maximum delay, year 9999)."""

from __future__ import annotations

import pytest

from delayed_middleware.control import Reschedule, Trigger
from delayed_middleware.entry import StreamEntry
from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.instants import parse_instant
from delayed_middleware.plan import PlanContext, plan_bulk, plan_publish

NOW = parse_instant("2026-11-29T09:00:00Z")
CTX = PlanContext(now_ms=NOW, pubsub_name="delayed", enabled=True, max_delay_ms=48 * 3_600_000)


def control(metadata: dict[str, str]) -> object:
    return plan_publish("orders", b"ignored", metadata, "", CTX).control


@pytest.mark.parametrize(
    ("value", "due"),
    [
        ("2026-11-29T10:00:00.250Z", NOW + 3_600_250),
        ("2026-11-29T11:00:00+02:00", NOW),  # an hour ago: at once
        ("90m", NOW + 5_400_000),
        ("0s", NOW),
    ],
)
def test_a_reschedule_names_its_new_due_time(value: str, due: int) -> None:
    assert control({"scheduleReschedule": value, "scheduleId": "m"}) == Reschedule("m", due, value)


def test_a_trigger_stores_nothing_and_names_its_id() -> None:
    plan = plan_publish("orders", b"ignored", {"scheduleTrigger": "True", "scheduleId": "m"}, "", CTX)
    assert plan.control == Trigger("m")
    assert (plan.immediate, plan.delayed, plan.cancels) == ((), (), ())


@pytest.mark.parametrize(
    ("value", "why"),
    [("49h", "more than the maximum delay of 48h0m0s"), ("2045-01-01T00:00:00Z", "maximum delay")],
)
def test_a_reschedule_beyond_the_maximum_delay_is_refused(value: str, why: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        control({"scheduleReschedule": value, "scheduleId": "m"})
    assert (err.value.key, err.value.value) == ("scheduleReschedule", value)
    assert why in err.value.reason


def test_control_keys_in_a_bulk_entry_fail_that_entry_alone() -> None:
    plan = plan_bulk(
        "orders",
        [
            ("a", StreamEntry(b"x", {"scheduleTrigger": "true", "scheduleId": "m"}, "", 0)),
            ("b", StreamEntry(b"y", {}, "", 0)),
        ],
        {},
        CTX,
    )
    assert [f.entry_id for f in plan.failed] == ["a"]
    assert "scheduleTrigger" in plan.failed[0].error
    assert [i.entry_id for i in plan.immediate] == ["b"]
