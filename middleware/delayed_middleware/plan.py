"""Publish planning: one pure step from a publish request to what must happen.

The instance executes a plan; it decides nothing. A plan says which messages
are stored on their topic now (`immediate`), which wait in the delay engine
(`delayed`, as envelopes), which schedules are cancelled (`cancels`), and which
bulk entries were refused and why (`failed`). A request that is wrong as a
whole raises InvalidArgumentError (naming the key and the value) before
anything is stored. Pure: time comes in through the context, so every rule is
testable by a table.

The metadata is read once, by request.read_publish, into a typed Request;
planning works on that. Topic rules: request.check_topic.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache

from delayed_middleware import envelope as env
from delayed_middleware.control import CONTROL_KEYS, Control, is_control
from delayed_middleware.durations import parse_duration_or_seconds
from delayed_middleware.entry import StreamEntry
from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.instants import parse_instant
from delayed_middleware.kinds import Kind
from delayed_middleware.publish_keys import (
    ALL_KEYS,
    DELAY_KEYS,
    REQUEST_KEYS,
    SCHEDULE_CANCEL,
    SCHEDULE_ID,
    SCHEDULED_SEND_DELAY,
    SCHEDULED_SEND_TIME,
    SEEN_KEYS,
    TTL_KEYS,
    new_near_misses,
)
from delayed_middleware.request import (
    MAX_TOPIC_LENGTH,
    PlanContext,
    Request,
    Timing,
    check_topic,
    plain_cancel,
    read_publish,
    read_request,
)
from delayed_middleware.ttl import with_cloudevent_expiration

# Reading the metadata (request.py) is part of planning's API: importable from here.
__all__ = [
    "MAX_BULK_ENVELOPE_ENTRIES",
    "MAX_ENVELOPE_BYTES",
    "MAX_ENVELOPE_WORK",
    "MAX_TOPIC_LENGTH",
    "METADATA_PER_ENTRY",
    "Cancel",
    "Delayed",
    "Failed",
    "Immediate",
    "PlanContext",
    "PublishPlan",
    "Request",
    "Timing",
    "check_topic",
    "plain_cancel",
    "plan_bulk",
    "plan_publish",
    "read_publish",
    "read_request",
]

# What one delayed envelope may carry: one envelope fires in one script call
# whatever it costs, and that call must stay within ~20 ms of Redis. Work is
# entries plus one per METADATA_PER_ENTRY metadata pairs (decoding and
# JSON-encoding a pair costs about a quarter of appending an entry; fire.lua
# counts the same way, and its default batch is MAX_ENVELOPE_WORK); bytes are
# data, metadata and content types together.
MAX_BULK_ENVELOPE_ENTRIES = 1000
METADATA_PER_ENTRY = 4
MAX_ENVELOPE_WORK = 2000
MAX_ENVELOPE_BYTES = 4 << 20

log = logging.getLogger(__name__)

# The key sets of the one table (publish_keys.py), as sets for the lookups.
_DELAY_KEYS = frozenset(DELAY_KEYS)
_TTL_KEYS = frozenset(TTL_KEYS)
# Every key read_request reads: request-level metadata without any of them
# leaves an entry's own request unchanged (see plain_cancel).
_REQUEST_KEYS = frozenset(REQUEST_KEYS)


@dataclass(frozen=True)
class Immediate:
    """One entry to append to its topic now ('' for a single publish, else its bulk entry id)."""

    entry_id: str
    entry: StreamEntry


@dataclass(frozen=True)
class Delayed:
    """One envelope for the engine, and the request's entry ids it carries."""

    entry_ids: tuple[str, ...]
    envelope: env.Envelope


@dataclass(frozen=True)
class Failed:
    """A bulk entry refused while planning, and why: the request's other entries still go."""

    entry_id: str
    error: str


@dataclass(frozen=True)
class Cancel:
    """A scheduleCancel: withdraw the pending message or schedule `schedule_id`.

    `entry_ids` are the request's entries that asked for it (("",) for a
    single publish), so a failed cancel fails exactly those bulk entries.
    """

    entry_ids: tuple[str, ...]
    schedule_id: str


@dataclass(frozen=True)
class PublishPlan:
    """What one Publish or BulkPublish request does, decided before anything touches Redis."""

    immediate: tuple[Immediate, ...] = ()
    delayed: tuple[Delayed, ...] = ()
    failed: tuple[Failed, ...] = ()
    cancels: tuple[Cancel, ...] = field(default=())
    # schedulePause / scheduleIdPrefix (control.py): a request that changes
    # pending state and stores no message.
    control: Control | None = None


