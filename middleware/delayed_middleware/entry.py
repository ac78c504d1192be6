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
import re
from collections.abc import Callable, Mapping
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
    metadata = {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in parsed.items()}
    if _may_hold_surrogates(raw):
        # A lone surrogate (an escape such as "\ud800", or its bytes) is no UTF-8 text: the
        # message could not be sent with it. U+FFFD instead, as pubsub.redis (Go) reads it.
        lone = _LONE_SURROGATE.sub
        return {lone("\ufffd", k): lone("\ufffd", v) for k, v in metadata.items()}
    return metadata


# What a metadata field that yields a lone surrogate contains (a false alarm only costs a
# look at decode_metadata's result): an escape of one, or one as bytes (json.loads reads
# bytes with surrogatepass) or text.
_SURROGATE_BYTES = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def _may_hold_surrogates(raw: bytes | str) -> bool:
    if isinstance(raw, bytes):
        # Two one-byte tests first (memchr): a regex search scans much slower, and most
        # fields (written with ensure_ascii=False) have no backslash nor 0xED byte.
        return (b"\\" in raw or b"\xed" in raw) and _SURROGATE_BYTES.search(raw) is not None
    return _SURROGATE_TEXT.search(raw) is not None


_SURROGATE_TEXT = re.compile(r"\\u[dD][89a-fA-F]|[\ud800-\udfff]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


Fields = Mapping[bytes, bytes] | Mapping[str, bytes] | list[bytes]

_KEYS: dict[bytes | str, str] = {DATA: DATA, METADATA: METADATA, CONTENT_TYPE: CONTENT_TYPE, EXPIRES_AT: EXPIRES_AT}
_KEYS.update({k.encode(): k for k in (DATA, METADATA, CONTENT_TYPE, EXPIRES_AT)})


def decode_entry(fields: Fields) -> StreamEntry:
    """Read an entry written by us or by pubsub.redis: its fields as a mapping, or as the
    flat [field, value, ...] list of a raw reply.

    Malformed metadata is dropped rather than refused, as pubsub.redis does: the
    data must still reach the subscriber.
    """
    return _decode(fields, decode_metadata)


def _decode(fields: Fields, metadata_of: Callable[[bytes | str | None], Mapping[str, str]]) -> StreamEntry:
    data: bytes = b""
    raw_metadata: bytes | str | None = None
    content_type = expiry = b""
    pairs = zip(fields[::2], fields[1::2], strict=False) if isinstance(fields, list) else fields.items()
    keys = _KEYS
    for key, value in pairs:
        name = keys.get(key)
        if name is DATA:
            data = value
        elif name is METADATA:
            raw_metadata = value
        elif name is CONTENT_TYPE:
            content_type = value
        elif name is EXPIRES_AT:
            expiry = value
    expires_at_ms = 0
    if expiry:
        try:
            expires_at_ms = int(expiry)
        except ValueError:
            # Unreadable expiry: deliver rather than drop; losing data is worse.
            expires_at_ms = 0
    return StreamEntry(
        bytes(data), metadata_of(raw_metadata), content_type.decode(errors="replace"), expires_at_ms
    )


# Distinct metadata fields an EntryReader keeps decoded before it starts afresh.
READER_CACHE = 256
# Metadata fields longer than this (bytes) are parsed every time, never kept: the cache then
# holds at most about READER_CACHE times this, not READER_CACHE payloads of any size
# (a message may be 64 MiB) alive after their entries are gone.
READER_CACHE_FIELD = 4096


class EntryReader:
    """decode_entry for a stream read entry after entry (a subscription's reads).

    A metadata field's bytes seen before (publishers send the same metadata with most of
    their messages) reuse the map decoded then: one JSON parse per distinct metadata,
    not per entry (for fields up to READER_CACHE_FIELD bytes; longer ones are parsed each
    time). Such a map is shared by the entries that carry it: StreamEntry.metadata is a
    read-only Mapping, and nothing may change it in place.
    """

    def __init__(self) -> None:
        self._maps: dict[bytes | str, dict[str, str]] = {}

    def __call__(self, fields: Fields) -> StreamEntry:
        return _decode(fields, self._metadata)

    def _metadata(self, raw: bytes | str | None) -> Mapping[str, str]:
        if not raw:
            return {}
        if len(raw) > READER_CACHE_FIELD:
            return decode_metadata(raw)
        maps = self._maps
        found = maps.get(raw)
        if found is None:
            if len(maps) >= READER_CACHE:
                maps.clear()
            found = maps[raw] = decode_metadata(raw)
        return found


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
