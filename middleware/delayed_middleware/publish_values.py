"""Each publish metadata key's value grammar: its text turned into a typed value, or refused.

Every parser here takes (key, text) and returns the typed value or raises
InvalidArgumentError naming the key and the text. They are the parser column
of the table of keys (publish_keys.TABLE), and the one place each grammar is
written: delay.py, ttl.py, target.py, control.py and request.py call them
through it. A value whose meaning depends on other keys (a schedule's
expression, zone, limit and jitter read against the schedule) is checked by the
rule that reads it (request.py, schedules.py); its parser here is ``text``.

A leaf module (it imports no module that imports publish_keys), so the table
can name these functions.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from typing import Final

from delayed_middleware.durations import format_go_duration, parse_duration_or_seconds, parse_go_duration
from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.instants import parse_instant

# (key, text) -> the key's typed value; InvalidArgumentError(key, text, why) for bad text.
Parser = Callable[[str, str], object]

MAX_SCHEDULE_ID_LENGTH: Final = 256
# Dapr component names are Kubernetes object names (<= 253 characters).
MAX_TARGET_LENGTH: Final = 253
# No expiry (NATS's value for Nats-TTL too).
NEVER: Final = "never"


def text(key: str, value: str) -> str:
    """The value as given: its meaning is read by a rule over several keys."""
    return value


def _read(key: str, value: str, grammar: Callable[[str], int]) -> int:
    """`grammar(value)`, its ValueError turned into the refusal naming key and value."""
    try:
        return grammar(value)
    except ValueError as exc:
        raise InvalidArgumentError(key, value, str(exc)) from None


def instant(key: str, value: str) -> int:
    """An RFC 3339 instant with offset or Z, as epoch ms."""
    return _read(key, value, parse_instant)


def delay_ms(key: str, value: str) -> int:
    """A Go duration or whole seconds, not negative, in ms."""
    return _not_negative(key, value, _read(key, value, parse_duration_or_seconds))


def go_delay_ms(key: str, value: str) -> int:
    """A Go duration (no bare seconds: Pulsar's time.ParseDuration), not negative, in ms."""
    return _not_negative(key, value, _read(key, value, parse_go_duration))


def _not_negative(key: str, value: str, ms: int) -> int:
    if ms < 0:
        raise InvalidArgumentError(key, value, "must not be negative")
    return ms


def ttl_ms(key: str, value: str) -> int | None:
    """A positive Go duration or whole seconds in ms, or None for ``never``."""
    if value.lower() == NEVER:
        return None
    try:
        ms = parse_duration_or_seconds(value)
    except ValueError as exc:
        raise InvalidArgumentError(key, value, f"{exc}; or {NEVER}") from None
    if ms <= 0:
        raise InvalidArgumentError(
            key, value, f"must be positive, not {format_go_duration(ms)} (use {NEVER} for no expiry)"
        )
    return ms


def schedule_ttl_ms(key: str, value: str) -> int | None:
    """scheduleTTL: ttl_ms, and an empty value is refused (not taken as absent)."""
    if value == "":
        raise InvalidArgumentError(key, value, "empty: give a value or leave the key out")
    return ttl_ms(key, value)


def schedule_id(key: str, value: str) -> str:
    """An id that is fine as a Redis key part and in logs: not too long, no control characters."""
    if len(value) > MAX_SCHEDULE_ID_LENGTH:
        raise InvalidArgumentError(
            key, value, f"{len(value)} characters, longer than the maximum of {MAX_SCHEDULE_ID_LENGTH}"
        )
    # Cc: C0/C1 controls and DEL. Cs: lone surrogates, which cannot be encoded
    # as UTF-8 and so could never be stored.
    for char in value:
        if unicodedata.category(char) in ("Cc", "Cs"):
            raise InvalidArgumentError(key, value, f"contains the control character U+{ord(char):04X}")
    return value


# scheduleCatchup's values, in the order of kinds.Catchup (its stored number).
CATCHUP_POLICIES: Final = ("one", "all", "none")


def catchup(key: str, value: str) -> int:
    """scheduleCatchup: one, all or none (any case), as its kinds.Catchup number."""
    if value.lower() not in CATCHUP_POLICIES:
        raise InvalidArgumentError(key, value, 'must be "one", "all" or "none"')
    return CATCHUP_POLICIES.index(value.lower())


def catchup_window_ms(key: str, value: str) -> int:
    """scheduleCatchupWindow: a positive Go duration, in ms."""
    ms = _read(key, value, parse_go_duration)
    if ms <= 0:
        raise InvalidArgumentError(key, value, "must be a positive duration")
    return ms


def cancel_flag(key: str, value: str) -> bool:
    """scheduleCancel: true (cancel) or false (the key left out), any case."""
    if value.lower() not in ("true", "false"):
        raise InvalidArgumentError(key, value, 'must be "true" (or "false")')
    return value.lower() == "true"


def pause_flag(key: str, value: str) -> bool:
    """schedulePause: true (pause) or false (resume), any case."""
    if value.lower() not in ("true", "false"):
        raise InvalidArgumentError(key, value, 'must be "true" (pause) or "false" (resume)')
    return value.lower() == "true"


def trigger_flag(key: str, value: str) -> bool:
    """scheduleTrigger: true, any case (there is nothing to say with false)."""
    if value.lower() != "true":
        raise InvalidArgumentError(key, value, 'must be "true" (deliver the message or one occurrence now)')
    return True


def reschedule_to(key: str, value: str) -> tuple[bool, int]:
    """scheduleReschedule: an RFC 3339 instant (True, epoch ms) or a Go duration from now (False, ms)."""
    try:
        return True, parse_instant(value)
    except ValueError:
        pass
    try:
        ms = parse_go_duration(value)
    except ValueError:
        raise InvalidArgumentError(
            key, value, "must be an RFC 3339 instant (2026-11-29T09:00:00Z) or a Go duration (90s, 1h30m)"
        ) from None
    return False, _not_negative(key, value, ms)


def target_name(key: str, value: str) -> str:
    """A Dapr pub/sub component name."""
    if not value.strip():
        raise InvalidArgumentError(key, value, "must name a Dapr pub/sub component")
    if len(value) > MAX_TARGET_LENGTH:
        raise InvalidArgumentError(key, value, f"longer than {MAX_TARGET_LENGTH} characters")
    if value != value.strip() or any(unicodedata.category(c).startswith(("C", "Z")) for c in value):
        raise InvalidArgumentError(key, value, "must not contain spaces or control characters")
    return value