def _envelope(
    topic: str,
    timing: Timing,
    ctx: PlanContext,
    *,
    expires_at_ms: int = 0,
    message: bytes = b"",
    content_type: str = "",
    metadata: Mapping[str, str] | None = None,
    bulk_entries: Sequence[env.BulkEntry] = (),
) -> env.Envelope:
    recurring = timing.schedule is not None
    if expires_at_ms and not recurring:
        # A one-shot's CloudEvent says when it expires, as daprd would have
        # written it: a reader that is not us (the built-in pubsub.redis on the
        # fast path) then drops it too. A recurring envelope's TTL ends the
        # schedule instead; its messages carry their own (scheduleTTL).
        message = with_cloudevent_expiration(message, expires_at_ms)
    return env.Envelope(
        # The envelope's stream entry id already identifies it; a generated id
        # would cost ~34 bytes per pending message for nothing.
        id=timing.schedule_id or "",
        topic=topic,
        due_ms=timing.due_ms,
        # For @every, the start of its grid: fires at published_at + k * interval.
        published_at_ms=ctx.now_ms,
        message=message,
        content_type=content_type,
        metadata=dict(metadata or {}),
        pubsub_name=ctx.pubsub_name,
        schedule_id=timing.schedule_id or "",
        bulk_entries=tuple(bulk_entries),
        kind=(Kind.RECURRING if recurring else Kind.ONESHOT).value,
        schedule=timing.schedule.expr if timing.schedule is not None else "",
        expires_at_ms=expires_at_ms,
        schedule_source=timing.source,
        schedule_ttl_ms=timing.schedule_ttl_ms,
        target_pubsub=timing.target_pubsub,
        # Only a plain @every is advanced by the fire script alone; one with a
        # start, bounds or jitter is advanced through the recurrence function.
        every_ms=(timing.schedule.interval_ms or 0)
        if timing.schedule is not None and timing.schedule.plain
        else 0,
        catchup=timing.catchup,
        catchup_window_ms=timing.catchup_window_ms,
    )


def _now(
    entry_id: str, data: bytes, metadata: Mapping[str, str], content_type: str, expires: int
) -> Immediate:
    """A message stored on its topic now, with its TTL (and, in a CloudEvent, its expiration)."""
    if expires:
        data = with_cloudevent_expiration(data, expires)
    return Immediate(entry_id, StreamEntry(data, dict(metadata), content_type, expires))


def _cost(entry: StreamEntry) -> tuple[int, int]:
    """(work, bytes) of one message in a delayed envelope (see MAX_ENVELOPE_WORK)."""
    md = entry.metadata
    size = len(entry.data) + len(entry.content_type) + sum(len(k) + len(v) + 4 for k, v in md.items())
    return 1 + len(md) // METADATA_PER_ENTRY, size


def _too_costly(entry: StreamEntry) -> InvalidArgumentError | None:
    """Why one message cannot wait in the delay engine, or None."""
    work, size = _cost(entry)
    if work > MAX_ENVELOPE_WORK:
        most = MAX_ENVELOPE_WORK * METADATA_PER_ENTRY - 1
        return InvalidArgumentError(
            "metadata",
            f"{len(entry.metadata)} keys",
            f"a delayed message carries at most {most} metadata keys",
        )
    if size > MAX_ENVELOPE_BYTES:
        return InvalidArgumentError(
            "data",
            f"{size} bytes",
            f"a delayed message holds at most {MAX_ENVELOPE_BYTES} bytes of data and metadata (firing a "
            "larger one would block Redis); publish it without a delay, or delay a reference to it",
        )
    return None


# Every metadata key planning reads. A publish whose only one of them is
# scheduledSendDelay or scheduledSendTime takes the fast path (_plain_delay).
_PLANNED_KEYS = ALL_KEYS


@lru_cache(maxsize=256)
def _delay_ms(value: str) -> int:
    """parse_duration_or_seconds, remembered: publishers repeat a handful of delays."""
    return parse_duration_or_seconds(value)


