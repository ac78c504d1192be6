"""Per-message TTL as Dapr publishers write it, and how it travels to the next hop.

Dapr's keys: ``ttlInSeconds`` (the documented one) and ``ttl``. components-contrib
(``metadata.TryGetTTL``) reads either key as a Go duration or a whole number of
seconds, so we accept both forms under both keys; ``never`` means no expiry.
Where Dapr is lenient we refuse, because the component enforces the TTL itself
(it advertises ``MESSAGE_TTL``) and a silently reinterpreted TTL loses or keeps
messages the publisher did not mean to: both keys at once, zero, negative,
malformed, or an expiry past year 9999 are ``InvalidArgumentError`` naming the
key and the value. An empty value counts as absent, as in Dapr.

Expiry is an absolute instant (epoch ms), fixed when the publish is accepted:
a delayed message whose TTL ends before it is due never fires, and a
redelivery does not restart the clock. ``StreamEntry.expires_at_ms`` carries it
(0 = never). When a message leaves for a hop we do not deliver ourselves (the
built-in ``pubsub.redis`` on the fast path, or another pub/sub through the
sidecar), ``forward_ttl_metadata`` and ``with_cloudevent_expiration`` hand the
remaining time on so that hop can enforce it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Final

from delayed_middleware.durations import format_go_duration, parse_duration_or_seconds
from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.instants import MAX_INSTANT_MS, format_instant
from delayed_middleware.publish_keys import SCHEDULE_TTL, TTL, TTL_IN_SECONDS, TTL_KEYS

__all__ = [
    "CLOUDEVENT_EXPIRATION",
    "NEVER",
    "SCHEDULE_TTL",
    "TTL",
    "TTL_IN_SECONDS",
    "TTL_KEYS",
    "forward_ttl_metadata",
    "is_expired",
    "parse_schedule_ttl",
    "parse_ttl",
    "remaining_ttl_seconds",
    "with_cloudevent_expiration",
]

# No expiry (NATS's value for Nats-TTL too).
NEVER: Final = "never"

# The CloudEvent attribute daprd checks before delivering (contrib pubsub.HasExpired).
CLOUDEVENT_EXPIRATION: Final = "expiration"


def parse_ttl(metadata: Mapping[str, str], *, now_ms: int) -> int | None:
    """The absolute expiry (epoch ms) a publish asks for with ``ttlInSeconds`` or ``ttl``, or None.

    Args:
        metadata: the publish metadata.
        now_ms: the server's current time; the TTL counts from it.

    Returns:
        None when neither key is given (or is empty), or the value is ``never``;
        else ``now_ms + ttl`` in epoch ms.

    Raises:
        InvalidArgumentError: both keys given; a value that is neither a Go
            duration nor whole seconds; zero or negative; an expiry after year
            9999 (including anything past int64 nanoseconds).
    """
    given = [key for key in TTL_KEYS if metadata.get(key, "") != ""]
    if not given:
        return None
    if len(given) > 1:
        raise InvalidArgumentError(
            TTL,
            metadata[TTL],
            f"give {TTL_IN_SECONDS} or {TTL}, not both ({TTL_IN_SECONDS}={metadata[TTL_IN_SECONDS]!r})",
        )
    key = given[0]
    value = metadata[key]
    ttl_ms = _parse_positive(key, value)
    if ttl_ms is None:
        return None
    expires_at_ms = now_ms + ttl_ms
    if expires_at_ms > MAX_INSTANT_MS:
        raise InvalidArgumentError(key, value, "expires after the end of year 9999")
    return expires_at_ms


def parse_schedule_ttl(value: str) -> int | None:
    """The TTL (ms) ``scheduleTTL`` puts on every message a schedule produces, or None for ``never``.

    Go duration (``5m``) or whole seconds (``300``), positive.

    Raises:
        InvalidArgumentError: key ``scheduleTTL``, naming the value: empty,
            malformed, zero, negative, or beyond a Go duration's ~292 years.
    """
    if value == "":
        raise InvalidArgumentError(SCHEDULE_TTL, value, "empty: give a value or leave the key out")
    return _parse_positive(SCHEDULE_TTL, value)


def _parse_positive(key: str, value: str) -> int | None:
    if value.lower() == NEVER:
        return None
    try:
        ttl_ms = parse_duration_or_seconds(value)
    except ValueError as exc:
        raise InvalidArgumentError(key, value, f"{exc}; or {NEVER}") from None
    if ttl_ms <= 0:
        raise InvalidArgumentError(
            key, value, f"must be positive, not {format_go_duration(ttl_ms)} (use {NEVER} for no expiry)"
        )
    return ttl_ms


def is_expired(expires_at_ms: int, now_ms: int) -> bool:
    """True once a message with this expiry (0 = never) must no longer be delivered.

    The expiry instant itself counts as expired: a 10 s TTL gives exactly 10 s.
    """
    return expires_at_ms > 0 and now_ms >= expires_at_ms


def remaining_ttl_seconds(expires_at_ms: int, now_ms: int) -> int | None:
    """Whole seconds of TTL left, for ``ttlInSeconds`` on the next hop; None if the message never expires.

    Rounded up (at least 1) while it is alive, since ``ttlInSeconds`` cannot
    say less than a second and 0 is refused by Dapr: the next hop may deliver up
    to a second late, never early. 0 when already expired: drop the message
    instead of handing it on (``forward_ttl_metadata`` does that check).
    """
    if expires_at_ms <= 0:
        return None
    if is_expired(expires_at_ms, now_ms):
        return 0
    return -(-(expires_at_ms - now_ms) // 1000)


def forward_ttl_metadata(
    metadata: Mapping[str, str], *, expires_at_ms: int, now_ms: int
) -> dict[str, str] | None:
    """The metadata to hand to a hop that enforces TTL itself, or None if the message has expired.

    The publisher's TTL keys are replaced by ``ttlInSeconds`` = the time left,
    so the next hop counts from the original publish, not from the hand-off
    (``ttl`` is removed: contrib reads it before ``ttlInSeconds``). Without an
    expiry (0) the metadata is returned without TTL keys. Every other key is
    kept verbatim.
    """
    if is_expired(expires_at_ms, now_ms):
        return None
    forwarded = {key: value for key, value in metadata.items() if key not in TTL_KEYS}
    remaining = remaining_ttl_seconds(expires_at_ms, now_ms)
    if remaining is not None:
        forwarded[TTL_IN_SECONDS] = str(remaining)
    return forwarded


def with_cloudevent_expiration(data: bytes, expires_at_ms: int) -> bytes:
    """``data`` with its CloudEvent ``expiration`` set to this expiry, if it is a JSON CloudEvent.

    daprd drops a CloudEvent whose ``expiration`` (RFC 3339) has passed before
    handing it to the app, for any pub/sub: writing it is how an entry fired
    onto the fast path (read by the built-in ``pubsub.redis``) keeps its TTL.
    Anything else (raw payloads, non-JSON, no ``specversion``, no expiry) is
    returned unchanged: the caller then relies on ``forward_ttl_metadata``.
    """
    if expires_at_ms <= 0:
        return data
    try:
        text = data.decode()
        event = json.loads(text)
    except (ValueError, RecursionError):
        # UnicodeDecodeError is a ValueError: daprd's CloudEvents are UTF-8 JSON.
        return data
    if not isinstance(event, dict) or "specversion" not in event:
        return data
    stamp = json.dumps(format_instant(min(expires_at_ms, MAX_INSTANT_MS)))
    if CLOUDEVENT_EXPIRATION not in event:
        # Splice rather than re-serialise: every other byte of the event stays as
        # published (number spellings, key order, whitespace).
        brace = text.index("{")
        return f'{text[: brace + 1]}"{CLOUDEVENT_EXPIRATION}":{stamp},{text[brace + 1 :]}'.encode()
    # An expiration already there (daprd's own, when it handled the TTL): replace
    # it. Go's JSON decoders keep the last of duplicate keys, so a splice would
    # not override it; re-serialising may respell numbers, which is acceptable
    # for this rare case, but not NaN/Infinity, which are not JSON.
    event[CLOUDEVENT_EXPIRATION] = json.loads(stamp)
    try:
        return json.dumps(event, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    except ValueError:
        return data
