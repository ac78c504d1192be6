"""The lifecycle history: one stream entry per state change of a delayed message.

Public API (read by the operator CLI, the Spark pipeline and anyone with
XRANGE). Stream key: `{<consumerID>-delayed}:history` (EngineKeys.history),
written by the engine's Lua scripts in the same atomic step as the change it
records, trimmed by the component settings `historyMaxLen` / `historyMaxAge`.

Each entry is a flat set of string fields:

| field     | meaning |
|-----------|---------|
| `event`   | scheduled, replaced, cancelled, fired, parked, expired, retried, deadlettered, handedoff, paused, resumed, completed, lost, recovered, backfilled, skipped, triggered, rescheduled |
| `at`      | when it happened, epoch ms (Redis server clock for script-written events) |
| `id`      | the envelope id: its scheduleId when one was given, else its stream id on the delayed topic |
| `sid`     | the scheduleId given by the publisher ('' when none) |
| `topic`   | the target topic |
| `kind`    | oneshot, recurring or retry |
| `due`     | the due time of the occurrence, epoch ms ('' when not applicable) |
| `late`    | fired only: fired-at minus due, ms |
| `size`    | payload bytes (all entries of a bulk envelope) |
| `attempt` | delivery attempt the event concerns (1, 2, ...) |
| `reason`  | parked / expired / cancelled / deadlettered / paused / resumed: why; completed: `NoNextFire`; lost: `EnvelopeGone`; recovered: `NotIndexed`; skipped: `CatchupNone` or `CatchupWindow`, the count and span ('' otherwise) |
| `schedule`| the schedule expression of a recurring envelope ('' otherwise) |
| `prev`    | the entry id of the previous record of the same `id` when `id` is not a stream id ('' otherwise, and on the first) |
| `occ`     | fired only, optional: the nominal time (epoch ms) of the occurrence it delivered, written only when it differs from `due` (a jittered or paced fire); absent: `due` is the occurrence's (or the record predates the field) |

Fields may be added later; readers must ignore unknown ones.

The by-id index: `{<consumerID>-delayed}:history-ids` (EngineKeys.history_index)
maps each `id` that is not a stream id (a scheduleId) to its newest record's
entry id, and `prev` links each such record to the one before, so the records
of one scheduleId are read without a scan of the history (see lua/history.lua;
Inspector.history_newest / history_forward read it, HIST_SWEEP drops what
trimming left behind).

A record that does not follow this format (record_problem says why: no or an
unknown `event`, no `at` or one that is not a time, a number field or `kind`
holding something else, bytes that are not UTF-8) is malformed: analytics count
it apart and never as an event.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from delayed_middleware.aio import text
from delayed_middleware.kinds import LABELS, Kind
from delayed_middleware.lua_scripts import HIST_APPEND, HIST_SWEEP

SCHEDULED: Final = "scheduled"
REPLACED: Final = "replaced"
CANCELLED: Final = "cancelled"
FIRED: Final = "fired"
PARKED: Final = "parked"
EXPIRED: Final = "expired"
RETRIED: Final = "retried"
DEAD_LETTERED: Final = "deadlettered"
HANDED_OFF: Final = "handedoff"
# schedulePause: held, and resumed (its `due` is where it went back into the index).
PAUSED: Final = "paused"
RESUMED: Final = "resumed"
# A recurring schedule fired its last occurrence (scheduleEnd / scheduleLimit) and was removed.
COMPLETED: Final = "completed"
# A due-index entry whose envelope no route finds (deleted from the delayed topic by something
# other than the engine): reported once and removed from the index.
LOST: Final = "lost"
# A pending envelope found on the delayed topic with no due-index entry referring to it (left so
# by a release that did not know the moved hash): put back in the index at its due time.
RECOVERED: Final = "recovered"
# An occurrence of a recurring schedule delivered by a backfill (delayed_middleware.backfill); `due`
# is the occurrence's nominal time.
BACKFILLED: Final = "backfilled"
# Missed occurrences of a recurring schedule its catch-up policy did not deliver (engine/catchup.py):
# `due` is the first one's nominal time, `reason` the policy or window, the count and the span.
SKIPPED: Final = "skipped"
# scheduleTrigger: delivered now (a one-shot's `fired` record follows; a schedule's extra
# occurrence has none). scheduleReschedule: moved; `due` is the new time, `reason` ends
# with "from <the old due, RFC 3339>".
TRIGGERED: Final = "triggered"
RESCHEDULED: Final = "rescheduled"
EVENTS: Final = (
    SCHEDULED,
    REPLACED,
    CANCELLED,
    FIRED,
    PARKED,
    EXPIRED,
    RETRIED,
    DEAD_LETTERED,
    HANDED_OFF,
    PAUSED,
    RESUMED,
    COMPLETED,
    LOST,
    RECOVERED,
    BACKFILLED,
    SKIPPED,
    TRIGGERED,
    RESCHEDULED,
)

# A record's `kind`: a Kind label (delayed_middleware.kinds).
KINDS: Final = LABELS

# The optional field of a `fired` record naming its occurrence's nominal time (lua/history.lua
# writes it only when it differs from `due`); not in FIELDS: a record without it is complete.
OCCURRENCE: Final = "occ"

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
    # `occ`: the nominal time of the occurrence a `fired` record delivered, when not its `due`.
    occurrence_ms: int | None = None


# The history's retention when none is configured, for the engine (EngineConfig) and every other
# writer (Retention). The component's metadata.yaml declares its historyMaxLen and historyMaxAge
# defaults as these; tests/components/test_settings_defaults.py fails if the two drift apart.
HISTORY_MAX_LEN: Final = 1_000_000
HISTORY_MAX_AGE_MS: Final = 86_400_000


@dataclass(frozen=True)
class Retention:
    """How much history to keep: `historyMaxLen` records (0 = no history at all) and `historyMaxAge`.

    Every writer of the history outside the engine's scripts (the subscriber
    retrier, the forwarder) appends through `append`, so the settings bind
    them all; the scripts take `max_len` as an argument and the engine trims
    by age on its own.
    """

    max_len: int = HISTORY_MAX_LEN
    max_age_ms: int = HISTORY_MAX_AGE_MS

    @property
    def enabled(self) -> bool:
        return self.max_len > 0

    def append(self, pipe: Any, key: str, record: Mapping[str, str], now_ms: int) -> int:
        """Queue the record's XADD (bounded by max_len, linked into the by-id index) and the age trim
        on a redis-py pipeline.

        Returns how many commands were queued: 0 when the history is off (then
        nothing is written), else 1 or 2. Both commands touch only `key` and its
        index (one hash tag), so they fit in a transaction with the key's own slot
        on Redis Cluster. The script goes as EVAL, not EVALSHA: a NOSCRIPT inside
        a MULTI would drop the record while the transaction's other commands run.
        """
        if not self.enabled:
            return 0
        args = [item for pair in record.items() for item in pair]
        pipe.eval(HIST_APPEND, 1, key, self.max_len, *args)
        if not self.max_age_ms:
            return 1
        # Approximate: only whole stream nodes go, so this is cheap on every write.
        pipe.xtrim(key, minid=f"{max(0, now_ms - self.max_age_ms)}-0", approximate=True)
        return 2


class IndexSweep:
    """Keeps the by-id index as long as the history: drops the fields whose newest record was
    trimmed away (by `historyMaxLen` or `historyMaxAge`).

    A sweep walks the whole hash a page per `step` (HIST_SWEEP), one every
    `every_ms`: a page per fire-loop pass while a sweep is under way, so no
    pass waits on more than a page, and the index is walked once a minute
    (the fire loop passes at least every `max_sleep_s`). Each field costs
    Redis about a microsecond: a 1M-field index, about a second a minute.
    Replicas sweep side by side; each drop is checked inside the script.
    """

    def __init__(self, history: str, index: str, *, page: int = 5000, every_ms: int = 60_000) -> None:
        self._keys = [history, index]
        self._page = page
        self._every_ms = every_ms
        self._cursor: str | None = None
        self._started_ms = -every_ms
        self.dropped = 0

    async def step(self, redis: Any, now_ms: int) -> None:
        if self._cursor is None:
            if now_ms - self._started_ms < self._every_ms:
                return
            self._started_ms, self._cursor = now_ms, "0"
        cursor, dropped = await redis.eval(HIST_SWEEP, 2, *self._keys, self._cursor, self._page)
        self.dropped += int(dropped)
        cursor = cursor.decode() if isinstance(cursor, bytes) else str(cursor)
        self._cursor = None if cursor == "0" else cursor


def _int(value: str, default: int | None) -> int | None:
    try:
        return int(value) if value != "" else default
    except ValueError:
        return default


def decode_record(stream_id: str | bytes, fields: Mapping[bytes, bytes] | Mapping[str, str]) -> HistoryRecord:
    """Parse one history stream entry (tolerant: unknown fields ignored, missing ones empty)."""
    # Keys too may be any bytes (a hand-written or corrupt entry): never fail the whole read on one.
    f = {
        (k.decode(errors="replace") if isinstance(k, bytes) else k): (
            v.decode(errors="replace") if isinstance(v, bytes) else v
        )
        for k, v in fields.items()
    }
    sid = text(stream_id)
    return HistoryRecord(
        stream_id=sid,
        event=f.get("event", ""),
        at_ms=_int(f.get("at", ""), 0) or 0,
        id=f.get("id", ""),
        schedule_id=f.get("sid", ""),
        topic=f.get("topic", ""),
        kind=f.get("kind", "") or Kind.ONESHOT.label,
        due_ms=_int(f.get("due", ""), None),
        lateness_ms=_int(f.get("late", ""), None),
        size_bytes=_int(f.get("size", ""), 0) or 0,
        attempt=_int(f.get("attempt", ""), 1) or 1,
        reason=f.get("reason", ""),
        schedule=f.get("schedule", ""),
        occurrence_ms=_int(f.get(OCCURRENCE, ""), None),
    )


# Numbers as the scripts write them (Lua tostring of an integer): optional minus, at most 18 digits.
_NUMBER = re.compile(r"-?[0-9]{1,18}")
NUMBER_PATTERN: Final = "^" + _NUMBER.pattern + "$"
NUMBER_FIELDS: Final = ("due", "late", "size", "attempt")
# `at` must be a time Spark can hold (years 1-9999), after the epoch: no event happens at 1970-01-01.
AT_MAX_MS: Final = 253_402_300_799_999

# record_problem's answers, in the order it checks.
NOT_UTF8: Final = "not UTF-8"
NO_EVENT: Final = "no event"
UNKNOWN_EVENT: Final = "unknown event"
NO_AT: Final = "no at"
AT_NOT_A_TIME: Final = "at is not a time"
UNKNOWN_KIND: Final = "unknown kind"


def not_a_number(field: str) -> str:
    return f"{field} is not a number"


def parse_at(value: str) -> int | None:
    """An `at` value as epoch ms when it is a time (a number, after the epoch, before year 10000)."""
    if not _NUMBER.fullmatch(value):
        return None
    ms = int(value)
    return ms if 0 < ms <= AT_MAX_MS else None


def record_problem(fields: Mapping[bytes, bytes] | Mapping[str, str]) -> str | None:
    """Why a history entry does not follow the format (the first problem found), or None.

    Unknown fields are ignored; `id`, `sid`, `topic`, `reason` and `schedule`
    may be empty (a dead-lettered raw entry has no topic).
    """
    f: dict[str, str] = {}
    for k, v in fields.items():
        key = k.decode(errors="replace") if isinstance(k, bytes) else k
        if key not in FIELDS:
            continue  # an unknown field, whatever its bytes
        try:
            f[key] = v.decode() if isinstance(v, bytes) else v
        except UnicodeDecodeError:
            return NOT_UTF8
    event = f.get("event", "")
    if not event:
        return NO_EVENT
    if event not in EVENTS:
        return UNKNOWN_EVENT
    at = f.get("at", "")
    if not at:
        return NO_AT
    if parse_at(at) is None:
        return AT_NOT_A_TIME
    for name in NUMBER_FIELDS:
        value = f.get(name, "")
        if value and not _NUMBER.fullmatch(value):
            return not_a_number(name)
    kind = f.get("kind", "")
    if kind and kind not in KINDS:
        return UNKNOWN_KIND
    return None