def _plain_delay(
    topic: str, data: bytes, metadata: dict[str, str], content_type: str, ctx: PlanContext
) -> PublishPlan | None:
    """The plan of the commonest delayed publish, a scheduledSendDelay or scheduledSendTime and no
    other key planning reads, in a few lookups; None when anything else (or anything wrong: the
    general path then names it) is there. Gives exactly what the general path gives."""
    if not ctx.enabled or ctx.default_target_pubsub:
        return None
    planned = _PLANNED_KEYS.intersection(metadata)
    if len(planned) != 1:
        return None
    [key] = planned
    value = metadata[key]
    now = ctx.now_ms
    try:
        if key == SCHEDULED_SEND_DELAY:
            delay_ms = _delay_ms(value)
            if delay_ms < 0:
                return None
            due_ms = now + delay_ms
        elif key == SCHEDULED_SEND_TIME:
            due_ms = max(parse_instant(value), now)
        else:
            return None
    except ValueError:
        return None
    if ctx.max_delay_ms is not None and due_ms - now > ctx.max_delay_ms:
        return None
    # _too_costly's bounds, without building an entry to ask it.
    if (
        len(metadata) // METADATA_PER_ENTRY >= MAX_ENVELOPE_WORK
        or len(data) + len(content_type) + sum(len(k) + len(v) + 4 for k, v in metadata.items())
        > MAX_ENVELOPE_BYTES
    ):
        return None
    envelope = env.Envelope(
        id="",
        topic=topic,
        due_ms=due_ms,
        published_at_ms=now,
        message=data,
        content_type=content_type,
        metadata=metadata,
        pubsub_name=ctx.pubsub_name,
    )
    return PublishPlan(delayed=(Delayed(("",), envelope),))


# Keys already judged (ours, the common ones, the rest once each): one lookup each
# (publish_keys.new_near_misses).
_QUIET = SEEN_KEYS.issuperset


def _warn_near_misses(metadata: Mapping[str, str]) -> None:
    """Log a WARNING for each key of `metadata` that looks like a publish key and is not one, once
    per key per process: such a key is ignored, so the message is published without what it asked."""
    for warning in new_near_misses(metadata):
        log.warning("%s", warning)


def plan_publish(
    topic: str, data: bytes, metadata: Mapping[str, str], content_type: str, ctx: PlanContext
) -> PublishPlan:
    """Plan one Publish; raises InvalidArgumentError for a bad topic or bad metadata."""
    check_topic(topic)
    # One copy of the request's metadata (a protobuf map from the servicer:
    # each lookup on it costs more than on a dict), the envelope's own.
    md = {k: metadata[k] for k in metadata}
    if not _QUIET(md):
        _warn_near_misses(md)
    fast = _plain_delay(topic, data, md, content_type, ctx)
    if fast is not None:
        return fast
    return _plan_publish(topic, data, md, content_type, ctx)


def _plan_publish(
    topic: str, data: bytes, metadata: Mapping[str, str], content_type: str, ctx: PlanContext
) -> PublishPlan:
    """plan_publish's general path: every key, every rule."""
    # The plain cancel first, without building a Request: a cancel is planned in a few lookups.
    if (cancel_id := plain_cancel(metadata, ctx)) is not None:
        return PublishPlan(cancels=(Cancel(("",), cancel_id),))
    request = read_publish(metadata, ctx)
    if request.control is not None:
        return PublishPlan(control=request.control)
    if request.cancel is not None:
        return PublishPlan(cancels=(Cancel(("",), request.cancel),))
    if request.timing is None:
        return PublishPlan(immediate=(_now("", data, metadata, content_type, request.expires_at_ms),))
    costly = _too_costly(StreamEntry(data, metadata, content_type))
    if costly is not None:
        raise costly
    envelope = _envelope(
        topic,
        request.timing,
        ctx,
        expires_at_ms=request.expires_at_ms,
        message=data,
        content_type=content_type,
        metadata=metadata,
    )
    return PublishPlan(delayed=(Delayed(("",), envelope),))


