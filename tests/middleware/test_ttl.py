"""Per-message TTL: Dapr's keys parsed (tables and hypothesis), expiry checks, and the hand-off to the next hop."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.instants import MAX_INSTANT_MS, parse_instant
from delayed_middleware.ttl import (
    SCHEDULE_TTL,
    TTL,
    TTL_IN_SECONDS,
    forward_ttl_metadata,
    is_expired,
    parse_schedule_ttl,
    parse_ttl,
    remaining_ttl_seconds,
    with_cloudevent_expiration,
)

NOW = parse_instant("2026-11-26T05:00:00Z")
SECOND = 1000
HOUR = 3_600_000


def test_contract_key_names() -> None:
    # Public API: publishers type these into URLs; daprd passes them through.
    assert (TTL_IN_SECONDS, TTL, SCHEDULE_TTL) == ("ttlInSeconds", "ttl", "scheduleTTL")


@pytest.mark.parametrize(
    ("metadata", "expires_at"),
    [
        ({}, None),
        ({"other": "x"}, None),
        ({"ttlInSeconds": ""}, None),  # empty = absent, as in Dapr
        ({"ttl": ""}, None),
        ({"ttlInSeconds": "never"}, None),
        ({"ttl": "never"}, None),
        ({"ttl": "Never"}, None),
        ({"ttlInSeconds": "1"}, NOW + SECOND),
        ({"ttlInSeconds": "60"}, NOW + 60 * SECOND),
        ({"ttlInSeconds": "+60"}, NOW + 60 * SECOND),  # Go's ParseInt takes a sign
        ({"ttlInSeconds": "0060"}, NOW + 60 * SECOND),
        ({"ttlInSeconds": "90s"}, NOW + 90 * SECOND),  # contrib reads either form under either key
        ({"ttl": "90s"}, NOW + 90 * SECOND),
        ({"ttl": "1h30m"}, NOW + 90 * 60 * SECOND),
        ({"ttl": "1.5s"}, NOW + 1500),
        ({"ttl": "1ns"}, NOW + 1),  # rounded up to a whole ms, never to zero
        ({"ttl": "30"}, NOW + 30 * SECOND),
        ({"ttlInSeconds": "", "ttl": "5s"}, NOW + 5 * SECOND),  # an empty one does not count
        ({"ttlInSeconds": "9223372036"}, NOW + 9_223_372_036 * SECOND),  # the longest Go duration in seconds
    ],
)
def test_parse_ttl_accepts(metadata: dict[str, str], expires_at: int | None) -> None:
    assert parse_ttl(metadata, now_ms=NOW) == expires_at


@pytest.mark.parametrize(
    ("metadata", "key", "reason"),
    [
        ({"ttlInSeconds": "5", "ttl": "5s"}, "ttl", "give ttlInSeconds or ttl, not both"),
        ({"ttlInSeconds": "never", "ttl": "never"}, "ttl", "not both"),
        ({"ttlInSeconds": "0"}, "ttlInSeconds", "must be positive"),
        ({"ttl": "0s"}, "ttl", "must be positive"),
        ({"ttlInSeconds": "-1"}, "ttlInSeconds", "must be positive"),
        ({"ttl": "-5m"}, "ttl", "must be positive"),
        ({"ttl": "-1ns"}, "ttl", "must be positive"),
        ({"ttlInSeconds": "abc"}, "ttlInSeconds", "not a duration"),
        ({"ttlInSeconds": "1.5"}, "ttlInSeconds", "missing unit"),
        ({"ttlInSeconds": " 5"}, "ttlInSeconds", "not a duration"),
        ({"ttlInSeconds": "5 "}, "ttlInSeconds", "unknown unit"),
        ({"ttlInSeconds": "\u0665"}, "ttlInSeconds", "not a duration"),  # ARABIC-INDIC FIVE
        ({"ttl": "1d"}, "ttl", "unknown unit"),
        ({"ttl": "forever"}, "ttl", "not a duration"),
        ({"ttlInSeconds": "9223372037"}, "ttlInSeconds", "beyond ~292 years"),
        ({"ttlInSeconds": str(2**63)}, "ttlInSeconds", "beyond ~292 years"),
        ({"ttlInSeconds": "9" * 5000}, "ttlInSeconds", "beyond ~292 years"),
        ({"ttl": "2562048h"}, "ttl", "beyond ~292 years"),
    ],
)
def test_parse_ttl_refuses(metadata: dict[str, str], key: str, reason: str) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        parse_ttl(metadata, now_ms=NOW)
    assert caught.value.key == key
    assert caught.value.value == metadata[key]
    assert reason in caught.value.reason
    assert str(caught.value).startswith(f"invalid metadata {key}=")


def test_expiry_after_year_9999_is_an_invalid_argument_not_an_overflow() -> None:
    late = MAX_INSTANT_MS - 10 * SECOND
    assert parse_ttl({"ttlInSeconds": "10"}, now_ms=late) == MAX_INSTANT_MS
    with pytest.raises(InvalidArgumentError, match="after the end of year 9999"):
        parse_ttl({"ttlInSeconds": "11"}, now_ms=late)
    with pytest.raises(InvalidArgumentError, match="after the end of year 9999"):
        parse_ttl({"ttl": "2562047h"}, now_ms=parse_instant("9800-01-01T00:00:00Z"))


@given(st.text(max_size=40), st.sampled_from(["ttlInSeconds", "ttl"]))
def test_any_value_is_a_ttl_or_an_invalid_argument(value: str, key: str) -> None:
    refused: InvalidArgumentError | None = None
    try:
        expires_at = parse_ttl({key: value}, now_ms=NOW)
    except InvalidArgumentError as exc:
        refused = exc
    if refused is not None:
        assert (refused.key, refused.value) == (key, value)
    elif expires_at is not None:
        assert NOW < expires_at <= MAX_INSTANT_MS


@given(st.integers(1, 10**9))
def test_whole_seconds_and_the_duration_form_agree(seconds: int) -> None:
    by_seconds = parse_ttl({"ttlInSeconds": str(seconds)}, now_ms=NOW)
    assert by_seconds == parse_ttl({"ttl": f"{seconds}s"}, now_ms=NOW) == NOW + seconds * SECOND


@pytest.mark.parametrize(
    ("value", "ttl_ms"),
    [("5m", 300_000), ("300", 300_000), ("1.5s", 1500), ("1h", HOUR), ("never", None), ("NEVER", None)],
)
def test_parse_schedule_ttl_accepts(value: str, ttl_ms: int | None) -> None:
    assert parse_schedule_ttl(value) == ttl_ms


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("", "empty"),
        ("0", "must be positive"),
        ("-5m", "must be positive"),
        ("5 minutes", "unknown unit"),
        ("1e3", "unknown unit"),
        (str(2**63), "beyond ~292 years"),
    ],
)
def test_parse_schedule_ttl_refuses(value: str, reason: str) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        parse_schedule_ttl(value)
    assert (caught.value.key, caught.value.value) == ("scheduleTTL", value)
    assert reason in caught.value.reason


def test_is_expired_at_and_after_the_instant() -> None:
    expires = NOW + 10 * SECOND
    assert not is_expired(expires, NOW)
    assert not is_expired(expires, expires - 1)
    assert is_expired(expires, expires)  # a 10 s TTL gives exactly 10 s
    assert is_expired(expires, expires + HOUR)
    assert not is_expired(0, 2**63)  # 0 = never expires


@pytest.mark.parametrize(
    ("left_ms", "seconds"),
    [(10_000, 10), (9_001, 10), (9_000, 9), (1, 1), (999, 1), (1000, 1), (1001, 2), (0, 0), (-5, 0)],
)
def test_remaining_ttl_seconds_rounds_up_while_alive(left_ms: int, seconds: int) -> None:
    assert remaining_ttl_seconds(NOW + left_ms, NOW) == seconds


def test_remaining_ttl_seconds_without_expiry() -> None:
    assert remaining_ttl_seconds(0, NOW) is None


def test_forward_ttl_metadata_hands_on_the_time_left() -> None:
    metadata = {"ttl": "1m", "traceparent": "00-abc", "ttlInX": "keep", "scheduler": "s1"}
    expires = NOW + 60 * SECOND
    # Fired 20.5 s after the publish: 39.5 s left, handed on as 40 (ttl removed: contrib reads it first).
    forwarded = forward_ttl_metadata(metadata, expires_at_ms=expires, now_ms=NOW + 20_500)
    assert forwarded == {"ttlInSeconds": "40", "traceparent": "00-abc", "ttlInX": "keep", "scheduler": "s1"}
    assert metadata["ttl"] == "1m"  # the caller's mapping is not modified
    # Expired: nothing to hand on; the caller drops the message.
    assert forward_ttl_metadata(metadata, expires_at_ms=expires, now_ms=expires) is None
    # No expiry: TTL keys are not invented.
    assert forward_ttl_metadata({"a": "b"}, expires_at_ms=0, now_ms=NOW) == {"a": "b"}


@given(st.integers(1, 10**12), st.integers(0, 10**12))
def test_forwarded_ttl_never_ends_before_the_original(ttl_ms: int, elapsed: int) -> None:
    expires = NOW + ttl_ms
    now = NOW + elapsed
    forwarded = forward_ttl_metadata({"ttlInSeconds": "1"}, expires_at_ms=expires, now_ms=now)
    if now >= expires:
        assert forwarded is None
    else:
        assert forwarded is not None
        handed = int(forwarded["ttlInSeconds"])
        # The next hop expires it at now + handed s: not before the original expiry, at most 1 s after.
        assert expires <= now + handed * SECOND < expires + SECOND


CLOUDEVENT = (
    b'{"specversion":"1.0","id":"1","source":"app","type":"com.dapr.event.sent",'
    b'"datacontenttype":"application/json","data":{"n":1.10,"big":12345678901234567890}}'
)


def test_cloudevent_expiration_is_spliced_in_byte_for_byte() -> None:
    out = with_cloudevent_expiration(CLOUDEVENT, NOW + 1500)
    assert out == b'{"expiration":"2026-11-26T05:00:01.500Z",' + CLOUDEVENT[1:]
    assert json.loads(out)["expiration"] == "2026-11-26T05:00:01.500Z"
    assert json.loads(out)["data"] == json.loads(CLOUDEVENT)["data"]


def test_cloudevent_expiration_replaces_an_existing_one() -> None:
    event = b'{"specversion":"1.0","expiration":"2020-01-01T00:00:00Z","data":"x"}'
    out = json.loads(with_cloudevent_expiration(event, NOW))
    assert out == {"specversion": "1.0", "expiration": "2026-11-26T05:00:00.000Z", "data": "x"}


@pytest.mark.parametrize(
    "data",
    [
        b"raw bytes",
        b"",
        b'{"data":"no specversion"}',
        b'["specversion"]',
        b"\xff\xfe{",
        b'"specversion"',
        b"[" * 100_000,
        '{"specversion":"1.0"}'.encode("utf-16"),
    ],
)
def test_non_cloudevents_are_left_alone(data: bytes) -> None:
    assert with_cloudevent_expiration(data, NOW) == data


def test_no_expiry_leaves_the_cloudevent_alone() -> None:
    assert with_cloudevent_expiration(CLOUDEVENT, 0) == CLOUDEVENT


def test_existing_expiration_with_a_non_json_number_is_left_alone() -> None:
    # Re-serialising would write Infinity, which is not JSON: keep the bytes.
    event = b'{"specversion":"1.0","expiration":"x","data":1e999}'
    assert with_cloudevent_expiration(event, NOW) == event
