"""The one-shot delay contract: which metadata delays a publish, and which is refused and why."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from types import MappingProxyType

import pytest
from hypothesis import given
from hypothesis import strategies as st

from delayed_middleware.delay import Delay, parse_delay
from delayed_middleware.errors import InvalidArgumentError, echo
from delayed_middleware.instants import format_instant
from delayed_middleware.publish_keys import (
    DELAY_KEYS,
    DELIVER_AFTER,
    DELIVER_AT,
    PULSAR_KEYS,
    SCHEDULE,
    SCHEDULE_CANCEL,
    SCHEDULE_ID,
    SCHEDULE_SOURCE,
    SCHEDULE_TTL,
    SCHEDULED_SEND_DELAY,
    SCHEDULED_SEND_TIME,
    TIME_KEYS,
    TTL,
    TTL_IN_SECONDS,
)

NOW = 1_800_000_000_000  # 2027-01-15T08:00:00Z
HOUR = 3_600_000


def parse(
    metadata: Mapping[str, str], *, enabled: bool = True, max_delay_ms: int | None = None
) -> Delay | None:
    return parse_delay(metadata, now_ms=NOW, enabled=enabled, max_delay_ms=max_delay_ms)


def test_contract_key_names() -> None:
    # These strings are the public API: publishers type them into URLs.
    assert (SCHEDULED_SEND_TIME, SCHEDULED_SEND_DELAY, SCHEDULE_ID) == (
        "scheduledSendTime",
        "scheduledSendDelay",
        "scheduleId",
    )
    assert (SCHEDULE, SCHEDULE_CANCEL, SCHEDULE_SOURCE, SCHEDULE_TTL) == (
        "schedule",
        "scheduleCancel",
        "scheduleSource",
        "scheduleTTL",
    )
    assert (TTL_IN_SECONDS, TTL) == ("ttlInSeconds", "ttl")
    # pubsub.pulsar's keys, spelled as components-contrib's pubsub/pulsar reads them.
    assert (DELIVER_AT, DELIVER_AFTER) == ("deliverAt", "deliverAfter")
    assert set(DELAY_KEYS) == {
        "scheduledSendTime",
        "scheduledSendDelay",
        "deliverAt",
        "deliverAfter",
        "schedule",
        "scheduleId",
        "scheduleCancel",
        "scheduleSource",
        "scheduleTTL",
        "scheduleTimeZone",
        "scheduleStart",
        "scheduleEnd",
        "scheduleLimit",
        "scheduleJitter",
        "scheduleCatchup",
        "scheduleCatchupWindow",
    }
    # The keys that time a one-shot, the Pulsar aliases among them: all gated by enableDelayedMessaging.
    assert TIME_KEYS == ("scheduledSendTime", "scheduledSendDelay", "deliverAt", "deliverAfter")
    assert PULSAR_KEYS == ("deliverAt", "deliverAfter")
    assert set(PULSAR_KEYS) <= set(TIME_KEYS) <= set(DELAY_KEYS)


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        ({}, None),
        ({"rawPayload": "true", "cloudevent.id": "x"}, None),
        ({TTL_IN_SECONDS: "60"}, None),
        ({TTL: "1m"}, None),
        ({SCHEDULE_ID: "order-66"}, None),
        ({SCHEDULED_SEND_DELAY: "90"}, Delay(NOW + 90_000, None)),
        ({SCHEDULED_SEND_DELAY: "90s"}, Delay(NOW + 90_000, None)),
        ({SCHEDULED_SEND_DELAY: "1h30m"}, Delay(NOW + 5_400_000, None)),
        ({SCHEDULED_SEND_DELAY: "1.5ms"}, Delay(NOW + 2, None)),
        ({SCHEDULED_SEND_DELAY: "0"}, Delay(NOW, None)),
        ({SCHEDULED_SEND_DELAY: "0s"}, Delay(NOW, None)),
        ({SCHEDULED_SEND_DELAY: "-0s"}, Delay(NOW, None)),
        ({SCHEDULED_SEND_DELAY: "10s", SCHEDULE_ID: "order-66"}, Delay(NOW + 10_000, "order-66")),
        ({SCHEDULED_SEND_TIME: "2027-01-15T09:00:00Z"}, Delay(NOW + HOUR, None)),
        ({SCHEDULED_SEND_TIME: "2027-01-15T04:00:00-05:00"}, Delay(NOW + HOUR, None)),
        ({SCHEDULED_SEND_TIME: "2027-01-15T08:00:00.000000001Z"}, Delay(NOW + 1, None)),
        ({SCHEDULED_SEND_TIME: "2027-01-15T08:00:00Z"}, Delay(NOW, None)),
        ({SCHEDULED_SEND_TIME: "2027-01-15T07:59:59.999Z"}, Delay(NOW, None)),  # past: at once
        ({SCHEDULED_SEND_TIME: "1970-01-01T00:00:00Z"}, Delay(NOW, None)),
        ({SCHEDULED_SEND_TIME: "2027-01-15T09:00:00Z", SCHEDULE_ID: "a" * 256}, Delay(NOW + HOUR, "a" * 256)),
        ({SCHEDULED_SEND_DELAY: "1s", SCHEDULE_ID: "zamówienie/66 ✓"}, Delay(NOW + 1000, "zamówienie/66 ✓")),
        ({SCHEDULED_SEND_DELAY: "1s", TTL_IN_SECONDS: "5"}, Delay(NOW + 1000, None)),
    ],
)
def test_parse_delay_valid(metadata: dict[str, str], expected: Delay | None) -> None:
    assert parse(metadata) == expected


@pytest.mark.parametrize(
    ("metadata", "key", "value", "reason"),
    [
        ({SCHEDULED_SEND_DELAY: ""}, SCHEDULED_SEND_DELAY, "", "empty"),
        ({SCHEDULED_SEND_TIME: ""}, SCHEDULED_SEND_TIME, "", "empty"),
        ({SCHEDULE_ID: ""}, SCHEDULE_ID, "", "empty"),
        ({SCHEDULED_SEND_DELAY: "1s", SCHEDULE_ID: ""}, SCHEDULE_ID, "", "empty"),
        ({SCHEDULED_SEND_DELAY: "1d"}, SCHEDULED_SEND_DELAY, "1d", "unknown unit 'd'"),
        ({SCHEDULED_SEND_DELAY: "1.5"}, SCHEDULED_SEND_DELAY, "1.5", "missing unit"),
        ({SCHEDULED_SEND_DELAY: " 90"}, SCHEDULED_SEND_DELAY, " 90", "expected a number"),
        ({SCHEDULED_SEND_DELAY: "-1s"}, SCHEDULED_SEND_DELAY, "-1s", "must not be negative"),
        ({SCHEDULED_SEND_DELAY: "-5"}, SCHEDULED_SEND_DELAY, "-5", "must not be negative"),
        ({SCHEDULED_SEND_DELAY: "-1ns"}, SCHEDULED_SEND_DELAY, "-1ns", "must not be negative"),
        ({SCHEDULED_SEND_DELAY: "3000000h"}, SCHEDULED_SEND_DELAY, "3000000h", "too long"),
        (
            {SCHEDULED_SEND_TIME: "2027-01-15T09:00:00"},
            SCHEDULED_SEND_TIME,
            "2027-01-15T09:00:00",
            "needs a UTC offset",
        ),
        (
            {SCHEDULED_SEND_TIME: "2027-02-30T09:00:00Z"},
            SCHEDULED_SEND_TIME,
            "2027-02-30T09:00:00Z",
            "day 30",
        ),
        ({SCHEDULED_SEND_TIME: "tomorrow"}, SCHEDULED_SEND_TIME, "tomorrow", "not an RFC 3339 instant"),
        (
            {SCHEDULED_SEND_TIME: "2027-01-15T09:00:00 05:00"},
            SCHEDULED_SEND_TIME,
            "2027-01-15T09:00:00 05:00",
            "%2B",
        ),
        (
            {SCHEDULED_SEND_TIME: "2027-01-15T09:00:00Z", SCHEDULED_SEND_DELAY: "1s"},
            SCHEDULED_SEND_DELAY,
            "1s",
            "given together with scheduledSendTime='2027-01-15T09:00:00Z'",
        ),
        (
            {SCHEDULED_SEND_DELAY: "1s", SCHEDULE_ID: "a" * 257},
            SCHEDULE_ID,
            "a" * 257,
            "longer than the maximum of 256",
        ),
        ({SCHEDULE_ID: "a" * 257}, SCHEDULE_ID, "a" * 257, "longer than the maximum of 256"),
        ({SCHEDULED_SEND_DELAY: "1s", SCHEDULE_ID: "a\nb"}, SCHEDULE_ID, "a\nb", "control character U+000A"),
        ({SCHEDULED_SEND_DELAY: "1s", SCHEDULE_ID: "a\x00"}, SCHEDULE_ID, "a\x00", "U+0000"),
        ({SCHEDULED_SEND_DELAY: "1s", SCHEDULE_ID: "a\x7f"}, SCHEDULE_ID, "a\x7f", "U+007F"),
        ({SCHEDULED_SEND_DELAY: "1s", SCHEDULE_ID: "a\x85"}, SCHEDULE_ID, "a\x85", "U+0085"),
        ({SCHEDULED_SEND_DELAY: "1s", SCHEDULE_ID: "a\ud800"}, SCHEDULE_ID, "a\ud800", "U+D800"),
        ({SCHEDULE: "@every 1m"}, SCHEDULE, "@every 1m", "not a one-shot delay key"),
        ({SCHEDULE_ID: "x", SCHEDULE_CANCEL: "true"}, SCHEDULE_CANCEL, "true", "not a one-shot delay key"),
        (
            {SCHEDULED_SEND_DELAY: "1s", SCHEDULE_SOURCE: "prices"},
            SCHEDULE_SOURCE,
            "prices",
            "not a one-shot delay key",
        ),
        ({SCHEDULED_SEND_DELAY: "1s", SCHEDULE_TTL: "1m"}, SCHEDULE_TTL, "1m", "not a one-shot delay key"),
    ],
)
def test_parse_delay_invalid(metadata: dict[str, str], key: str, value: str, reason: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        parse(metadata)
    assert (info.value.key, info.value.value) == (key, value)
    assert reason in info.value.reason
    # The message a publisher sees names both key and value.
    assert key in str(info.value)
    assert echo(value) in str(info.value)  # long values cut (errors.echo)


@pytest.mark.parametrize(
    "metadata",
    [
        {SCHEDULED_SEND_TIME: "2027-01-15T09:00:00Z"},
        {SCHEDULED_SEND_DELAY: "10s"},
        {SCHEDULE_ID: "order-66"},
        {SCHEDULE: "@daily"},
        {SCHEDULE_CANCEL: "true"},
        {SCHEDULE_SOURCE: "prices"},
        {SCHEDULE_TTL: "1m"},
        {SCHEDULED_SEND_DELAY: ""},
        {SCHEDULED_SEND_DELAY: "nonsense"},
    ],
)
def test_delay_keys_refused_when_disabled(metadata: dict[str, str]) -> None:
    ((key, value),) = metadata.items()
    with pytest.raises(InvalidArgumentError) as info:
        parse(metadata, enabled=False)
    assert (info.value.key, info.value.value) == (key, value)
    assert 'set enableDelayedMessaging: "true"' in info.value.reason


@pytest.mark.parametrize("metadata", [{}, {TTL_IN_SECONDS: "60"}, {TTL: "1m", "rawPayload": "true"}])
def test_ordinary_publish_passes_when_disabled(metadata: dict[str, str]) -> None:
    assert parse(metadata, enabled=False) is None


@pytest.mark.parametrize(
    ("metadata", "key", "value", "said"),
    [
        ({SCHEDULED_SEND_DELAY: "1h0m0.001s"}, SCHEDULED_SEND_DELAY, "1h0m0.001s", "is 1h0m0.001s from now"),
        ({SCHEDULED_SEND_DELAY: "3601"}, SCHEDULED_SEND_DELAY, "3601", "is 1h0m1s from now"),
        (
            {SCHEDULED_SEND_TIME: "2027-01-15T09:00:00.001Z"},
            SCHEDULED_SEND_TIME,
            "2027-01-15T09:00:00.001Z",
            "1h0m0.001s",
        ),
    ],
)
def test_delay_beyond_maximum_refused(metadata: dict[str, str], key: str, value: str, said: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        parse(metadata, max_delay_ms=HOUR)
    assert (info.value.key, info.value.value) == (key, value)
    assert said in info.value.reason
    assert "maximum delay of 1h0m0s" in info.value.reason


@pytest.mark.parametrize(
    "metadata",
    [
        {SCHEDULED_SEND_DELAY: "1h"},
        {SCHEDULED_SEND_TIME: "2027-01-15T09:00:00Z"},
        {SCHEDULED_SEND_TIME: "2000-01-01T00:00:00Z"},  # past: due now, within any maximum
    ],
)
def test_delay_at_maximum_accepted(metadata: dict[str, str]) -> None:
    delay = parse(metadata, max_delay_ms=HOUR)
    assert delay is not None
    assert NOW <= delay.due_ms <= NOW + HOUR


def test_zero_maximum_allows_only_immediate() -> None:
    assert parse({SCHEDULED_SEND_DELAY: "0s"}, max_delay_ms=0) == Delay(NOW, None)
    with pytest.raises(InvalidArgumentError, match="maximum delay of 0s"):
        parse({SCHEDULED_SEND_DELAY: "1ms"}, max_delay_ms=0)


def test_delay_is_frozen() -> None:
    delay = Delay(NOW, "x")
    with pytest.raises(AttributeError):
        delay.due_ms = 0  # type: ignore[misc]


@given(st.integers(min_value=0, max_value=10**7), st.integers(min_value=0, max_value=4 * 10**12))
def test_whole_seconds_delay_counts_from_now(seconds: int, now_ms: int) -> None:
    delay = parse_delay({SCHEDULED_SEND_DELAY: str(seconds)}, now_ms=now_ms, enabled=True, max_delay_ms=None)
    assert delay == Delay(now_ms + seconds * 1000, None)


@given(st.integers(min_value=0, max_value=4 * 10**12), st.integers(min_value=-(10**12), max_value=10**12))
def test_send_time_is_never_before_now(due_ms: int, offset: int) -> None:
    now_ms = due_ms + offset
    delay = parse_delay(
        {SCHEDULED_SEND_TIME: format_instant(due_ms)}, now_ms=now_ms, enabled=True, max_delay_ms=None
    )
    assert delay == Delay(max(due_ms, now_ms), None)


metadata_values = st.text(max_size=30) | st.sampled_from(
    ["0", "90", "1h30m", "-1s", "2027-01-15T09:00:00Z", "true"]
)
metadata_maps = st.dictionaries(st.sampled_from([*DELAY_KEYS, TTL, TTL_IN_SECONDS, "other"]), metadata_values)


@given(metadata_maps, st.booleans(), st.none() | st.integers(min_value=0, max_value=10**10))
def test_arbitrary_metadata_gives_delay_none_or_invalid_argument(
    metadata: dict[str, str], enabled: bool, max_delay_ms: int | None
) -> None:
    snapshot = dict(metadata)
    error: InvalidArgumentError | None = None
    delay: Delay | None = None
    try:
        delay = parse_delay(
            MappingProxyType(metadata), now_ms=NOW, enabled=enabled, max_delay_ms=max_delay_ms
        )
    except InvalidArgumentError as exc:
        error = exc
    if error is not None:
        assert error.key in metadata
        assert error.value == metadata[error.key]
    elif delay is not None:
        assert enabled
        assert delay.due_ms >= NOW
        if max_delay_ms is not None:
            assert delay.due_ms - NOW <= max_delay_ms
        assert delay.schedule_id == metadata.get(SCHEDULE_ID)
    assert metadata == snapshot  # pure: the input is never changed


# --- pubsub.pulsar's keys: deliverAt (RFC 3339) and deliverAfter (Go duration) ---


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        ({DELIVER_AT: "2027-01-15T09:00:00Z"}, Delay(NOW + HOUR, None)),
        ({DELIVER_AT: "2027-01-15T04:00:00-05:00"}, Delay(NOW + HOUR, None)),
        ({DELIVER_AT: "2027-01-15T08:00:00.000000001Z"}, Delay(NOW + 1, None)),  # Go's RFC3339 takes nanos
        ({DELIVER_AT: "2001-01-01T00:00:00Z"}, Delay(NOW, None)),  # past: at once
        ({DELIVER_AFTER: "90s"}, Delay(NOW + 90_000, None)),
        ({DELIVER_AFTER: "1h30m"}, Delay(NOW + 5_400_000, None)),
        ({DELIVER_AFTER: "1.5ms"}, Delay(NOW + 2, None)),
        ({DELIVER_AFTER: "0"}, Delay(NOW, None)),
        ({DELIVER_AFTER: "2s", SCHEDULE_ID: "order-66"}, Delay(NOW + 2_000, "order-66")),
        # Pulsar skips a key whose value is empty: no delay, and no conflict with ours.
        ({DELIVER_AT: ""}, None),
        ({DELIVER_AFTER: ""}, None),
        ({DELIVER_AFTER: "", SCHEDULED_SEND_DELAY: "5s"}, Delay(NOW + 5_000, None)),
        ({DELIVER_AT: "", DELIVER_AFTER: "5s"}, Delay(NOW + 5_000, None)),
    ],
)
def test_pulsar_delay_keys_delay_like_ours(metadata: dict[str, str], expected: Delay | None) -> None:
    assert parse(metadata) == expected


@pytest.mark.parametrize(
    ("metadata", "key", "reason"),
    [
        # time.ParseDuration needs a unit: Pulsar refuses "90", so do we (scheduledSendDelay takes it).
        ({DELIVER_AFTER: "90"}, DELIVER_AFTER, "missing unit"),
        ({DELIVER_AFTER: "soon"}, DELIVER_AFTER, "not a duration"),
        ({DELIVER_AFTER: "-5s"}, DELIVER_AFTER, "must not be negative"),
        ({DELIVER_AT: "tomorrow"}, DELIVER_AT, "not an RFC 3339 instant"),
        ({DELIVER_AT: "2027-01-15T09:00:00"}, DELIVER_AT, "needs a UTC offset"),
        ({DELIVER_AT: "1800000000000"}, DELIVER_AT, "not an RFC 3339 instant"),
    ],
)
def test_pulsar_delay_keys_refuse_bad_values_naming_the_key(
    metadata: dict[str, str], key: str, reason: str
) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        parse(metadata)
    assert caught.value.key == key
    assert caught.value.value == metadata[key]
    assert reason in caught.value.reason


@pytest.mark.parametrize(("first", "second"), list(itertools.combinations(TIME_KEYS, 2)))
def test_two_time_keys_are_refused_naming_both(first: str, second: str) -> None:
    values = {
        SCHEDULED_SEND_TIME: "2027-01-15T09:00:00Z",
        SCHEDULED_SEND_DELAY: "60",
        DELIVER_AT: "2027-01-15T10:00:00Z",
        DELIVER_AFTER: "2m",
    }
    metadata = {first: values[first], second: values[second]}
    with pytest.raises(InvalidArgumentError) as caught:
        parse(metadata)
    message = str(caught.value)
    assert f"{first}=" in message
    assert f"{second}=" in message
    assert {caught.value.key} <= {first, second}


@pytest.mark.parametrize("key", [DELIVER_AT, DELIVER_AFTER])
def test_pulsar_delay_keys_are_refused_while_delayed_messaging_is_disabled(key: str) -> None:
    value = "2027-01-15T09:00:00Z" if key == DELIVER_AT else "5s"
    with pytest.raises(InvalidArgumentError) as caught:
        parse({key: value}, enabled=False)
    assert caught.value.key == key
    assert "enableDelayedMessaging" in caught.value.reason


@pytest.mark.parametrize(
    ("metadata", "key"),
    [({DELIVER_AFTER: "2h"}, DELIVER_AFTER), ({DELIVER_AT: "2027-01-15T10:00:01Z"}, DELIVER_AT)],
)
def test_pulsar_delay_keys_are_bounded_by_max_delay(metadata: dict[str, str], key: str) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        parse(metadata, max_delay_ms=HOUR)
    assert caught.value.key == key
    assert "maximum delay of 1h" in caught.value.reason


go_durations = st.builds(
    lambda h, m, s, ms: f"{h}h{m}m{s}s{ms}ms",
    st.integers(0, 10_000),
    st.integers(0, 59),
    st.integers(0, 59),
    st.integers(0, 999),
)


@given(go_durations, st.none() | st.text(min_size=1, max_size=20).filter(str.isprintable))
def test_deliver_after_is_scheduled_send_delay_for_every_go_duration(duration: str, sid: str | None) -> None:
    extra = {} if sid is None else {SCHEDULE_ID: sid}
    assert parse({DELIVER_AFTER: duration, **extra}) == parse({SCHEDULED_SEND_DELAY: duration, **extra})


@given(st.integers(min_value=0, max_value=4 * 10**12))
def test_deliver_at_is_scheduled_send_time_for_every_instant(due_ms: int) -> None:
    instant = format_instant(due_ms)
    assert parse({DELIVER_AT: instant}) == parse({SCHEDULED_SEND_TIME: instant})