def plan_bulk(
    topic: str,
    entries: Sequence[tuple[str, StreamEntry]],
    metadata: Mapping[str, str],
    ctx: PlanContext,
) -> PublishPlan:
    """Plan a BulkPublish of (entry id, entry) pairs.

    The request's metadata applies to every entry; an entry's own keys win.
    Request-level delay metadata delays the whole bulk as envelopes of at most
    MAX_BULK_ENVELOPE_ENTRIES entries, each firing as one batch; an entry with
    delay, schedule or TTL keys of its own becomes an envelope (or a cancel, or
    a message with its own TTL) of its own, and a bad value there fails that
    entry alone. A bad request-level value refuses the request, and so does a
    request-level scheduleCancel (cancel per entry: a bulk of cancels is a bulk
    of entries each with scheduleCancel and scheduleId).
    """
    check_topic(topic)
    if not _QUIET(metadata):
        _warn_near_misses(metadata)
    if is_control(metadata):
        key = next(k for k in CONTROL_KEYS if k in metadata)
        raise InvalidArgumentError(
            key, metadata[key], "not for a bulk publish: send it as a single publish (no body needed)"
        )
    request = read_request(metadata, ctx)
    if request.cancel is not None:
        raise InvalidArgumentError(
            SCHEDULE_CANCEL,
            metadata[SCHEDULE_CANCEL],
            "give scheduleCancel (and scheduleId) per entry of a bulk publish, not for the whole request",
        )
    bulk = _BulkPlan(topic, metadata, request, ctx)
    bulk.add(entries)
    return bulk.plan()


