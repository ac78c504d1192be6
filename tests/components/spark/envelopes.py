"""Envelopes as raw bytes, the way a newer engine writes them: fields an older reader's
stubs do not know, read back from the unknown fields."""

from __future__ import annotations

from delayed_middleware.envelope import Envelope, encode_envelope
from tests.wire import bytes_field, varint_field


def _field(number: int, value: str | int) -> bytes:
    if isinstance(value, int):
        return varint_field(number, value)
    return bytes_field(number, value.encode())


def extended_envelope(**fields: str | int) -> bytes:
    """An envelope with fields 11-17 (kind, schedule, expiry, retry), as the engine writes them for
    recurring, expiring and retried messages (unknown fields to stubs older than them).

    Types as in delayed.proto: kind int32 (0 one-shot, 1 recurring, 2 retry),
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
