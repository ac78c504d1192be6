"""The lifecycle history: one stream entry per state change of a delayed message.

Public API (read by the operator CLI, the Spark pipeline and anyone with
XRANGE). Stream key: `{<consumerID>-delayed}:history` (EngineKeys.history),
written by the engine's Lua scripts in the same atomic step as the change it
records, trimmed by the component settings `historyMaxLen` / `historyMaxAge`.

Each entry is a flat set of string fields:

| field     | meaning |
|-----------|---------|
| `event`   | scheduled, replaced, cancelled, fired, parked, expired, retried, deadlettered, handedoff |
| `at`      | when it happened, epoch ms (Redis server clock for script-written events) |
| `id`      | the envelope id: its scheduleId when one was given, else its stream id on the delayed topic |
| `sid`     | the scheduleId given by the publisher ('' when none) |
| `topic`   | the target topic |
| `kind`    | oneshot, recurring or retry |
| `due`     | the due time of the occurrence, epoch ms ('' when not applicable) |
| `late`    | fired only: fired-at minus due, ms |
| `size`    | payload bytes (all entries of a bulk envelope) |
| `attempt` | delivery attempt the event concerns (1, 2, ...) |
| `reason`  | parked / expired / cancelled / deadlettered: why ('' otherwise) |
| `schedule`| the schedule expression of a recurring envelope ('' otherwise) |

Fields may be added later; readers must ignore unknown ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

SCHEDULED: Final = "scheduled"
REPLACED: Final = "replaced"
CANCELLED: Final = "cancelled"
FIRED: Final = "fired"
PARKED: Final = "parked"
EXPIRED: Final = "expired"
RETRIED: Final = "retried"
DEAD_LETTERED: Final = "deadlettered"
HANDED_OFF: Final = "handedoff"
EVENTS: Final = (SCHEDULED, REPLACED, CANCELLED, FIRED, PARKED, EXPIRED, RETRIED, DEAD_LETTERED, HANDED_OFF)

ONESHOT: Final = "oneshot"
RECURRING: Final = "recurring"
RETRY: Final = "retry"
KINDS: Final = (ONESHOT, RECURRING, RETRY)

FIELDS: Final = (
    "event",
    "at",
    "id",
    "sid",
    "topic",
    "kind",
    "due",
    "late",
    "size",
    "attempt",
    "reason",
    "schedule",
)


@dataclass(frozen=True)
class HistoryRecord:
    """One lifecycle event, as read back from the history stream."""

    stream_id: str
    event: str
    at_ms: int
    id: str
    schedule_id: str
    topic: str
    kind: str
    due_ms: int | None
    lateness_ms: int | None
    size_bytes: int
    attempt: int
    reason: str
    schedule: str


def _int(value: str, default: int | None) -> int | None:
    try:
        return int(value) if value != "" else default
    except ValueError:
        return default


def decode_record(stream_id: str | bytes, fields: Mapping[bytes, bytes] | Mapping[str, str]) -> HistoryRecord:
    """Parse one history stream entry (tolerant: unknown fields ignored, missing ones empty)."""
    f = {
        (k.decode() if isinstance(k, bytes) else k): (
            v.decode(errors="replace") if isinstance(v, bytes) else v
        )
        for k, v in fields.items()
    }
    sid = stream_id.decode() if isinstance(stream_id, bytes) else stream_id
    return HistoryRecord(
        stream_id=sid,
        event=f.get("event", ""),
        at_ms=_int(f.get("at", ""), 0) or 0,
        id=f.get("id", ""),
        schedule_id=f.get("sid", ""),
        topic=f.get("topic", ""),
        kind=f.get("kind", "") or ONESHOT,
        due_ms=_int(f.get("due", ""), None),
        lateness_ms=_int(f.get("late", ""), None),
        size_bytes=_int(f.get("size", ""), 0) or 0,
        attempt=_int(f.get("attempt", ""), 1) or 1,
        reason=f.get("reason", ""),
        schedule=f.get("schedule", ""),
    )
