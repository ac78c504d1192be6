"""PullMessagesResponse messages serialised by hand, one per delivered message.

What `PullMessagesResponse(...).SerializeToString()` gives, without the message: building
it copies the entry's metadata into the message's map and then encodes it all again, for
every message. Here the topic is encoded once per stream, the metadata map once per
distinct map (entries that carry the same metadata share one: delayed_middleware.entry's
EntryReader), and deliveryAttempt once per attempt. The stream's handler is registered with
a serializer that passes bytes through (server.py). The wire format, field by field:

    message PullMessagesResponse {
      bytes data = 1; string topic_name = 2; map<string, string> metadata = 3;
      string content_type = 4; string id = 5;
    }

a map being repeated entries {string key = 1; string value = 2}. Empty fields are left out,
as protobuf does. A string that is no UTF-8 (a lone surrogate) raises UnicodeEncodeError here
as it does in the message's constructor; decode_metadata reads those in metadata as U+FFFD.
"""

from __future__ import annotations

from collections.abc import Mapping

from delayed_pubsub.window import DELIVERY_ATTEMPT, Delivery

# Tags: field number << 3 | 2 (length-delimited).
_DATA, _TOPIC, _METADATA, _CONTENT_TYPE, _ID = b"\x0a", b"\x12", b"\x1a", b"\x22", b"\x2a"
_KEY, _VALUE = b"\x0a", b"\x12"
_SMALL = tuple(bytes((i,)) for i in range(0x80))
# deliveryAttempt entries made once, for the attempts most messages are sent as.
_ATTEMPTS = 8


def varint(n: int) -> bytes:
    """`n` (>= 0) as a protobuf varint."""
    if n < 0x80:
        return _SMALL[n]
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, value: bytes) -> bytes:
    return tag + varint(len(value)) + value


def _map_entry(key: str, value: str) -> bytes:
    return _field(_METADATA, _field(_KEY, key.encode()) + _field(_VALUE, value.encode()))


class Responses:
    """The serialised PullMessagesResponse of each delivery of one stream, on `topic`."""

    def __init__(self, topic: str) -> None:
        self._topic = _field(_TOPIC, topic.encode()) if topic else b""
        # The last metadata map encoded (held, so that `is` names the same map) and its entries.
        self._metadata_of: Mapping[str, str] | None = None
        self._metadata = b""
        self._attempts = tuple(_map_entry(DELIVERY_ATTEMPT, str(i)) for i in range(_ATTEMPTS))

    def __call__(self, d: Delivery) -> bytes:
        entry = d.entry
        metadata = entry.metadata
        if metadata is not self._metadata_of:
            # deliveryAttempt is ours to set: a publisher's own is left out, as the message's
            # map assignment replaced it.
            self._metadata = b"".join(
                _map_entry(k, v) for k, v in metadata.items() if k != DELIVERY_ATTEMPT
            )
            self._metadata_of = metadata
        attempt = d.attempt
        parts = [
            _field(_DATA, entry.data) if entry.data else b"",
            self._topic,
            self._metadata,
            self._attempts[attempt] if 0 <= attempt < _ATTEMPTS else _map_entry(DELIVERY_ATTEMPT, str(attempt)),
            _field(_CONTENT_TYPE, entry.content_type.encode()) if entry.content_type else b"",
            _field(_ID, d.id.encode()),
        ]
        return b"".join(parts)
