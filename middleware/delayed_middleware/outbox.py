"""The outbox: fired messages bound for another Dapr pub/sub (publish metadata `targetPubsub`).

Delivery to a broker outside our Redis cannot be atomic with the fire, so the
fire script appends each due message here instead of to its topic, and the
forwarder (delayed_pubsub.forwarder) hands it to the sidecar at least once.

Stream key: `{<consumerID>-delayed}:outbox` (EngineKeys.outbox). One entry per
message, flat fields (a fixed format: the engine's Lua writes it):

| field         | meaning |
|---------------|---------|
| `data`        | the message bytes as published (the original CloudEvent, or a raw payload), byte-exact |
| `metadata`    | JSON object: the user's metadata minus our delay keys, plus `scheduler`, `scheduleNext` |
| `contentType` | optional: the content type given at publish |
| `pubsub`      | the target pub/sub component name |
| `topic`       | the target topic |
| `id`          | the envelope id (history `id`) |
| `bulk`        | present (= the envelope id) when the entry belongs to a delayed bulk publish: |
|               | consecutive entries with the same value go out as ONE bulk publish |
| `expiresAt`   | optional epoch ms: never hand over after it; the remaining TTL goes on as `ttlInSeconds` |

Unknown fields are ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from delayed_middleware.backoff import compute_backoff
from delayed_middleware.entry import (
    CONTENT_TYPE,
    DATA,
    EXPIRES_AT,
    METADATA,
    StreamEntry,
    decode_metadata,
    encode_entry,
)
from delayed_middleware.errors import MalformedEntryError

# The topic entry's fields (entry.py) plus where the message goes.
PUBSUB = "pubsub"
TOPIC = "topic"
ID = "id"
BULK = "bulk"
# The consumer group the forwarders of one app share on its outbox.
OUTBOX_GROUP = "forwarder"


@dataclass(frozen=True)
class HandOffPolicy:
    """How often a refused hand-off is retried, and where it goes after the last attempt.

    The forwarder carries it out; the operator's listing (delayed_middleware.inspector)
    reads the next try of a waiting entry from it. The delay before attempt n+1
    is compute_backoff(n).
    """

    max_attempts: int = 8
    base_s: float = 1.0
    cap_s: float = 60.0
    multiplier: float = 2.0
    # '' = no dead letter: keep retrying at cap_s (reported, never dropped).
    dead_letter_topic: str = ""

    def delay_ms(self, attempt: int) -> int:
        """Milliseconds to wait after failed attempt `attempt` (1-based)."""
        return int(
            1000
            * compute_backoff(
                max(1, min(attempt, self.max_attempts)),
                base_s=self.base_s,
                cap_s=self.cap_s,
                multiplier=self.multiplier,
            )
        )


@dataclass(frozen=True)
class OutboxEntry:
    """One message waiting in the outbox for its hand-off to `pubsub`/`topic`."""

    pubsub: str
    topic: str
    data: bytes
    id: str = ""
    metadata: Mapping[str, str] = field(default_factory=dict)
    content_type: str = ""
    # The envelope id of a delayed bulk publish; '' for a single message.
    bulk: str = ""
    # Epoch ms after which the message must not be handed over; 0 = never expires.
    expires_at_ms: int = 0


def encode_outbox_entry(entry: OutboxEntry) -> dict[str, bytes]:
    """Fields for XADD (the engine writes the same layout from Lua): a topic entry's
    (data, metadata, contentType, expiresAt) plus where it goes."""
    fields = encode_entry(StreamEntry(entry.data, entry.metadata, entry.content_type, entry.expires_at_ms))
    fields[PUBSUB] = entry.pubsub.encode()
    fields[TOPIC] = entry.topic.encode()
    fields[ID] = entry.id.encode()
    if entry.bulk:
        fields[BULK] = entry.bulk.encode()
    return fields


def decode_outbox_entry(fields: Mapping[bytes, bytes] | Mapping[str, bytes]) -> OutboxEntry:
    """Read one outbox entry.

    Raises MalformedEntryError when the target (pubsub, topic) is missing: no
    retry can deliver such an entry. Unreadable metadata is dropped and an
    unreadable expiry ignored rather than losing the data, as decode_entry does.
    """
    norm = {(k.decode() if isinstance(k, bytes) else k): bytes(v) for k, v in fields.items()}

    def text(key: str) -> str:
        return norm.get(key, b"").decode(errors="replace")

    pubsub, topic = text(PUBSUB), text(TOPIC)
    if not pubsub or not topic:
        raise MalformedEntryError(f"outbox entry without a target: pubsub={pubsub!r} topic={topic!r}")
    metadata = decode_metadata(norm.get(METADATA))
    expires_at_ms = 0
    raw_expiry = text(EXPIRES_AT)
    if raw_expiry:
        try:
            expires_at_ms = max(0, int(raw_expiry))
        except ValueError:
            expires_at_ms = 0
    return OutboxEntry(
        pubsub=pubsub,
        topic=topic,
        data=norm.get(DATA, b""),
        id=text(ID),
        metadata=metadata,
        content_type=text(CONTENT_TYPE),
        bulk=text(BULK),
        expires_at_ms=expires_at_ms,
    )
