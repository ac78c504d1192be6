"""Publish planning for the schedules contract: schedule, scheduleCancel, scheduleSource, scheduleTTL and
per-message TTL, as tables of metadata in and plans (or refusals) out."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from delayed_middleware import envelope as env
from delayed_middleware import plan
from delayed_middleware.entry import StreamEntry
from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.instants import parse_instant
from delayed_middleware.plan import (
    Cancel,
    PlanContext,
    PublishPlan,
    Request,
    Timing,
    plain_cancel,
    plan_bulk,
    plan_publish,
    read_request,
)
from delayed_middleware.schedules import parse_schedule

NOW = parse_instant("2026-11-26T05:00:00Z")
CTX = PlanContext(now_ms=NOW, pubsub_name="delayed", enabled=True)
CLOUDEVENT = b'{"specversion":"1.0","id":"1","data":{"n":1}}'


def test_no_keys_is_an_immediate_publish() -> None:
    assert read_request({"customer": "acme"}, CTX) == Request()


def test_ttl_alone_works_without_delayed_messaging() -> None:
    ctx = PlanContext(now_ms=NOW, pubsub_name="p", enabled=False)
    assert read_request({"ttlInSeconds": "10"}, ctx) == Request(expires_at_ms=NOW + 10_000)


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        ({"schedule": "@every 2s"}, Timing(NOW + 2000, None, parse_schedule("@every 2s", now_ms=NOW))),
        (
            {"schedule": "@every 2s", "scheduleId": "r1", "scheduleTTL": "500ms", "scheduleSource": "sensor"},
            Timing(NOW + 2000, "r1", parse_schedule("@every 2s", now_ms=NOW), "sensor", 500),
        ),
        (
            {"schedule": "0 */5 * * * *"},
            Timing(parse_instant("2026-11-26T05:05:00Z"), None, parse_schedule("0 */5 * * * *", now_ms=NOW)),
        ),
        (
            {"schedule": "@daily"},
            Timing(parse_instant("2026-11-27T00:00:00Z"), None, parse_schedule("@daily", now_ms=NOW)),
        ),
        # @at is a one-shot: no recurring schedule, due at its instant (past: at once)
        ({"schedule": "@at 2026-11-26T06:00:00Z"}, Timing(parse_instant("2026-11-26T06:00:00Z"), None)),
        ({"schedule": "@at 2001-01-01T00:00:00Z", "scheduleId": "x"}, Timing(NOW, "x")),
        (
            {"schedule": "@at 2026-11-26T06:00:00Z", "scheduleSource": "s"},
            Timing(parse_instant("2026-11-26T06:00:00Z"), None, None, "s"),
        ),
        ({"scheduledSendDelay": "90s", "scheduleId": "d"}, Timing(NOW + 90_000, "d")),
        (
            {"scheduleTTL": "never", "schedule": "@hourly"},
            Timing(parse_instant("2026-11-26T06:00:00Z"), None, parse_schedule("@hourly", now_ms=NOW)),
        ),
    ],
)
def test_timing(metadata: dict[str, str], expected: Timing) -> None:
    assert read_request(metadata, CTX) == Request(timing=expected)


@pytest.mark.parametrize("value", ["true", "TRUE", "True"])
def test_cancel(value: str) -> None:
    assert read_request({"scheduleCancel": value, "scheduleId": "r1"}, CTX) == Request(cancel="r1")
    assert plan_publish(
        "orders", b"ignored", {"scheduleCancel": value, "scheduleId": "r1"}, "", CTX
    ).cancels == (Cancel(("",), "r1"),)


def test_cancel_false_is_no_cancel() -> None:
    assert read_request({"scheduleCancel": "false", "scheduleId": "r1"}, CTX) == Request()


@pytest.mark.parametrize(
    ("metadata", "key", "reason"),
    [
        ({"scheduleCancel": "true"}, "scheduleCancel", "needs scheduleId"),
        ({"scheduleCancel": "yes", "scheduleId": "a"}, "scheduleCancel", 'must be "true"'),
        ({"scheduleCancel": "", "scheduleId": "a"}, "scheduleCancel", "empty"),
        (
            {"scheduleCancel": "true", "scheduleId": "a", "schedule": "@every 1s"},
            "schedule",
            "schedules nothing",
        ),
        (
            {"scheduleCancel": "true", "scheduleId": "a", "scheduledSendDelay": "1s"},
            "scheduledSendDelay",
            "schedules nothing",
        ),
        ({"scheduleCancel": "true", "scheduleId": "x" * 257}, "scheduleId", "longer than the maximum"),
        ({"scheduleCancel": "true", "scheduleId": "a\nb"}, "scheduleId", "control character"),
        ({"schedule": "@every 1s", "scheduledSendDelay": "1s"}, "scheduledSendDelay", "not both"),
        (
            {"schedule": "@every 1s", "scheduledSendTime": "2030-01-01T00:00:00Z"},
            "scheduledSendTime",
            "not both",
        ),
        # pubsub.pulsar's deliverAt/deliverAfter are delay keys like ours: one timing per message.
        ({"schedule": "@every 1s", "deliverAfter": "1s"}, "deliverAfter", "together with schedule="),
        ({"schedule": "@daily", "deliverAt": "2030-01-01T00:00:00Z"}, "deliverAt", "together with schedule="),
        (
            {"scheduleCancel": "true", "scheduleId": "a", "deliverAfter": "1s"},
            "deliverAfter",
            "schedules nothing",
        ),
        (
            {"scheduledSendTime": "2030-01-01T00:00:00Z", "deliverAfter": "1s"},
            "deliverAfter",
            "together with scheduledSendTime=",
        ),
        (
            {"deliverAt": "2030-01-01T00:00:00Z", "deliverAfter": "1s"},
            "deliverAfter",
            "together with deliverAt=",
        ),
        ({"scheduledSendDelay": "1s", "deliverAt": "2030-01-01T00:00:00Z"}, "deliverAt", "not both"),
        ({"deliverAfter": "1"}, "deliverAfter", "missing unit"),
        ({"schedule": "@every 500ms"}, "schedule", "minimum of 1s"),
        ({"schedule": "* * * * *"}, "schedule", "6 fields"),
        ({"schedule": ""}, "schedule", "empty"),
        ({"scheduleSource": "sensor"}, "scheduleSource", "only applies to a schedule"),
        ({"scheduledSendDelay": "1s", "scheduleTTL": "1m"}, "scheduleTTL", "only applies to a schedule"),
        ({"schedule": "@every 1s", "scheduleSource": "x-delayed"}, "scheduleSource", "reserved"),
        ({"schedule": "@every 1s", "scheduleSource": "{x-delayed}:ids"}, "scheduleSource", "reserved"),
        ({"schedule": "@every 1s", "scheduleTTL": "0"}, "scheduleTTL", "must be positive"),
        ({"schedule": "@every 1s", "scheduleTTL": "soon"}, "scheduleTTL", "not a duration"),
        ({"ttlInSeconds": "abc"}, "ttlInSeconds", "not a duration"),
        ({"ttl": "1s", "ttlInSeconds": "1"}, "ttl", "not both"),
        ({"scheduledSendDelay": "1s", "ttlInSeconds": str(2**63)}, "ttlInSeconds", "292 years"),
    ],
)
def test_refused(metadata: dict[str, str], key: str, reason: str) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        plan_publish("orders", b"{}", metadata, "", CTX)
    assert caught.value.key == key
    assert reason in caught.value.reason


@pytest.mark.parametrize(
    "metadata",
    [{"schedule": "@every 1s"}, {"scheduleCancel": "true", "scheduleId": "a"}, {"scheduleSource": "s"}],
)
def test_schedule_keys_need_delayed_messaging(metadata: dict[str, str]) -> None:
    ctx = PlanContext(now_ms=NOW, pubsub_name="p", enabled=False)
    with pytest.raises(InvalidArgumentError, match="enableDelayedMessaging"):
        read_request(metadata, ctx)


def test_max_delay_bounds_the_first_fire_of_a_schedule() -> None:
    ctx = PlanContext(now_ms=NOW, pubsub_name="p", enabled=True, max_delay_ms=3_600_000)
    assert read_request({"schedule": "@hourly"}, ctx).timing is not None
    with pytest.raises(InvalidArgumentError, match="more than the maximum delay of 1h0m0s") as caught:
        read_request({"schedule": "@daily"}, ctx)
    assert caught.value.key == "schedule"


def test_recurring_envelope_carries_its_schedule() -> None:
    p = plan_publish(
        "orders",
        CLOUDEVENT,
        {
            "schedule": "@every 90s",
            "scheduleId": "r",
            "scheduleSource": "sensor",
            "scheduleTTL": "5m",
            "k": "v",
        },
        "",
        CTX,
    )
    [d] = p.delayed
    e = d.envelope
    assert (e.kind, e.schedule, e.published_at_ms, e.due_ms) == (
        env.RECURRING,
        "@every 1m30s",
        NOW,
        NOW + 90_000,
    )
    assert (e.schedule_id, e.schedule_source, e.schedule_ttl_ms, e.expires_at_ms) == (
        "r",
        "sensor",
        300_000,
        0,
    )
    assert e.message == CLOUDEVENT  # the body unchanged
    assert e.metadata["k"] == "v"  # user metadata verbatim
    assert env.decode_envelope(env.encode_envelope(e)) == e


def test_ttl_on_a_plain_publish_rides_on_the_entry_and_in_the_cloudevent() -> None:
    p = plan_publish("orders", CLOUDEVENT, {"ttlInSeconds": "10"}, "", CTX)
    [i] = p.immediate
    assert i.entry.expires_at_ms == NOW + 10_000
    assert json.loads(i.entry.data)["expiration"] == "2026-11-26T05:00:10.000Z"
    assert i.entry.metadata == {"ttlInSeconds": "10"}  # verbatim
    raw = plan_publish("raw", b"bytes", {"ttl": "1m", "rawPayload": "true"}, "", CTX).immediate[0].entry
    assert (raw.data, raw.expires_at_ms) == (b"bytes", NOW + 60_000)


def test_ttl_on_a_delayed_one_shot_and_on_a_schedule() -> None:
    one = (
        plan_publish("o", CLOUDEVENT, {"scheduledSendDelay": "5s", "ttl": "1s"}, "", CTX).delayed[0].envelope
    )
    assert one.expires_at_ms == NOW + 1000  # expires before it is due: the fire path drops it
    assert json.loads(one.message)["expiration"] == "2026-11-26T05:00:01.000Z"
    rec = plan_publish("o", CLOUDEVENT, {"schedule": "@every 1s", "ttl": "1h"}, "", CTX).delayed[0].envelope
    assert rec.expires_at_ms == NOW + 3_600_000  # the schedule ends then
    assert rec.message == CLOUDEVENT  # its messages get no expiration of the schedule's


def test_bulk_entries_each_with_their_own_schedule_cancel_or_ttl() -> None:
    entries = [
        ("a", StreamEntry(b"1", {"schedule": "@every 1s", "scheduleId": "ra"})),
        ("b", StreamEntry(b"2", {"scheduleCancel": "true", "scheduleId": "old"})),
        ("c", StreamEntry(b"3", {"ttlInSeconds": "5"})),
        ("d", StreamEntry(b"4", {"schedule": "@every 10ms"})),
        ("e", StreamEntry(b"5")),
        ("f", StreamEntry(b"6", {"scheduleCancel": "true"})),
    ]
    p = plan_bulk("orders", entries, {}, CTX)
    assert [d.entry_ids for d in p.delayed] == [("a",)]
    assert p.delayed[0].envelope.kind == env.RECURRING
    assert p.cancels == (Cancel(("b",), "old"),)
    assert [(i.entry_id, i.entry.expires_at_ms) for i in p.immediate] == [("c", NOW + 5000), ("e", 0)]
    assert [f.entry_id for f in p.failed] == ["d", "f"]
    assert p.failed[0].error.startswith("invalid metadata schedule='@every 10ms'")
    assert p.failed[1].error.startswith("invalid metadata scheduleCancel='true': needs scheduleId")


def test_bulk_request_level_ttl_and_schedule() -> None:
    entries = [("a", StreamEntry(b"1")), ("b", StreamEntry(b"2", {"ttl": "1s"}))]
    p = plan_bulk("orders", entries, {"ttlInSeconds": "60"}, CTX)
    assert [(i.entry_id, i.entry.expires_at_ms) for i in p.immediate] == [
        ("a", NOW + 60_000),
        ("b", NOW + 1000),
    ]
    # (b's own ttl replaced the request's ttlInSeconds: they are one setting.) Both in one map: refused.
    with pytest.raises(InvalidArgumentError, match="not both"):
        plan_publish("orders", b"", {"ttlInSeconds": "60", "ttl": "1s"}, "", CTX)
    p = plan_bulk("orders", entries[:1], {"schedule": "@every 5s", "scheduleId": "batch"}, CTX)
    [d] = p.delayed
    assert (d.envelope.kind, d.envelope.schedule_id, len(d.envelope.bulk_entries)) == (
        env.RECURRING,
        "batch",
        1,
    )


def test_pulsar_deliver_after_delays_a_publish_and_stays_on_the_message() -> None:
    p = plan_publish("orders", CLOUDEVENT, {"deliverAfter": "90s", "traceid": "t"}, "", CTX)
    [d] = p.delayed
    assert (p.immediate, d.envelope.due_ms, d.envelope.topic) == ((), NOW + 90_000, "orders")
    # Delivered messages keep the publisher's metadata verbatim, this key included.
    assert d.envelope.metadata == {"deliverAfter": "90s", "traceid": "t"}


def test_bulk_entries_with_pulsar_keys_and_a_request_level_delay_that_clashes() -> None:
    entries = [
        ("a", StreamEntry(b"1", {"deliverAfter": "2s"})),
        ("b", StreamEntry(b"2", {"deliverAt": "2026-11-26T06:00:00Z"})),
        ("c", StreamEntry(b"3", {"deliverAfter": ""})),
    ]
    p = plan_bulk("orders", entries, {}, CTX)
    assert sorted((d.entry_ids, d.envelope.due_ms) for d in p.delayed) == [
        (("a",), NOW + 2_000),
        (("b",), parse_instant("2026-11-26T06:00:00Z")),
    ]
    assert [i.entry_id for i in p.immediate] == ["c"]
    # A request-level deliverAfter and an entry's own scheduledSendDelay: that entry is refused, naming both.
    p = plan_bulk(
        "orders", [("a", StreamEntry(b"1", {"scheduledSendDelay": "5s"}))], {"deliverAfter": "2s"}, CTX
    )
    [failed] = p.failed
    assert (failed.entry_id, p.delayed, p.immediate) == ("a", (), ())
    assert "deliverAfter" in failed.error
    assert "scheduledSendDelay" in failed.error


def test_bulk_request_level_cancel_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="per entry") as caught:
        plan_bulk("orders", [("a", StreamEntry(b""))], {"scheduleCancel": "true", "scheduleId": "x"}, CTX)
    assert caught.value.key == "scheduleCancel"


@given(
    st.dictionaries(
        st.sampled_from(
            [
                "schedule",
                "scheduleId",
                "scheduleCancel",
                "scheduleSource",
                "scheduleTTL",
                "scheduledSendDelay",
                "scheduledSendTime",
                "deliverAt",
                "deliverAfter",
                "ttl",
                "ttlInSeconds",
                "x",
            ]
        ),
        st.sampled_from(
            [
                "",
                "true",
                "@every 1s",
                "1s",
                "5",
                "0 0 * * * *",
                "never",
                "a",
                "-1",
                "@at 2030-01-01T00:00:00Z",
                "2030-01-01T00:00:00Z",
            ]
        ),
        max_size=5,
    )
)
def test_any_metadata_plans_or_is_refused_naming_a_given_key(metadata: dict[str, str]) -> None:
    refused: InvalidArgumentError | None = None
    try:
        p = plan_publish("orders", CLOUDEVENT, metadata, "", CTX)
    except InvalidArgumentError as exc:
        refused = exc
    if refused is not None:
        assert refused.key in metadata
        assert refused.value == metadata[refused.key]
        return
    # Exactly one outcome: stored now, delayed, or cancelled.
    assert len(p.immediate) + len(p.delayed) + len(p.cancels) == 1
    for d in p.delayed:
        assert d.envelope.due_ms >= NOW
        assert (d.envelope.kind == env.RECURRING) == bool(d.envelope.schedule)


def test_target_pubsub_goes_on_the_envelope_and_the_default_applies_to_delayed_messages_only() -> None:
    ctx = PlanContext(now_ms=NOW, pubsub_name="p", enabled=True, default_target_pubsub="kafka")
    [own] = plan_publish("t", b"x", {"scheduledSendDelay": "1s", "targetPubsub": "rabbit"}, "", ctx).delayed
    [dflt] = plan_publish("t", b"x", {"scheduledSendDelay": "1s"}, "", ctx).delayed
    assert (own.envelope.target_pubsub, dflt.envelope.target_pubsub) == ("rabbit", "kafka")
    [now] = plan_publish("t", b"x", {}, "", ctx).immediate  # not delayed: our topic, as ever
    assert now.entry.data == b"x"
    [bulk] = plan_bulk(
        "t", [("e1", StreamEntry(b"a")), ("e2", StreamEntry(b"b"))], {"scheduledSendDelay": "1s"}, ctx
    ).delayed
    assert bulk.envelope.target_pubsub == "kafka"


@pytest.mark.parametrize(
    "metadata",
    [{"targetPubsub": "kafka"}, {"targetPubsub": "kafka", "scheduleCancel": "true", "scheduleId": "x"}],
)
def test_target_pubsub_without_a_delay_is_refused(metadata: dict[str, str]) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        plan_publish("t", b"x", metadata, "", CTX)
    assert (err.value.key, err.value.value) == ("targetPubsub", "kafka")


# --- the plain-cancel fast path: never a different answer from read_request -------------------

_ID_CHARS = st.characters(codec="utf-8") | st.sampled_from(
    ["\x00", "\x1f", "\x7f", "\x85", "\u2028", " ", "\ud800"]
)


@given(
    schedule_id=st.text(alphabet=_ID_CHARS, max_size=8) | st.sampled_from(["x" * 256, "x" * 257, "r1"]),
    cancel=st.sampled_from(["true", "TRUE", "tRuE", "false", "", "yes", "truee"]),
    extra=st.dictionaries(
        st.sampled_from(["ttl", "ttlInSeconds", "targetPubsub", "scheduledSendDelay", "schedule", "x"]),
        st.sampled_from(["1s", "never", "kafka", "", "@every 1s"]),
        max_size=1,
    ),
    enabled=st.booleans(),
)
def test_plain_cancel_accepts_only_what_read_request_reads_as_that_cancel(
    schedule_id: str, cancel: str, extra: dict[str, str], enabled: bool
) -> None:
    ctx = PlanContext(now_ms=NOW, pubsub_name="delayed", enabled=enabled)
    metadata = {"scheduleId": schedule_id, "scheduleCancel": cancel, **extra}
    fast = plain_cancel(metadata, ctx)
    try:
        general: Request | InvalidArgumentError = read_request(metadata, ctx)
    except InvalidArgumentError as exc:
        general = exc
    if fast is not None:
        assert general == Request(cancel=fast)
    elif not extra and enabled and cancel.lower() == "true" and schedule_id.isprintable() and schedule_id:
        assert len(schedule_id) > 256  # the only plain form it leaves to the general path


@pytest.mark.parametrize(
    "request_md",
    [{}, {"rawPayload": "true"}, {"scheduledSendDelay": "1s"}, {"ttl": "1s"}, {"targetPubsub": "kafka"}],
)
@pytest.mark.parametrize("enabled", [True, False])
def test_bulk_of_plain_cancels_plans_as_the_general_path_does(
    request_md: dict[str, str], enabled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever the request's own metadata, the plan is the one without the fast path."""
    ctx = PlanContext(now_ms=NOW, pubsub_name="delayed", enabled=enabled)
    entries = [
        (str(i), StreamEntry(b"", {"scheduleId": f"s{i}", "scheduleCancel": c}))
        for i, c in enumerate(["true", "TRUE", "maybe"])
    ]
    try:
        fast: object = plan_bulk("orders", entries, request_md, ctx)
    except InvalidArgumentError as exc:
        fast = str(exc)
    monkeypatch.setattr(plan, "plain_cancel", lambda metadata, ctx: None)
    try:
        general: object = plan_bulk("orders", entries, request_md, ctx)
    except InvalidArgumentError as exc:
        general = str(exc)
    assert fast == general
    if not request_md and enabled:
        assert isinstance(fast, PublishPlan)
        assert fast.cancels == (Cancel(("0",), "s0"), Cancel(("1",), "s1"))
        assert [f.entry_id for f in fast.failed] == ["2"]


