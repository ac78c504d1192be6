"""Control requests: pausing and resuming a schedule, and cancelling by id prefix.

Two publish metadata keys, read here before anything else of a publish (a
control request stores no message, so no other planning applies):

- ``schedulePause: true|false`` with ``scheduleId``: hold (``true``) or resume
  (``false``) the pending message or schedule of that id. No body is needed.
- ``scheduleIdPrefix: P`` with ``scheduleCancel: true``: cancel every pending
  message and schedule whose id starts with ``P``.

Pure: every bad value raises InvalidArgumentError naming the key and the value,
before anything is stored or changed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from delayed_middleware.delay import ENABLE_DELAYED_MESSAGING, check_schedule_id
from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.publish_keys import (
    CONTROL_KEYS,
    SCHEDULE_CANCEL,
    SCHEDULE_ID,
    SCHEDULE_ID_PREFIX,
    SCHEDULE_PAUSE,
    excludes,
)

__all__ = [
    "CONTROL_KEYS",
    "SCHEDULE_ID_PREFIX",
    "SCHEDULE_PAUSE",
    "CancelPrefix",
    "Control",
    "Pause",
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


Control = Pause | CancelPrefix


def is_control(metadata: Mapping[str, str]) -> bool:
    """True when the metadata carries a control key (the request is read by read_control)."""
    return not _CONTROL.isdisjoint(metadata)


def read_control(metadata: Mapping[str, str], *, enabled: bool) -> Control | None:
    """The control request `metadata` asks for, or None when it has no control key.

    Raises InvalidArgumentError (key and value named) for a bad value, a missing
    partner key, a key that makes no sense beside it, or delayed messaging off.
    """
    if not is_control(metadata):
        return None
    key = SCHEDULE_PAUSE if SCHEDULE_PAUSE in metadata else SCHEDULE_ID_PREFIX
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
    if SCHEDULE_PAUSE in metadata:
        return _pause(metadata)
    return _cancel_prefix(metadata)


def _pause(metadata: Mapping[str, str]) -> Pause:
    value = metadata[SCHEDULE_PAUSE]
    if value.lower() not in ("true", "false"):
        raise InvalidArgumentError(SCHEDULE_PAUSE, value, 'must be "true" (pause) or "false" (resume)')
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
    _check_id(SCHEDULE_ID, schedule_id)
    return Pause(schedule_id, value.lower() == "true")


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
    _check_id(SCHEDULE_ID_PREFIX, prefix)
    return CancelPrefix(prefix)


def _check_id(key: str, value: str) -> None:
    """The rules of a scheduleId (length, control characters), named under `key`."""
    try:
        check_schedule_id(value)
    except InvalidArgumentError as err:
        raise InvalidArgumentError(key, value, err.reason) from None
