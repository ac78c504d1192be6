"""Control requests: pausing and resuming a schedule, and cancelling by id prefix.

Two publish metadata keys, read here before anything else of a publish (a
control request stores no message, so no other planning applies):

- ``schedulePause: true|false`` with ``scheduleId``: hold (``true``) or resume
  (``false``) the pending message or schedule of that id. No body is needed.
- ``scheduleIdPrefix: P`` with ``scheduleCancel: true``: cancel every pending
  message and schedule whose id starts with ``P``.
- ``scheduleTrigger: true`` with ``scheduleId``: deliver that pending message, or
  one extra occurrence of that schedule, now (engine/timecontrol.py).
- ``scheduleReschedule: <RFC 3339 | Go duration>`` with ``scheduleId``: move that
  pending one-shot to another time. A body sent with either is ignored.

Pure: every bad value raises InvalidArgumentError naming the key and the value,
before anything is stored or changed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from delayed_middleware import publish_values as values
from delayed_middleware.delay import ENABLE_DELAYED_MESSAGING, due_within
from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.instants import MAX_INSTANT_MS, format_instant
from delayed_middleware.publish_keys import (
    CONTROL_KEYS,
    SCHEDULE_CANCEL,
    SCHEDULE_ID,
    SCHEDULE_ID_PREFIX,
    SCHEDULE_PAUSE,
    SCHEDULE_RESCHEDULE,
    SCHEDULE_TRIGGER,
    excludes,
)

__all__ = [
    "CONTROL_KEYS",
    "SCHEDULE_ID_PREFIX",
    "SCHEDULE_PAUSE",
    "CancelPrefix",
    "Control",
    "Pause",
    "Reschedule",
    "Trigger",
    "is_control",
    "read_control",
]

_CONTROL: Final = frozenset(CONTROL_KEYS)


@dataclass(frozen=True)
class Pause:
    """schedulePause: hold (`pause` True) or resume (False) the schedule or message `schedule_id`."""

    schedule_id: str
    pause: bool


@dataclass(frozen=True)
class CancelPrefix:
    """scheduleCancel with scheduleIdPrefix: cancel every pending id that starts with `prefix`."""

    prefix: str


@dataclass(frozen=True)
class Trigger:
    """scheduleTrigger: deliver the pending message, or one extra occurrence of the schedule, now."""

    schedule_id: str


@dataclass(frozen=True)
class Reschedule:
    """scheduleReschedule: move the pending one-shot `schedule_id` to `due_ms` (epoch ms).

    `value` is the text given (a refusal of a recurring schedule names it)."""

    schedule_id: str
    due_ms: int
    value: str


Control = Pause | CancelPrefix | Trigger | Reschedule

# The control keys, in the order read_control names the one a request is read by.
_READ_ORDER: Final = (SCHEDULE_TRIGGER, SCHEDULE_RESCHEDULE, SCHEDULE_PAUSE, SCHEDULE_ID_PREFIX)


def is_control(metadata: Mapping[str, str]) -> bool:
    """True when the metadata carries a control key (the request is read by read_control)."""
    return not _CONTROL.isdisjoint(metadata)


def read_control(
    metadata: Mapping[str, str], *, enabled: bool, now_ms: int = 0, max_delay_ms: int | None = None
) -> Control | None:
    """The control request `metadata` asks for, or None when it has no control key.

    `now_ms`: the time a scheduleReschedule duration counts from; `max_delay_ms`: the
    component's maximum delay, which a reschedule may not exceed (as scheduledSendTime).

    Raises InvalidArgumentError (key and value named) for a bad value, a missing
    partner key, a key that makes no sense beside it, or delayed messaging off.
    """
    if not is_control(metadata):
        return None
    key = next(k for k in _READ_ORDER if k in metadata)
    if not enabled:
        raise InvalidArgumentError(
            key,
            metadata[key],
            f'delayed messaging is disabled on this component: set {ENABLE_DELAYED_MESSAGING}: "true" in its '
            "metadata",
        )
    # Keys that would schedule or time something: a control request has none.
    for timing in excludes(key):
        if timing in metadata:
            raise InvalidArgumentError(
                timing, metadata[timing], f"given with {key}: a {key} request schedules nothing, leave it out"
            )
    if key in (SCHEDULE_TRIGGER, SCHEDULE_RESCHEDULE):
        return _time_control(key, metadata, now_ms, max_delay_ms)
    if SCHEDULE_PAUSE in metadata:
        return _pause(metadata)
    return _cancel_prefix(metadata)


def _time_control(
    key: str, metadata: Mapping[str, str], now_ms: int, max_delay_ms: int | None
) -> Trigger | Reschedule:
    """scheduleTrigger or scheduleReschedule (the timing keys were refused before)."""
    value = metadata[key]
    parsed = values.trigger_flag(key, value) if key == SCHEDULE_TRIGGER else values.reschedule_to(key, value)
    for other in (SCHEDULE_CANCEL, SCHEDULE_PAUSE, SCHEDULE_ID_PREFIX, SCHEDULE_TRIGGER, SCHEDULE_RESCHEDULE):
        if other != key and other in metadata:
            raise InvalidArgumentError(
                other, metadata[other], f"given with {key}: give one of them, not both"
            )
    schedule_id = metadata.get(SCHEDULE_ID, "")
    if not schedule_id:
        raise InvalidArgumentError(key, value, "needs scheduleId: the id of the pending message or schedule")
    values.schedule_id(SCHEDULE_ID, schedule_id)
    if key == SCHEDULE_TRIGGER:
        return Trigger(schedule_id)
    assert isinstance(parsed, tuple)
    absolute, ms = parsed
    due = ms if absolute else now_ms + ms
    if due > MAX_INSTANT_MS:
        raise InvalidArgumentError(key, value, f"ends after {format_instant(MAX_INSTANT_MS)}")
    # As scheduledSendTime: a past instant fires at once; the maximum delay holds.
    return Reschedule(schedule_id, due_within(key, value, due, now_ms, max_delay_ms), value)


def _pause(metadata: Mapping[str, str]) -> Pause:
    value = metadata[SCHEDULE_PAUSE]
    pause = values.pause_flag(SCHEDULE_PAUSE, value)
    if SCHEDULE_ID_PREFIX in metadata:
        raise InvalidArgumentError(
            SCHEDULE_ID_PREFIX,
            metadata[SCHEDULE_ID_PREFIX],
            "pauses by prefix are not supported: give schedulePause with one scheduleId",
        )
    if SCHEDULE_CANCEL in metadata:
        raise InvalidArgumentError(
            SCHEDULE_CANCEL, metadata[SCHEDULE_CANCEL], "given with schedulePause: give one of them, not both"
        )
    schedule_id = metadata.get(SCHEDULE_ID, "")
    if not schedule_id:
        raise InvalidArgumentError(
            SCHEDULE_PAUSE, value, "needs scheduleId: the id of the schedule or message to pause or resume"
        )
    values.schedule_id(SCHEDULE_ID, schedule_id)
    return Pause(schedule_id, pause)


def _cancel_prefix(metadata: Mapping[str, str]) -> CancelPrefix:
    prefix = metadata[SCHEDULE_ID_PREFIX]
    cancel = metadata.get(SCHEDULE_CANCEL)
    if cancel is None or cancel.lower() != "true":
        raise InvalidArgumentError(
            SCHEDULE_ID_PREFIX,
            prefix,
            "only applies with scheduleCancel=true (cancel every id with this prefix)",
        )
    if SCHEDULE_ID in metadata:
        raise InvalidArgumentError(
            SCHEDULE_ID, metadata[SCHEDULE_ID], "given with scheduleIdPrefix: give one of them, not both"
        )
    if not prefix:
        raise InvalidArgumentError(
            SCHEDULE_ID_PREFIX,
            prefix,
            "empty: it would cancel every pending message and schedule of the app; give a prefix",
        )
    values.schedule_id(SCHEDULE_ID_PREFIX, prefix)
    return CancelPrefix(prefix)
