"""The publish-side metadata contract for one-shot delays.

A publisher asks for a delay with ``scheduledSendTime`` (an RFC 3339 instant) or
``scheduledSendDelay`` (a Go duration or whole seconds), optionally naming the
message with ``scheduleId``. ``pubsub.pulsar``'s keys work too, so an app that
moves from Pulsar changes no code: ``deliverAt`` (an RFC 3339 instant) and
``deliverAfter`` (a Go duration; Pulsar takes no bare seconds), both ignored
when empty, as Pulsar ignores them. One message takes one of the four. ``parse_delay`` turns that metadata into a
``Delay`` or refuses it with an ``InvalidArgumentError`` naming the key and the
value. It is a pure function: refusing here, before anything touches Redis, is
what lets the servicer promise that a refused publish stored nothing.

Recurring schedules (``schedule``), cancel (``scheduleCancel``),
``scheduleSource`` and ``scheduleTTL`` are read by ``plan.read_request``, which
strips them before calling this; given here they are refused rather than
ignored, so a caller that skipped planning never turns a schedule into an
immediate delivery.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from delayed_middleware import publish_values as values
from delayed_middleware.durations import format_go_duration
from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.publish_keys import (
    DELAY_KEYS,
    DELIVER_AFTER,
    DELIVER_AT,
    NOT_ONE_SHOT_KEYS,
    PULSAR_KEYS,
    SCHEDULE_ID,
    SCHEDULED_SEND_TIME,
    TIME_KEYS,
)

# The component setting that must be "true" before any of DELAY_KEYS is accepted.
ENABLE_DELAYED_MESSAGING: Final = "enableDelayedMessaging"

__all__ = [
    "DISABLED_REASON",
    "ENABLE_DELAYED_MESSAGING",
    "Delay",
    "check_one_time_key",
    "check_schedule_id",
    "delay_keys_in",
    "parse_delay",
]

DISABLED_REASON: Final = (
    f'delayed messaging is disabled on this component: set {ENABLE_DELAYED_MESSAGING}: "true" in its metadata'
)


@dataclass(frozen=True)
class Delay:
    """When a delayed message is due, and the id it was published under.

    Attributes:
        due_ms: Unix epoch milliseconds (UTC) at which to deliver; never before
            the ``now_ms`` it was parsed against.
        schedule_id: the publisher's ``scheduleId``, or None. Publishing again
            with the same id replaces the pending message.
    """

    due_ms: int
    schedule_id: str | None


def parse_delay(
    metadata: Mapping[str, str],
    *,
    now_ms: int,
    enabled: bool,
    max_delay_ms: int | None,
) -> Delay | None:
    """Read the one-shot delay a publish asks for, or None for an ordinary publish.

    Args:
        metadata: the publish metadata, as daprd passes it.
        now_ms: the server's current time (Unix ms); delays count from it.
        enabled: the component's ``enableDelayedMessaging`` setting.
        max_delay_ms: the longest accepted delay from ``now_ms``, or None for no limit.

    Returns:
        None when the metadata carries no time key (``scheduledSendTime``,
        ``scheduledSendDelay``, ``deliverAt``, ``deliverAfter``; an empty Pulsar
        key counts as absent), including when it carries only a valid
        ``scheduleId``: an id names a delayed message, it does not delay one.
        (``scheduleId`` with ``scheduleCancel`` is read by ``plan.read_request``.) Otherwise a ``Delay``; a time in the past or a
        zero delay gives ``due_ms == now_ms``, i.e. deliver at once.

    Raises:
        InvalidArgumentError: naming the key and value, when a delay key is
            present while delayed messaging is disabled, is empty, is malformed,
            is a not-yet-supported schedule key, when two time keys are given,
            when the delay is negative, or when it exceeds ``max_delay_ms``.
    """
    present = delay_keys_in(metadata)
    if not present:
        return None
    if not enabled:
        key = present[0]
        raise InvalidArgumentError(key, metadata[key], DISABLED_REASON)
    for key in present:
        if metadata[key] == "":
            raise InvalidArgumentError(key, "", "empty: give a value or leave the key out")
    for key in present:
        if key in NOT_ONE_SHOT_KEYS:
            raise InvalidArgumentError(
                key,
                metadata[key],
                "not a one-shot delay key: plan.read_request handles it (parse_delay reads "
                "scheduledSendTime, scheduledSendDelay, deliverAt and deliverAfter only)",
            )

    schedule_id = metadata.get(SCHEDULE_ID)
    if schedule_id is not None:
        _check_schedule_id(schedule_id)

    times = [key for key in present if key in TIME_KEYS]
    if not times:
        return None
    check_one_time_key(metadata, times)
    key = times[0]
    value = metadata[key]
    # Each key's parser (its row of the table of keys, publish_values.py).
    if key in (SCHEDULED_SEND_TIME, DELIVER_AT):
        due_ms = values.instant(key, value)
    else:
        # deliverAfter is Pulsar's time.ParseDuration: a Go duration, no bare seconds.
        delay_ms = values.go_delay_ms(key, value) if key == DELIVER_AFTER else values.delay_ms(key, value)
        due_ms = now_ms + delay_ms

    return Delay(due_ms=due_within(key, value, due_ms, now_ms, max_delay_ms), schedule_id=schedule_id)


def due_within(key: str, value: str, due_ms: int, now_ms: int, max_delay_ms: int | None) -> int:
    """`due_ms` (the time `value` of `key` names) as a delay keeps it: a past instant is now,
    and one further than `max_delay_ms` from now is refused naming key and value."""
    # A past instant is not an error: clocks differ, and "deliver at once" is
    # what the publisher would want from a time that has already come.
    due_ms = max(due_ms, now_ms)
    if max_delay_ms is not None and due_ms - now_ms > max_delay_ms:
        raise InvalidArgumentError(
            key,
            value,
            f"is {format_go_duration(due_ms - now_ms)} from now, "
            f"more than the maximum delay of {format_go_duration(max_delay_ms)}",
        )
    return due_ms


def delay_keys_in(metadata: Mapping[str, str]) -> list[str]:
    """The keys of DELAY_KEYS `metadata` gives, in DELAY_KEYS order.

    An empty ``deliverAt`` or ``deliverAfter`` is left out: ``pubsub.pulsar``
    ignores an empty value, so an app moving from it keeps working.
    """
    return [key for key in DELAY_KEYS if key in metadata and not (key in PULSAR_KEYS and metadata[key] == "")]


def check_one_time_key(metadata: Mapping[str, str], times: list[str]) -> None:
    """Refuse a message that gives two of TIME_KEYS, naming both: which one wins would be a guess."""
    if len(times) > 1:
        first, second = times[0], times[1]
        raise InvalidArgumentError(
            second,
            metadata[second],
            f"given together with {first}={metadata[first]!r}: give one of {', '.join(TIME_KEYS)}, not both",
        )


def _check_schedule_id(schedule_id: str) -> None:
    """Refuse ids that would be awkward as Redis key parts or in logs."""
    check_schedule_id(schedule_id)


def check_schedule_id(schedule_id: str) -> None:
    """Refuse a scheduleId that would be awkward as a Redis key part or in logs (InvalidArgumentError)."""
    values.schedule_id(SCHEDULE_ID, schedule_id)