class _BulkPlan:
    """plan_bulk's entries, one by one, into what becomes its PublishPlan."""

    def __init__(self, topic: str, metadata: Mapping[str, str], request: Request, ctx: PlanContext) -> None:
        self.topic = topic
        self.metadata = metadata
        self.request = request
        self.ctx = ctx
        self.failed: list[Failed] = []
        self.now: list[Immediate] = []
        # Entries without delay or TTL keys of their own, under a request-level delay: batch envelopes.
        self.together: list[Immediate] = []
        self.delayed: list[Delayed] = []
        self.cancels: list[Cancel] = []
        self.ids_taken: set[str] = set()
        if request.timing is not None and request.timing.schedule_id:
            self.ids_taken.add(request.timing.schedule_id)
        # Entries that are plain cancels skip the general reading (see plain_cancel)
        # when the request's own metadata cannot change what they ask.
        self.plain = ctx.enabled and _REQUEST_KEYS.isdisjoint(metadata)

    def add(self, entries: Sequence[tuple[str, StreamEntry]]) -> None:
        """Plan each entry: a cancel, a refusal, a message now, a member of a batch, or an envelope of
        its own. The common cases are decided here, in the loop: a bulk may hold 100k entries."""
        plain, ctx, cancels, now = self.plain, self.ctx, self.cancels, self.now
        merge = self._merged if self.metadata else None
        # Neither a request-level delay nor TTL: an entry without keys of its own is stored as it is.
        as_is = self.request.timing is None and not self.request.expires_at_ms
        quiet = _QUIET
        for entry_id, entry in entries:
            own_md = entry.metadata
            if not quiet(own_md):
                _warn_near_misses(own_md)
            if plain and (cancel_id := plain_cancel(own_md, ctx)) is not None:
                cancels.append(Cancel((entry_id,), cancel_id))
            elif is_control(own_md):
                self._refuse_control(entry_id, own_md)
            elif not (_DELAY_KEYS.isdisjoint(own_md) and _TTL_KEYS.isdisjoint(own_md)):
                self._own(entry_id, entry, entry if merge is None else merge(entry))
            elif as_is:
                now.append(Immediate(entry_id, entry if merge is None else merge(entry)))
            else:
                self._inherit(entry_id, entry if merge is None else merge(entry))

    def _refuse_control(self, entry_id: str, own_md: Mapping[str, str]) -> None:
        key = next(k for k in CONTROL_KEYS if k in own_md)
        refused = InvalidArgumentError(
            key, own_md[key], "not in a bulk publish: send it as a single publish (no body needed)"
        )
        self.failed.append(Failed(entry_id, str(refused)))

    def _own(self, entry_id: str, entry: StreamEntry, merged: StreamEntry) -> None:
        """An entry with delay, schedule or TTL keys of its own: read as a request of its own."""
        try:
            own = read_request(merged.metadata, self.ctx)
        except InvalidArgumentError as err:
            self.failed.append(Failed(entry_id, str(err)))
            return
        if own.cancel is not None:
            self.cancels.append(Cancel((entry_id,), own.cancel))
        elif own.timing is None:
            self.now.append(
                _now(entry_id, merged.data, merged.metadata, merged.content_type, own.expires_at_ms)
            )
        else:
            self._own_envelope(entry_id, entry, merged, own, own.timing)

    def _merged(self, entry: StreamEntry) -> StreamEntry:
        """The entry with the request's metadata under its own (its own keys win).

        Called only when the request has metadata: without, the entry itself is used (the common
        case, no metadata anywhere, allocates nothing new).
        """
        inherited: Mapping[str, str] = self.metadata
        if not _TTL_KEYS.isdisjoint(entry.metadata):
            # ttl and ttlInSeconds are one setting: an entry's own replaces the request's.
            inherited = {k: v for k, v in self.metadata.items() if k not in _TTL_KEYS}
        return StreamEntry(
            entry.data, {**inherited, **entry.metadata}, entry.content_type, entry.expires_at_ms
        )

    def _inherit(self, entry_id: str, merged: StreamEntry) -> None:
        """An entry with no delay or TTL keys of its own, under a request-level delay or TTL."""
        if self.request.timing is not None:
            if (costly := _too_costly(merged)) is not None:
                self.failed.append(Failed(entry_id, str(costly)))
                return
            self.together.append(Immediate(entry_id, merged))
        else:
            self.now.append(
                _now(entry_id, merged.data, merged.metadata, merged.content_type, self.request.expires_at_ms)
            )

    def _own_envelope(
        self, entry_id: str, entry: StreamEntry, merged: StreamEntry, own: Request, timing: Timing
    ) -> None:
        # An entry of its own is identified by its own scheduleId only: the
        # request's belongs to the batch envelope, and sharing it would make
        # one envelope silently replace the other.
        own_id = entry.metadata.get(SCHEDULE_ID) or None
        if own_id is not None and own_id in self.ids_taken:
            dup = InvalidArgumentError(SCHEDULE_ID, own_id, "given to two messages of one bulk publish")
            self.failed.append(Failed(entry_id, str(dup)))
            return
        if (costly := _too_costly(merged)) is not None:
            self.failed.append(Failed(entry_id, str(costly)))
            return
        if own_id is not None:
            self.ids_taken.add(own_id)
        envelope = _envelope(
            self.topic,
            timing if timing.schedule_id == own_id else replace(timing, schedule_id=own_id),
            self.ctx,
            expires_at_ms=own.expires_at_ms,
            message=merged.data,
            content_type=merged.content_type,
            metadata=merged.metadata,
        )
        self.delayed.append(Delayed((entry_id,), envelope))

    def plan(self) -> PublishPlan:
        """The plan: the batch envelopes of the request-level delay after the entries' own."""
        timing = self.request.timing
        if self.together and timing is not None:
            self._batches(timing)
        return PublishPlan(
            immediate=tuple(self.now),
            delayed=tuple(self.delayed),
            failed=tuple(self.failed),
            cancels=tuple(self.cancels),
        )

    def _batches(self, timing: Timing) -> None:
        parts = _split(self.together)
        if timing.schedule_id and len(parts) > 1:
            raise InvalidArgumentError(
                SCHEDULE_ID,
                timing.schedule_id,
                f"a delayed bulk publish with one scheduleId holds at most {MAX_BULK_ENVELOPE_ENTRIES} "
                f"entries (fewer with much metadata) and {MAX_ENVELOPE_BYTES} bytes, got {len(self.together)} "
                "entries",
            )
        for part in parts:
            bulk = [
                env.BulkEntry(i.entry_id, i.entry.data, i.entry.content_type, dict(i.entry.metadata))
                for i in part
            ]
            envelope = _envelope(
                self.topic,
                timing,
                self.ctx,
                expires_at_ms=self.request.expires_at_ms,
                metadata=self.metadata,
                bulk_entries=bulk,
            )
            self.delayed.append(Delayed(tuple(i.entry_id for i in part), envelope))


def _split(messages: Sequence[Immediate]) -> list[Sequence[Immediate]]:
    """Consecutive runs of messages, each within one envelope's work and bytes."""
    parts: list[Sequence[Immediate]] = []
    start, work, size = 0, 0, 0
    for i, m in enumerate(messages):
        w, b = _cost(m.entry)
        full = i - start >= MAX_BULK_ENVELOPE_ENTRIES
        if i > start and (full or work + w > MAX_ENVELOPE_WORK or size + b > MAX_ENVELOPE_BYTES):
            parts.append(messages[start:i])
            start, work, size = i, 0, 0
        work, size = work + w, size + b
    if start < len(messages):
        parts.append(messages[start:])
    return parts
