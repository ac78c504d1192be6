"""The Lua decoder's varints (decode.lua), read straight against protobuf's encoder.

The fire path reads every envelope's times (due, publish, expiry, schedule TTL,
@every interval) and its delivery attempt through decode.lua's varint reader.
These tests run that reader inside Redis on envelopes protobuf wrote, with a
value at each side of every 7-bit width boundary, negatives (protobuf writes
them as 10-byte varints) and malformed tails.
"""

from __future__ import annotations

import pytest
import redis

from delayed_middleware import lua_scripts
from delayed_pubsub_pb.delayedpubsub.v1 import delayed_pb2

# decode.lua's numeric fields, as the DelayedMessage names them and the Lua table does.
_FIELDS = (
    ("dueTimeMs", "due"),
    ("publishedAtMs", "published"),
    ("expiresAtMs", "expires"),
    ("scheduleTtlMs", "sttl"),
    ("everyMs", "every"),
)

# The decoded envelope's numbers as exact integers ('%.0f' of Lua's doubles), or the error.
_DECODE = (
    lua_scripts.LUA_DIR / "decode.lua"
).read_text(encoding="utf-8") + """
local ok, env = pcall(decode, ARGV[1])
if not ok then return {'error', tostring(env)} end
return {string.format('%.0f', env.due), string.format('%.0f', env.published),
  string.format('%.0f', env.expires), string.format('%.0f', env.sttl),
  string.format('%.0f', env.every), string.format('%.0f', env.attempt), env.topic, env.entries[1][1]}
"""

# Both sides of every 7-bit boundary up to 2^63 - 1, and negatives (10-byte varints).
_VALUES = sorted(
    {v for k in range(1, 10) for v in (2 ** (7 * k) - 1, 2 ** (7 * k))} - {2**63}
    | {0, 1, 1_800_000_000_000, 2**53 - 1, 2**53, 2**63 - 1, -1, -1_800_000_000_000, -(2**63)}
)


def _lua_decode(client: redis.Redis, raw: bytes) -> list[bytes]:
    got: list[bytes] = client.eval(_DECODE, 0, raw)
    return got


def _as_lua_reads(value: int) -> str:
    """What a double-precision reader makes of this int64's varint (two's complement for negatives)."""
    return f"{float(value % 2**64):.0f}"


@pytest.mark.parametrize("value", _VALUES)
def test_every_varint_width_decodes_as_protobuf_wrote_it(redis_client: redis.Redis, value: int) -> None:
    attempt = value % 2**31  # an int32 field: its own width, non-negative
    msg = delayed_pb2.DelayedMessage(topic="orders", message=b"payload", deliveryAttempt=attempt)
    for proto_name, _ in _FIELDS:
        setattr(msg, proto_name, value)
    got = _lua_decode(redis_client, msg.SerializeToString())
    want = [_as_lua_reads(value)] * len(_FIELDS) + [str(attempt), "orders", "payload"]
    assert [g.decode() for g in got] == want


def test_each_truncated_varint_is_an_error_not_a_value(redis_client: redis.Redis) -> None:
    raw = delayed_pb2.DelayedMessage(topic="orders", dueTimeMs=-1).SerializeToString()
    # The 10-byte due time is last: cut it after each of its first nine bytes.
    assert raw[-10:] == b"\xff" * 9 + b"\x01"
    for cut in range(1, 10):
        got = _lua_decode(redis_client, raw[:-cut])
        assert got[0] == b"error", (cut, got)


def test_an_eleven_byte_varint_is_refused(redis_client: redis.Redis) -> None:
    raw = delayed_pb2.DelayedMessage(topic="orders").SerializeToString() + b"\x38" + b"\xff" * 10 + b"\x01"
    got = _lua_decode(redis_client, raw)
    assert got[0] == b"error"
    assert b"longer than 10 bytes" in got[1]


def _field(number: int, value: int | bytes) -> bytes:
    """One field (number < 16) on the wire: a one-byte key, then a one-byte varint or a short length-delimited value."""
    if isinstance(value, int):
        return bytes([number << 3 | 0, value])
    return bytes([number << 3 | 2, len(value)]) + value


def test_a_field_seen_again_with_the_other_wire_type_clears_the_first(redis_client: redis.Redis) -> None:
    """The last occurrence of a field wins, and one of the wrong wire type leaves the field empty:
    a due time sent as bytes reads as 0, a payload sent as a varint as empty, a repeated time as its last."""
    raw = (
        _field(1, b"orders")
        + _field(2, b"payload")
        + _field(7, 5)  # due
        + _field(7, b"x")  # due again, as bytes: cleared
        + _field(8, 6)  # published
        + _field(8, 9)  # published again: the last wins
        + _field(13, b"y")  # expires as bytes: stays 0
        + _field(15, 3)  # schedule TTL
        + _field(2, 1)  # the payload again, as a varint: cleared
    )
    got = _lua_decode(redis_client, raw)
    assert [g.decode() for g in got] == ["0", "9", "0", "3", "0", "0", "orders", ""]
    # A topic sent last as a varint is no topic: the envelope is undecodable.
    got = _lua_decode(redis_client, raw + _field(1, 4))
    assert got[0] == b"error"
    assert b"no topic" in got[1]
