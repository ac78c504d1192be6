"""Protobuf wire format by hand, for tests that write bytes the generated stubs never would
(fields an older reader does not know, repeated or mistyped fields, over-long varints)."""

from __future__ import annotations


def varint(value: int) -> bytes:
    """`value` (unsigned) as a base-128 varint."""
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def bytes_field(number: int, body: bytes) -> bytes:
    """Field `number`, length-delimited (wire type 2), holding `body`."""
    return varint(number << 3 | 2) + varint(len(body)) + body


def varint_field(number: int, value: int) -> bytes:
    """Field `number` as a varint (wire type 0)."""
    return varint(number << 3) + varint(value)