_FAST_CASES = [
    {"scheduledSendDelay": "1h"},
    {"scheduledSendDelay": "90"},
    {"scheduledSendDelay": "0"},
    {"scheduledSendDelay": "1h30m", "traceid": "t", "cloudevent.id": "x"},
    {"scheduledSendTime": "2045-11-05T08:15:30-05:00"},
    {"scheduledSendTime": "2001-01-01T00:00:00Z"},  # past: at once
    {"scheduledSendDelay": "-1s"},
    {"scheduledSendDelay": ""},
    {"scheduledSendDelay": "soon"},
    {"scheduledSendTime": "tomorrow"},
    {"scheduledSendDelay": "9999999h"},
    {"scheduledSendDelay": "1h", "scheduledSendTime": "2045-11-05T08:15:30Z"},
    {"scheduledSendDelay": "1h", "scheduleId": "order-66"},
    {"scheduledSendDelay": "1h", "ttl": "10m"},
    {"scheduledSendDelay": "1h", "targetPubsub": "other"},
    {"scheduledSendDelay": "1h", "schedulePause": "true"},
    {"deliverAfter": "1h"},
    {"traceid": "t"},
    {},
]
_FAST_CONTEXTS = [
    CTX,
    PlanContext(now_ms=NOW, pubsub_name="delayed", enabled=False),
    PlanContext(now_ms=NOW, pubsub_name="delayed", enabled=True, max_delay_ms=3_600_000),
    PlanContext(now_ms=NOW, pubsub_name="delayed", enabled=True, default_target_pubsub="other"),
]


def _outcome(fn: object, *args: object) -> object:
    try:
        return fn(*args)  # type: ignore[operator]
    except InvalidArgumentError as e:
        return ("refused", str(e))


@pytest.mark.parametrize("ctx", _FAST_CONTEXTS)
@pytest.mark.parametrize("metadata", _FAST_CASES)
@pytest.mark.parametrize("data", [b'{"n":1}', b"x" * (4 << 20)])
def test_the_fast_delay_path_plans_exactly_what_the_general_path_plans(
    metadata: dict[str, str], ctx: PlanContext, data: bytes
) -> None:
    fast = _outcome(plan.plan_publish, "orders", data, metadata, "", ctx)
    general = _outcome(plan._plan_publish, "orders", data, dict(metadata), "", ctx)
    assert fast == general


def test_a_plain_one_shot_delay_takes_the_fast_path() -> None:
    for metadata in (
        {"scheduledSendDelay": "1h", "traceid": "t"},
        {"scheduledSendTime": "2045-11-05T08:15:30Z"},
    ):
        assert plan._plain_delay("orders", b"x", metadata, "", CTX) is not None
