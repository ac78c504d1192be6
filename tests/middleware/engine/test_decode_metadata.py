"""The Lua decoder's metadata maps (decode.lua), read against protobuf's own parser.

The fire path decodes every fired envelope's metadata. The short form every
encoder writes (key, then value, one-byte lengths) has its own quick reader;
these tests hand it map entries in every other form protobuf accepts (fields
out of order or missing, repeated, long, at each length boundary)
and check that the Lua side reads the same map as protobuf's parser does.
"""

from __future__ import annotations

import pytest
import redis

from delayed_middleware import lua_scripts
from delayed_pubsub_pb.delayedpubsub.v1 import delayed_pb2

# The decoded envelope's metadata as a flat, key-sorted list, or the error.
_DECODE = (
    (lua_scripts.LUA_DIR / "decode.lua").read_text(encoding="utf-8")
    + """
local ok, env = pcall(decode, ARGV[1])
if not ok then return {'error', tostring(env)} end
local md = env.entries[1][2]
local keys, out = {}, {}
for k in pairs(md) do keys[#keys + 1] = k end
table.sort(keys)
for _, k in ipairs(keys) do out[#out + 1] = k; out[#out + 1] = md[k] end
out[#out + 1] = tostring(env.pairs)
return out
"""
)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _envelope(*entries: bytes) -> bytes:
    """A DelayedMessage (topic, body) whose metadata map (field 4) holds these raw entries."""
    head = delayed_pb2.DelayedMessage(topic="orders", message=b"payload").SerializeToString()
    return head + b"".join(_field(4, e) for e in entries)


def _key(s: bytes) -> bytes:
    return _field(1, s)


def _value(s: bytes) -> bytes:
    return _field(2, s)


_FORMS = {
    "key then value": [_key(b"k") + _value(b"v")],
    "value then key": [_value(b"v") + _key(b"k")],
    "key only": [_key(b"k")],
    "value only": [_value(b"v")],
    "empty entry": [b""],
    "empty key and value written out": [_key(b"") + _value(b"")],
    "key repeated: the last wins": [_key(b"a") + _key(b"b") + _value(b"v")],
    "value repeated: the last wins": [_key(b"k") + _value(b"v1") + _value(b"v2")],
    "key of 127 bytes, value of 127": [_key(b"k" * 127) + _value(b"v" * 127)],
    "key of 128 bytes": [_key(b"k" * 128) + _value(b"v")],
    "value of 128 bytes": [_key(b"k") + _value(b"v" * 128)],
    "value of 300 bytes": [_key(b"k") + _value(b"v" * 300)],
    "the same key in two entries: the last wins": [_key(b"k") + _value(b"1"), _key(b"k") + _value(b"2")],
    "several entries": [_key(b"a") + _value(b"1"), _value(b"2") + _key(b"b"), _key(b"c")],
    "utf-8 and zero bytes": [_key("ключ".encode()) + _value("\x00é\x7f".encode())],
}


@pytest.mark.parametrize("entries", list(_FORMS.values()), ids=list(_FORMS))
def test_metadata_reads_as_protobuf_parses_it(redis_client: redis.Redis, entries: list[bytes]) -> None:
    raw = _envelope(*entries)
    want = delayed_pb2.DelayedMessage.FromString(raw).metadata
    got: list[bytes] = redis_client.eval(_DECODE, 0, raw)
    flat = [x for k in sorted(k.encode() for k in want) for x in (k, want[k.decode()].encode())]
    assert got[:-1] == flat
    assert got[-1] == str(len(entries)).encode()


@pytest.mark.parametrize(
    "entry",
    [
        # The key's length runs past the entry's end.
        b"\x0a\x05k",
        # The value's length runs past the entry's end.
        _key(b"k") + b"\x12\x05v",
        # A value length that ends exactly one byte past the entry.
        _key(b"k") + b"\x12\x02v",
    ],
)
def test_a_truncated_map_entry_is_an_error_as_in_protobuf(redis_client: redis.Redis, entry: bytes) -> None:
    raw = _envelope(entry)
    with pytest.raises(Exception):  # noqa: B017, PT011 (protobuf's DecodeError type varies by backend)
        delayed_pb2.DelayedMessage.FromString(raw)
    got: list[bytes] = redis_client.eval(_DECODE, 0, raw)
    assert got[0] == b"error", got
