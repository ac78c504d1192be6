"""Envelopes as raw bytes, the way a newer engine writes them: fields an older reader's
stubs do not know, read back from the unknown fields."""

from __future__ import annotations

from delayed_middleware.envelope import Envelope, encode_envelope


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, value: str | int) -> bytes:
    if isinstance(value, int):
        return _varint(number << 3) + _varint(value)
    data = value.encode()
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def v2_envelope(**fields: str | int) -> bytes:
    """An envelope as the engine v2 writes it: fields 11-17 after ours (unknown to older stubs).

    Types as in the v2 proto: kind int32 (0 one-shot, 1 recurring, 2 retry),
    expiresAtMs int64, deliveryAttempt int32, the rest strings.
    """
    base = encode_envelope(
        Envelope(id="rem", topic="reminders", due_ms=1_000, published_at_ms=500, message=b"12345")
    )
    numbers = {
        "kind": 11,
        "schedule": 12,
        "expiresAtMs": 13,
        "scheduleSource": 14,
        "targetPubsub": 16,
        "deliveryAttempt": 17,
    }
    return base + b"".join(_field(numbers[k], v) for k, v in fields.items())
