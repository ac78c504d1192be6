"""The DelayedMessage envelope: what waits on the `<consumerID>-delayed` topic.

Fields 1-5 follow the Dapr delayed-messaging design (topic, message,
contentType, metadata, bulkPublish) so other readers of that design can decode
our envelopes; the rest are ours. A bulk publish delayed as one unit is one
envelope whose `message` is a serialized DelayedBulk, so it fires as one batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from google.protobuf.message import DecodeError as _ProtoDecodeError

from delayed_middleware.errors import DelayedPubSubError
from delayed_middleware.kinds import Kind
from delayed_pubsub_pb.delayedpubsub.v1 import delayed_pb2

# DelayedMessage.kind (delayed_middleware.kinds), under the names the engine and its tests import.
# Plain ints, as Envelope.kind holds: the engine passes it to its scripts as it is, and
# hiredis packs only exact str, int, float and bytes (an IntEnum member fails the publish).
ONESHOT: Final = Kind.ONESHOT.value
RECURRING: Final = Kind.RECURRING.value
RETRY: Final = Kind.RETRY.value


class EnvelopeDecodeError(DelayedPubSubError):
    """Bytes on the delayed topic that are not a DelayedMessage we can fire."""


@dataclass(frozen=True)
class BulkEntry:
    """One entry of a delayed bulk publish."""

    entry_id: str
    event: bytes
    content_type: str = ""
    metadata: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Envelope:
    """A message waiting for its due time.

    For a single message `message` holds the data byte-exact; for a bulk one
    `bulk_entries` holds the entries and `message` is empty.
    """

    id: str
    topic: str
    due_ms: int
    published_at_ms: int
    message: bytes = b""
    content_type: str = ""
    metadata: Mapping[str, str] = field(default_factory=dict)
    pubsub_name: str = ""
    schedule_id: str = ""
    bulk_entries: Sequence[BulkEntry] = ()
    # A Kind number as a plain int (see ONESHOT); an envelope written elsewhere may carry one we do not know.
    kind: int = Kind.ONESHOT.value
    # The schedule expression of a recurring envelope.
    schedule: str = ""
    # Epoch ms after which the message is never delivered; 0 = never expires.
    expires_at_ms: int = 0
    schedule_source: str = ""
    schedule_ttl_ms: int = 0
    target_pubsub: str = ""
    delivery_attempt: int = 0
    # @every only: its interval in ms (the fire script computes successors from it).
    every_ms: int = 0
    # Recurring only: the catch-up policy (kinds.Catchup as int) and window ms (0 = the default).
    catchup: int = 0
    catchup_window_ms: int = 0

    @property
    def is_bulk(self) -> bool:
        return bool(self.bulk_entries)

    @property
    def is_recurring(self) -> bool:
        return self.kind == Kind.RECURRING

    @property
    def size(self) -> int:
        """Payload bytes: the message, or every entry of a bulk envelope."""
        if self.is_bulk:
            return sum(len(e.event) for e in self.bulk_entries)
        return len(self.message)


def encode_envelope(env: Envelope) -> bytes:
    """Serialize to DelayedMessage wire bytes."""
    metadata = env.metadata
    msg = delayed_pb2.DelayedMessage(
        topic=env.topic,
        metadata=metadata if type(metadata) is dict else dict(metadata),
        dueTimeMs=env.due_ms,
        publishedAtMs=env.published_at_ms,
        pubsubName=env.pubsub_name,
    )
    # Every field is proto3 without presence: a default value is never on the wire, so
    # the ones most envelopes leave at their default are set only when they are not
    # (the bytes are the same; one is encoded per delayed publish).
    if env.content_type:
        msg.contentType = env.content_type
    if env.id:
        msg.id = env.id
    if env.schedule_id:
        msg.scheduleId = env.schedule_id
    if env.kind:
        msg.kind = env.kind
    if env.schedule:
        msg.schedule = env.schedule
    if env.expires_at_ms:
        msg.expiresAtMs = env.expires_at_ms
    if env.schedule_source:
        msg.scheduleSource = env.schedule_source
    if env.schedule_ttl_ms:
        msg.scheduleTtlMs = env.schedule_ttl_ms
    if env.target_pubsub:
        msg.targetPubsub = env.target_pubsub
    if env.delivery_attempt:
        msg.deliveryAttempt = env.delivery_attempt
    if env.every_ms:
        msg.everyMs = env.every_ms
    if env.catchup:
        msg.scheduleCatchup = env.catchup
    if env.catchup_window_ms:
        msg.scheduleCatchupWindowMs = env.catchup_window_ms
    if env.is_bulk:
        msg.bulkPublish = True
        bulk = delayed_pb2.DelayedBulk(
            entries=[
                delayed_pb2.DelayedBulkEntry(
                    entryId=e.entry_id, event=e.event, contentType=e.content_type, metadata=dict(e.metadata)
                )
                for e in env.bulk_entries
            ]
        )
        msg.message = bulk.SerializeToString()
    else:
        msg.message = env.message
    return msg.SerializeToString()


def decode_envelope(raw: bytes) -> Envelope:
    """Parse DelayedMessage bytes; raises EnvelopeDecodeError on anything unusable."""
    msg = delayed_pb2.DelayedMessage()
    try:
        msg.ParseFromString(raw)
    except _ProtoDecodeError as exc:
        raise EnvelopeDecodeError(f"not a DelayedMessage: {exc}") from exc
    if not msg.topic:
        raise EnvelopeDecodeError("DelayedMessage has no topic")
    entries: tuple[BulkEntry, ...] = ()
    message = msg.message
    if msg.bulkPublish:
        bulk = delayed_pb2.DelayedBulk()
        try:
            bulk.ParseFromString(msg.message)
        except _ProtoDecodeError as exc:
            raise EnvelopeDecodeError(f"bulk DelayedMessage has a bad body: {exc}") from exc
        entries = tuple(BulkEntry(e.entryId, e.event, e.contentType, dict(e.metadata)) for e in bulk.entries)
        message = b""
    return Envelope(
        id=msg.id,
        topic=msg.topic,
        due_ms=msg.dueTimeMs,
        published_at_ms=msg.publishedAtMs,
        message=message,
        content_type=msg.contentType,
        metadata=dict(msg.metadata),
        pubsub_name=msg.pubsubName,
        schedule_id=msg.scheduleId,
        bulk_entries=entries,
        kind=msg.kind,
        schedule=msg.schedule,
        expires_at_ms=msg.expiresAtMs,
        schedule_source=msg.scheduleSource,
        schedule_ttl_ms=msg.scheduleTtlMs,
        target_pubsub=msg.targetPubsub,
        delivery_attempt=msg.deliveryAttempt,
        every_ms=msg.everyMs,
        catchup=msg.scheduleCatchup,
        catchup_window_ms=msg.scheduleCatchupWindowMs,
    )
