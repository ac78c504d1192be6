"""The Redis Streams entry format, shared with Dapr's pubsub.redis.

pubsub.redis writes each message as an entry with a `data` field (the bytes as
published) and a `metadata` field (the publish metadata as a JSON object), and
reads nothing else, so streams written by either component read the same.
We add `contentType` only when there is one: pubsub.redis ignores it, and it
lets a bulk entry's content type survive the trip. Likewise `expiresAt` (epoch
ms) when the message has a TTL: our subscriptions never deliver it after that
instant (pubsub.redis readers ignore the field).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

DATA = "data"
METADATA = "metadata"
CONTENT_TYPE = "contentType"
EXPIRES_AT = "expiresAt"


@dataclass(frozen=True)
class StreamEntry:
    """One message as stored on a topic's stream."""

    data: bytes
    metadata: Mapping[str, str] = field(default_factory=dict)
    content_type: str = ""
    # Epoch ms after which the message must not be delivered; 0 = never expires.
    expires_at_ms: int = 0


def encode_entry(entry: StreamEntry) -> dict[str, bytes]:
    """Fields for XADD, in pubsub.redis's layout."""
    fields: dict[str, bytes] = {
        DATA: entry.data,
        METADATA: json.dumps(dict(entry.metadata), separators=(",", ":"), ensure_ascii=False).encode(),
    }
    if entry.content_type:
        fields[CONTENT_TYPE] = entry.content_type.encode()
    if entry.expires_at_ms:
        fields[EXPIRES_AT] = str(entry.expires_at_ms).encode()
    return fields


def decode_metadata(raw: bytes | str | None) -> dict[str, str]:
    """An entry's `metadata` field as a str map: {} when missing or not a JSON object.

    Malformed metadata is dropped rather than refused, as pubsub.redis does: the
    data must still go out. A value that is not a string (a hand-written entry)
    is kept as its JSON text.
    """
    if not raw:
        return {}
    try:
        parsed = json.loads(raw)
    except (ValueError, RecursionError):
        # RecursionError: deeply nested JSON (e.g. 100000 '['), which would
        # otherwise escape from here and kill the loop that reads the entry.
        return {}
    if not isinstance(parsed, dict):
        return {}
    return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in parsed.items()}


def decode_entry(fields: Mapping[bytes, bytes] | Mapping[str, bytes]) -> StreamEntry:
    """Read an entry written by us or by pubsub.redis.

    Malformed metadata is dropped rather than refused, as pubsub.redis does: the
    data must still reach the subscriber.
    """
    norm = {(k.decode() if isinstance(k, bytes) else k): v for k, v in fields.items()}
    data = norm.get(DATA, b"")
    metadata = decode_metadata(norm.get(METADATA))
    content_type = norm.get(CONTENT_TYPE, b"").decode(errors="replace")
    expires_at_ms = 0
    raw_expiry = norm.get(EXPIRES_AT)
    if raw_expiry:
        try:
            expires_at_ms = int(raw_expiry)
        except ValueError:
            # Unreadable expiry: deliver rather than drop; losing data is worse.
            expires_at_ms = 0
    return StreamEntry(
        data=bytes(data), metadata=metadata, content_type=content_type, expires_at_ms=expires_at_ms
    )


@dataclass(frozen=True)
class Trim:
    """How XADD trims a topic's stream (maxLenApprox / streamTTL), approximately (`~`).

    mode '' (never), 'MAXLEN' (threshold = entry count) or 'MINID' (threshold =
    a stream id computed per batch from max_age_ms).
    """

    mode: str = ""
    max_len: int = 0
    max_age_ms: int = 0

    def args(self, now_ms: int) -> tuple[str, str]:
        if self.mode == "MAXLEN":
            return "MAXLEN", str(self.max_len)
        if self.mode == "MINID":
            return "MINID", f"{now_ms - self.max_age_ms}-1"
        return "", ""
