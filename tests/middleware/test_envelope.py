"""The DelayedMessage envelope: what a delayed publish stores and the fire step reads."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from delayed_middleware.envelope import BulkEntry, Envelope, decode_envelope, encode_envelope
from delayed_pubsub_pb.delayedpubsub.v1 import delayed_pb2

# Protobuf strings are UTF-8: text without surrogates.
_text = st.text(st.characters(exclude_categories=["Cs"]), max_size=12)
_int64 = st.integers(min_value=0, max_value=2**63 - 1)
_int32 = st.integers(min_value=0, max_value=2**31 - 1)
_metadata = st.dictionaries(_text, _text, max_size=4)
_bulk_entry = st.builds(BulkEntry, _text, st.binary(max_size=40), _text, _metadata)


# Envelope fields by the kind of value they hold (the rest are drawn on their own below).
_TEXT_FIELDS = (
    "id",
    "content_type",
    "pubsub_name",
    "schedule_id",
    "schedule",
    "schedule_source",
    "target_pubsub",
)
_INT64_FIELDS = ("due_ms", "published_at_ms", "expires_at_ms", "schedule_ttl_ms", "every_ms")
_INT32_FIELDS = ("kind", "delivery_attempt")


@st.composite
def envelopes(draw: st.DrawFn) -> Envelope:
    """Any envelope, each field at its default or not: single (message) or bulk (entries, no message)."""
    bulk = draw(st.lists(_bulk_entry, max_size=3))
    fields: dict[str, Any] = {name: draw(_text) for name in _TEXT_FIELDS}
    fields |= {name: draw(_int64) for name in _INT64_FIELDS}
    fields |= {name: draw(_int32) for name in _INT32_FIELDS}
    return Envelope(
        topic=draw(_text.filter(bool)),
        message=b"" if bulk else draw(st.binary(max_size=60)),
        metadata=draw(_metadata),
        bulk_entries=tuple(bulk),
        **fields,
    )


def _every_field_set(env: Envelope) -> bytes:
    """The envelope's bytes with every DelayedMessage field given explicitly, defaults included."""
    message = env.message
    if env.bulk_entries:
        message = delayed_pb2.DelayedBulk(
            entries=[
                delayed_pb2.DelayedBulkEntry(
                    entryId=e.entry_id, event=e.event, contentType=e.content_type, metadata=dict(e.metadata)
                )
                for e in env.bulk_entries
            ]
        ).SerializeToString()
    return delayed_pb2.DelayedMessage(
        topic=env.topic,
        message=message,
        contentType=env.content_type,
        metadata=dict(env.metadata),
        bulkPublish=bool(env.bulk_entries),
        id=env.id,
        dueTimeMs=env.due_ms,
        publishedAtMs=env.published_at_ms,
        pubsubName=env.pubsub_name,
        scheduleId=env.schedule_id,
        kind=env.kind,
        schedule=env.schedule,
        expiresAtMs=env.expires_at_ms,
        scheduleSource=env.schedule_source,
        scheduleTtlMs=env.schedule_ttl_ms,
        targetPubsub=env.target_pubsub,
        deliveryAttempt=env.delivery_attempt,
        everyMs=env.every_ms,
    ).SerializeToString()


@given(envelopes())
def test_an_envelope_decodes_to_itself_with_every_field(env: Envelope) -> None:
    assert decode_envelope(encode_envelope(env)) == env


@given(envelopes())
def test_an_envelope_is_stored_as_the_same_bytes_as_with_every_field_given(env: Envelope) -> None:
    # Fields left at their default are skipped when encoding: the stored bytes must not change.
    assert encode_envelope(env) == _every_field_set(env)
