"""Reading a publish by the table of keys: a key added as one row (with its parser) is read, checked
and refused by that row alone, with no change to the reader (request.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.instants import parse_instant
from delayed_middleware.publish_keys import SCHEDULE, TABLE, TIME_KEYS, Group, PublishKey
from delayed_middleware.request import PlanContext, read_publish

NOW = parse_instant("2026-11-26T05:00:00Z")
CTX = PlanContext(now_ms=NOW, pubsub_name="delayed", enabled=True)


def overlap(key: str, value: str) -> str:
    """scheduleOverlap's parser, as a new key would bring its own: one|all|none."""
    if value not in ("one", "all", "none"):
        raise InvalidArgumentError(key, value, "must be one, all or none")
    return value


# The table with one more row, as adding scheduleOverlap would write it.
WITH_OVERLAP = (
    *TABLE,
    PublishKey(
        "scheduleOverlap",
        Group.PER_SCHEDULE,
        parser=overlap,
        needs=SCHEDULE,
        excludes=TIME_KEYS,
        value="`one`, `all` or `none`",
        meaning="which missed fires fire on recovery",
    ),
)


def test_a_key_added_as_one_row_is_read_by_its_parser_into_the_request() -> None:
    request = read_publish({"schedule": "@every 1m", "scheduleOverlap": "all"}, CTX, WITH_OVERLAP)
    assert dict(request.options) == {"scheduleOverlap": "all"}
    assert request.timing is not None
    assert request.timing.schedule is not None
    assert request.timing.schedule.interval_ms == 60_000
    # Without the row, the same key is the app's own: read as nothing.
    assert read_publish({"schedule": "@every 1m", "scheduleOverlap": "all"}, CTX).options == ()


@pytest.mark.parametrize(
    ("metadata", "key", "value", "why"),
    [
        (
            {"schedule": "@every 1m", "scheduleOverlap": "some"},
            "scheduleOverlap",
            "some",
            "must be one, all or none",
        ),
        ({"scheduleOverlap": "all"}, "scheduleOverlap", "all", "only applies with schedule"),
        (
            {"scheduleOverlap": "all", "scheduledSendDelay": "5s", "schedule": "@every 1m"},
            "scheduledSendDelay",
            "5s",
            "given together with schedule",
        ),
    ],
)
def test_a_key_added_as_one_row_is_refused_by_its_row_naming_the_key_and_value(
    metadata: dict[str, str], key: str, value: str, why: str
) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        read_publish(metadata, CTX, WITH_OVERLAP)
    assert (err.value.key, err.value.value) == (key, value)
    assert why in err.value.reason


def test_a_key_added_as_one_row_excludes_the_keys_its_row_names() -> None:
    # The row without its partner, so that only its excludes can refuse.
    table = (*TABLE, replace(WITH_OVERLAP[-1], needs=""))
    assert dict(read_publish({"scheduleOverlap": "none"}, CTX, table).options) == {"scheduleOverlap": "none"}
    with pytest.raises(InvalidArgumentError) as err:
        read_publish({"scheduleOverlap": "all", "scheduledSendDelay": "5s"}, CTX, table)
    assert (err.value.key, err.value.value) == ("scheduledSendDelay", "5s")
    assert "given together with scheduleOverlap='all'" in err.value.reason


def test_a_key_added_as_one_row_needs_delayed_messaging_like_every_delay_key() -> None:
    disabled = PlanContext(now_ms=NOW, pubsub_name="delayed", enabled=False)
    with pytest.raises(InvalidArgumentError) as err:
        read_publish({"scheduleOverlap": "all"}, disabled, WITH_OVERLAP)
    assert (err.value.key, err.value.value) == ("scheduleOverlap", "all")
    assert "enableDelayedMessaging" in err.value.reason


def test_every_row_of_the_table_names_a_parser_that_reads_its_example() -> None:
    examples = {
        "scheduledSendTime": ("2045-11-05T08:15:30-05:00", parse_instant("2045-11-05T13:15:30Z")),
        "scheduledSendDelay": ("90", 90_000),
        "deliverAfter": ("1h30m", 5_400_000),
        "scheduleCancel": ("TRUE", True),
        "schedulePause": ("false", False),
        "ttlInSeconds": ("never", None),
        "scheduleTTL": ("5m", 300_000),
        "targetPubsub": ("kafka", "kafka"),
    }
    by_name = {row.name: row for row in TABLE}
    for name, (text, typed) in examples.items():
        assert by_name[name].parser(name, text) == typed
    with pytest.raises(InvalidArgumentError) as err:
        by_name["scheduleId"].parser("scheduleId", "a\x00b")
    assert err.value.reason == "contains the control character U+0000"
