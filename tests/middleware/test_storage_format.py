"""What needs which storage format, and which releases' connections read which formats: the pure
parts of storage_format.py (the component tests drive the rest through Init on a real Redis)."""

from __future__ import annotations

import pytest

from delayed_middleware import storage_format
from delayed_middleware.envelope import Envelope, decode_envelope, encode_envelope
from delayed_middleware.plan import PlanContext, plan_publish
from delayed_pubsub_pb.delayedpubsub.v1 import delayed_pb2


def _planned(metadata: dict[str, str]) -> Envelope:
    p = plan_publish("ticks", b"x", metadata, "", PlanContext(now_ms=1_700_000_000_000, pubsub_name="delayed", enabled=True))
    [d] = p.delayed
    return d.envelope


@pytest.mark.parametrize(
    ("metadata", "needs", "why"),
    [
        ({"schedule": "@every 1h"}, None, ""),
        ({"scheduledSendDelay": "1h"}, None, ""),
        # The default policy and window store nothing: format 1 holds them.
        ({"schedule": "@every 1h", "scheduleCatchup": "one"}, None, ""),
        ({"schedule": "@every 1h", "scheduleCatchup": "ONE"}, None, ""),
        ({"schedule": "@every 1h", "scheduleJitter": "1s"}, 2, "scheduleJitter"),
        ({"schedule": "0 0 5 * * *", "scheduleTimeZone": "Europe/Berlin"}, 2, "time zone"),
        ({"schedule": "@every 1h", "scheduleCatchup": "all"}, 3, "scheduleCatchup"),
        ({"schedule": "@every 1h", "scheduleCatchup": "none"}, 3, "scheduleCatchup"),
        # A window given is stored, even the default's length: 0.2.0 would ignore it.
        ({"schedule": "@every 1h", "scheduleCatchupWindow": "24h"}, 3, "scheduleCatchupWindow"),
        ({"schedule": "@every 1h", "scheduleCatchupWindow": "1h"}, 3, "scheduleCatchupWindow"),
        # The newest need wins.
        ({"schedule": "@every 1h", "scheduleJitter": "1s", "scheduleCatchup": "all"}, 3, "scheduleCatchup"),
    ],
)
def test_needs_format_names_the_format_a_published_envelope_needs(
    metadata: dict[str, str], needs: int | None, why: str
) -> None:
    envelope = _planned(metadata)
    need = storage_format.needs_format(envelope)
    assert (need[0] if need else None) == needs, need
    assert why in (need[1] if need else ""), need
    # What it judges is what is stored: the same answer after a round trip through the bytes.
    assert storage_format.needs_format(decode_envelope(encode_envelope(envelope))) == need


@pytest.mark.parametrize("catchup", [{}, {"scheduleCatchup": "one"}, {"scheduleCatchup": "One"}])
def test_the_default_catch_up_writes_neither_envelope_field(catchup: dict[str, str]) -> None:
    """Fields 19 and 20 are absent from the bytes of a schedule with the default policy and window,
    so format 2 (release 0.2.0) reads exactly what this release means."""
    raw = encode_envelope(_planned({"schedule": "@every 1h", "scheduleId": "s", **catchup}))
    written = {f.number for f, _ in delayed_pb2.DelayedMessage.FromString(raw).ListFields()}
    assert not written & {19, 20}, written
    raw = encode_envelope(_planned({"schedule": "@every 1h", "scheduleCatchup": "all"}))
    written = {f.number for f, _ in delayed_pb2.DelayedMessage.FromString(raw).ListFields()}
    assert 19 in written  # the check above can fail


def test_the_refusal_names_the_format_needed_and_the_setting() -> None:
    at_2 = str(storage_format.pinned_refusal(2, "scheduleCatchup", storage_format.CATCHUP))
    assert "format 3 (release 0.3.0)" in at_2, at_2
    assert "format 2 (release 0.2.0)" in at_2, at_2
    assert "storageFormat: 3" in at_2, at_2
    at_1 = str(storage_format.pinned_refusal(1, "scheduleJitter", storage_format.ZONES_BOUNDS_JITTER))
    assert "storageFormat: 2" in at_1, at_1


@pytest.mark.parametrize(
    ("name", "reads"),
    [
        ("delayed-pubsub:app1", 1),
        ("delayed-pubsub:app1:blocking", 1),
        ("delayed-pubsub-f2:app1", 2),
        ("delayed-pubsub-f2:app1:blocking", 2),
        ("delayed-pubsub-f3:app1", 3),
        ("delayed-pubsub-f3:app1:blocking", 3),
        ("delayed-pubsub-f3:app2", None),
        ("delayed-pubsub-f3:app1x", None),
        ("delayed-pubsub-fx:app1", None),
        ("other:app1", None),
        ("delayed-pubsub-f3", None),
    ],
)
def test_reads_up_to_knows_each_release_by_its_connection_name(name: str, reads: int | None) -> None:
    assert storage_format.reads_up_to(name, "app1") == reads


def test_this_release_names_its_connections_by_the_newest_format_it_reads() -> None:
    assert storage_format.client_name("app1") == "delayed-pubsub-f3:app1"
    assert storage_format.reads_up_to(storage_format.client_name("app1"), "app1") == storage_format.CURRENT
