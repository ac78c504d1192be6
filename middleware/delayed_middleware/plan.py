"""Publish planning: one pure step from a publish request to what must happen.

The instance executes a plan; it decides nothing. A plan says which messages
are stored on their topic now (`immediate`), which wait in the delay engine
(`delayed`, as envelopes), which schedules are cancelled (`cancels`), and which
bulk entries were refused and why (`failed`). A request that is wrong as a
whole raises InvalidArgumentError (naming the key and the value) before
anything is stored. Pure: time comes in through the context, so every rule is
testable by a table.

Topic rules (the engine's reserved namespace, keys.py): a topic that is an
engine key (`...-delayed}...`) is refused for publish and subscribe alike; a
delayed topic (`...-delayed`) only the engine writes, whatever the caller's
consumerID, because a plain XADD with trimming (maxLenApprox, streamTTL)
would drop pending envelopes; subscribing to one is allowed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache

from delayed_middleware import envelope as env
from delayed_middleware.control import Control, is_control, read_control
from delayed_middleware.delay import MAX_SCHEDULE_ID_LENGTH, Delay, delay_keys_in, parse_delay
from delayed_middleware.durations import format_go_duration, parse_duration_or_seconds
from delayed_middleware.entry import StreamEntry
from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.instants import parse_instant
from delayed_middleware.keys import is_delayed_topic, is_engine_key
from delayed_middleware.kinds import Kind
from delayed_middleware.publish_keys import (
    ALL_KEYS,
    CONTROL_KEYS,
    DELAY_KEYS,
    NOT_ONE_SHOT_KEYS,
    REQUEST_KEYS,
    SCHEDULE,
    SCHEDULE_CANCEL,
    SCHEDULE_END,
    SCHEDULE_ID,
    SCHEDULE_JITTER,
    SCHEDULE_LIMIT,
    SCHEDULE_ONLY_KEYS,
    SCHEDULE_SOURCE,
    SCHEDULE_START,
    SCHEDULE_TIME_ZONE,
    SCHEDULE_TTL,
    SCHEDULED_SEND_DELAY,
    SCHEDULED_SEND_TIME,
    TTL_KEYS,
    excludes,
)
from delayed_middleware.schedules import Schedule, first_fire, parse_schedule, with_bounds
from delayed_middleware.target import target_pubsub
from delayed_middleware.ttl import parse_schedule_ttl, parse_ttl, with_cloudevent_expiration

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
MAX_TOPIC_LENGTH = 1024

# The key sets of the one table (publish_keys.py), as sets for the lookups.
_DELAY_KEYS = frozenset(DELAY_KEYS)
_TTL_KEYS = frozenset(TTL_KEYS)
# The keys of the schedules contract that parse_delay (one-shot delays) does not read.
_SCHEDULE_KEYS = frozenset(NOT_ONE_SHOT_KEYS)
# Every key read_request reads: request-level metadata without any of them
# leaves an entry's own request unchanged (see plain_cancel).
_REQUEST_KEYS = frozenset(REQUEST_KEYS)


@dataclass(frozen=True)
class PlanContext:
    """What planning needs to know about the instance and the moment."""

    now_ms: int
    pubsub_name: str
    enabled: bool
    max_delay_ms: int | None = None
    default_target_pubsub: str = ""


@dataclass(frozen=True)
class Immediate:
    entry_id: str
    entry: StreamEntry


@dataclass(frozen=True)
class Delayed:
    """One envelope for the engine, and the request's entry ids it carries."""

    entry_ids: tuple[str, ...]
    envelope: env.Envelope


@dataclass(frozen=True)
class Failed:
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
    immediate: tuple[Immediate, ...] = ()
    delayed: tuple[Delayed, ...] = ()
    failed: tuple[Failed, ...] = ()
    cancels: tuple[Cancel, ...] = field(default=())
    # schedulePause / scheduleIdPrefix (control.py): a request that changes
    # pending state and stores no message.
    control: Control | None = None


@dataclass(frozen=True)
class Timing:
    """When (and how often) a message is to be delivered: what one envelope needs.

    Attributes:
        due_ms: the first (or only) due time, epoch ms, never before now.
        schedule_id: the publisher's scheduleId, or None.
        schedule: a recurring schedule (``@every``, cron), else None (one-shot).
        source: scheduleSource: deliver that topic's latest message at each fire.
        schedule_ttl_ms: scheduleTTL: the TTL of each produced message, 0 = none.
        target_pubsub: targetPubsub (or the component's defaultTargetPubsub): the
            Dapr pub/sub the due message is handed to, '' = our own topic.
    """

    due_ms: int
    schedule_id: str | None
    schedule: Schedule | None = None
    source: str = ""
    schedule_ttl_ms: int = 0
    target_pubsub: str = ""


@dataclass(frozen=True)
class Request:
    """What one message's metadata asks for, validated.

    Attributes:
        timing: delay or schedule it (None: deliver now, unless a cancel).
        cancel: the scheduleId to cancel (scheduleCancel=true); nothing is stored then.
        expires_at_ms: its own TTL (ttlInSeconds / ttl) as an instant, 0 = never.
    """

    timing: Timing | None = None
    cancel: str | None = None
    expires_at_ms: int = 0


def read_request(metadata: Mapping[str, str], ctx: PlanContext) -> Request:
    """Read the delay, schedule, cancel, TTL and target keys of one message's metadata.

    ``targetPubsub`` (else the component's ``defaultTargetPubsub``) names the
    Dapr pub/sub a delayed message is handed to when due; without a delay it
    is refused (target.target_pubsub).
    """
    request = _read_timing(metadata, ctx)
    target = target_pubsub(metadata, delayed=request.timing is not None, default=ctx.default_target_pubsub)
    if target is None or request.timing is None:
        return request
    return replace(request, timing=replace(request.timing, target_pubsub=target))


def plain_cancel(metadata: Mapping[str, str], ctx: PlanContext) -> str | None:
    """The scheduleId when `metadata` is exactly a valid ``scheduleCancel: true`` +
    ``scheduleId``, else None (read_request then decides, errors included).

    A bulk of cancels is read at ~100k entries/s: this recognises the plain
    form in a few dictionary lookups. It accepts only what read_request reads
    as ``Request(cancel=<id>)``, so the two never disagree; anything else
    (other keys, a control character or an over-long id, disabled delays)
    takes the general path.
    """
    if len(metadata) != 2 or not ctx.enabled:
        return None
    schedule_id = metadata.get(SCHEDULE_ID)
    cancel = metadata.get(SCHEDULE_CANCEL)
    if not schedule_id or cancel is None or (cancel != "true" and cancel.lower() != "true"):
        return None
    # isprintable() is False for every control character and lone surrogate
    # (the ids _check_schedule_id refuses), and for a few more the general
    # path accepts: those take it.
    if len(schedule_id) > MAX_SCHEDULE_ID_LENGTH or not schedule_id.isprintable():
        return None
    return schedule_id


def _read_timing(metadata: Mapping[str, str], ctx: PlanContext) -> Request:
    """Read the delay, schedule, cancel and TTL keys of one message's metadata.

    Pure, and complete before anything is stored: every bad value raises
    InvalidArgumentError naming its key and value. The rules beyond each key's
    own grammar (delay.py, schedules.py, ttl.py; which key needs or excludes
    which is the table's, publish_keys.py):

    - TTL keys work with or without delayed messaging (plain pub/sub behaviour);
      every other key of DELAY_KEYS needs enableDelayedMessaging.
    - ``scheduleCancel``: ``true`` (or ``false``, = absent), with ``scheduleId``
      and without any timing key: the request cancels, it schedules nothing.
    - One timing per message: ``schedule``, ``scheduledSendTime``,
      ``scheduledSendDelay`` and pubsub.pulsar's ``deliverAt`` / ``deliverAfter``
      exclude each other (the refusal names both keys); an
      ``@at`` schedule is a one-shot (a past instant: at once), the others
      recur. ``maxDelay`` bounds the first fire.
    - ``scheduleSource`` and ``scheduleTTL`` need ``schedule``; the source must
      be a topic one may publish to.
    - ``ttl``/``ttlInSeconds`` on a recurring schedule end the schedule (its
      fires stop then); ``scheduleTTL`` is the TTL of each produced message.
    """
    expires_at_ms = 0 if _TTL_KEYS.isdisjoint(metadata) else parse_ttl(metadata, now_ms=ctx.now_ms) or 0
    if _SCHEDULE_KEYS.isdisjoint(metadata):
        # The common case (a one-shot delay, or nothing): parse_delay alone.
        return Request(timing=_one_shot(_delay(metadata, ctx)), expires_at_ms=expires_at_ms)
    present = delay_keys_in(metadata)
    # parse_delay refuses every delay key while disabled, and empty values, for
    # the schedule keys too: call it on the whole metadata first only for that.
    if not ctx.enabled or any(metadata[key] == "" for key in present):
        _delay(metadata, ctx)
    schedule_id = metadata.get(SCHEDULE_ID) or None
    if _is_cancel(metadata, present, schedule_id, ctx):
        return Request(cancel=schedule_id, expires_at_ms=expires_at_ms)
    delay = _delay({k: v for k, v in metadata.items() if k not in _SCHEDULE_KEYS}, ctx)
    expr = metadata.get(SCHEDULE)
    if expr is None:
        for key in SCHEDULE_ONLY_KEYS:
            if (value := metadata.get(key)) is not None:
                raise InvalidArgumentError(key, value, "only applies to a schedule: give schedule too")
        return Request(timing=_one_shot(delay), expires_at_ms=expires_at_ms)
    for key in excludes(SCHEDULE):
        if key in present:
            raise InvalidArgumentError(
                key, metadata[key], f"given together with schedule={expr!r}: give one of them, not both"
            )
    return Request(timing=_schedule_timing(metadata, expr, schedule_id, ctx), expires_at_ms=expires_at_ms)


def _one_shot(delay: Delay | None) -> Timing | None:
    return None if delay is None else Timing(delay.due_ms, delay.schedule_id)


def _is_cancel(
    metadata: Mapping[str, str], present: list[str], schedule_id: str | None, ctx: PlanContext
) -> bool:
    """True when `metadata` is a valid cancel (scheduleCancel=true); refuses a bad one.

    ``scheduleCancel: false`` is the key left out: False.
    """
    cancel = metadata.get(SCHEDULE_CANCEL)
    if cancel is None:
        return False
    if cancel.lower() not in ("true", "false"):
        raise InvalidArgumentError(SCHEDULE_CANCEL, cancel, 'must be "true" (or "false")')
    if cancel.lower() == "false":
        return False
    if schedule_id is None:
        raise InvalidArgumentError(
            SCHEDULE_CANCEL, cancel, "needs scheduleId: the id of the message or schedule to cancel"
        )
    # Validates the id (length, control characters).
    _delay({SCHEDULE_ID: schedule_id}, ctx)
    for key in excludes(SCHEDULE_CANCEL):
        if key in present:
            raise InvalidArgumentError(
                key, metadata[key], "a cancel (scheduleCancel=true) schedules nothing: leave it out"
            )
    return True


def _schedule_timing(
    metadata: Mapping[str, str], expr: str, schedule_id: str | None, ctx: PlanContext
) -> Timing:
    """The Timing of a ``schedule`` (its zone, bounds, jitter, source and scheduleTTL read too)."""
    schedule = parse_schedule(expr, now_ms=ctx.now_ms, time_zone=metadata.get(SCHEDULE_TIME_ZONE))
    schedule = with_bounds(
        schedule,
        now_ms=ctx.now_ms,
        key=schedule_id or "",
        seed=_seed(metadata, ctx) if schedule_id is None and SCHEDULE_JITTER in metadata else "",
        start=metadata.get(SCHEDULE_START),
        end=metadata.get(SCHEDULE_END),
        limit=metadata.get(SCHEDULE_LIMIT),
        jitter=metadata.get(SCHEDULE_JITTER),
    )
    due_ms = first_fire(schedule, now_ms=ctx.now_ms, key=schedule_id or "")
    if due_ms is None:
        raise InvalidArgumentError(SCHEDULE, expr, "never fires")
    if ctx.max_delay_ms is not None and due_ms - ctx.now_ms > ctx.max_delay_ms:
        raise InvalidArgumentError(
            SCHEDULE,
            expr,
            f"first fires {format_go_duration(due_ms - ctx.now_ms)} from now, "
            f"more than the maximum delay of {format_go_duration(ctx.max_delay_ms)}",
        )
    source = metadata.get(SCHEDULE_SOURCE)
    if source is not None:
        try:
            check_topic(source)
        except InvalidArgumentError as err:
            raise InvalidArgumentError(SCHEDULE_SOURCE, source, err.reason) from None
    schedule_ttl = metadata.get(SCHEDULE_TTL)
    return Timing(
        due_ms,
        schedule_id,
        schedule=schedule if schedule.recurring else None,
        source=source or "",
        schedule_ttl_ms=0 if schedule_ttl is None else parse_schedule_ttl(schedule_ttl) or 0,
    )


def _seed(metadata: Mapping[str, str], ctx: PlanContext) -> str:
    """What a jittered schedule without a scheduleId hashes its offsets by.

    Derived from the request (its metadata and acceptance time), so planning
    stays pure; stored with the schedule, so every replica agrees on it. Two
    such schedules published with the same metadata in the same millisecond
    share their offsets: give them scheduleIds to spread them.
    """
    text = "\0".join(f"{k}={v}" for k, v in sorted(metadata.items()))
    return hashlib.blake2b(f"{ctx.now_ms}\0{text}".encode(), digest_size=6).hexdigest()


def check_topic(topic: str, *, subscribe: bool = False) -> None:
    """Refuse topics that are not the user's to write (or, for engine keys, to read)."""
    if not topic:
        raise InvalidArgumentError("topic", topic, "must not be empty")
    if len(topic) > MAX_TOPIC_LENGTH:
        raise InvalidArgumentError("topic", topic, f"longer than {MAX_TOPIC_LENGTH} characters")
    if is_engine_key(topic):
        raise InvalidArgumentError("topic", topic, "reserved: a key of the delay engine, not a topic")
    if not subscribe and is_delayed_topic(topic):
        raise InvalidArgumentError(
            "topic",
            topic,
            "reserved for pending delayed messages (topics ending in -delayed are written by the delay "
            "engine only); publish with a delay instead, or subscribe to read it",
        )


def _delay(metadata: Mapping[str, str], ctx: PlanContext) -> Delay | None:
    return parse_delay(metadata, now_ms=ctx.now_ms, enabled=ctx.enabled, max_delay_ms=ctx.max_delay_ms)


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


def plan_publish(
    topic: str, data: bytes, metadata: Mapping[str, str], content_type: str, ctx: PlanContext
) -> PublishPlan:
    """Plan one Publish; raises InvalidArgumentError for a bad topic or bad metadata."""
    check_topic(topic)
    # One copy of the request's metadata (a protobuf map from the servicer:
    # each lookup on it costs more than on a dict), the envelope's own.
    md = {k: metadata[k] for k in metadata}
    fast = _plain_delay(topic, data, md, content_type, ctx)
    if fast is not None:
        return fast
    return _plan_publish(topic, data, md, content_type, ctx)


def _plan_publish(
    topic: str, data: bytes, metadata: Mapping[str, str], content_type: str, ctx: PlanContext
) -> PublishPlan:
    """plan_publish's general path: every key, every rule."""
    if (cancel_id := plain_cancel(metadata, ctx)) is not None:
        return PublishPlan(cancels=(Cancel(("",), cancel_id),))
    if (control := read_control(metadata, enabled=ctx.enabled)) is not None:
        return PublishPlan(control=control)
    request = read_request(metadata, ctx)
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
    for entry_id, entry in entries:
        bulk.add(entry_id, entry)
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

    def add(self, entry_id: str, entry: StreamEntry) -> None:
        """Plan one entry: a cancel, a refusal, a message now, a member of a batch, or an envelope of its own."""
        own_md = entry.metadata
        if self.plain and (cancel_id := plain_cancel(own_md, self.ctx)) is not None:
            self.cancels.append(Cancel((entry_id,), cancel_id))
            return
        if is_control(own_md):
            key = next(k for k in CONTROL_KEYS if k in own_md)
            refused = InvalidArgumentError(
                key, own_md[key], "not in a bulk publish: send it as a single publish (no body needed)"
            )
            self.failed.append(Failed(entry_id, str(refused)))
            return
        merged = self._merged(entry)
        if _DELAY_KEYS.isdisjoint(own_md) and _TTL_KEYS.isdisjoint(own_md):
            self._inherit(entry_id, merged)
            return
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
        """The entry with the request's metadata under its own (its own keys win)."""
        if not self.metadata:
            # The common case, no metadata anywhere, allocates nothing new.
            return entry
        inherited: Mapping[str, str] = self.metadata
        if not _TTL_KEYS.isdisjoint(entry.metadata):
            # ttl and ttlInSeconds are one setting: an entry's own replaces the request's.
            inherited = {k: v for k, v in self.metadata.items() if k not in _TTL_KEYS}
        return StreamEntry(
            entry.data, {**inherited, **entry.metadata}, entry.content_type, entry.expires_at_ms
        )

    def _inherit(self, entry_id: str, merged: StreamEntry) -> None:
        """An entry with no delay or TTL keys of its own: as the request says."""
        if self.request.timing is not None:
            if (costly := _too_costly(merged)) is not None:
                self.failed.append(Failed(entry_id, str(costly)))
                return
            self.together.append(Immediate(entry_id, merged))
        elif self.request.expires_at_ms:
            self.now.append(
                _now(entry_id, merged.data, merged.metadata, merged.content_type, self.request.expires_at_ms)
            )
        else:
            self.now.append(Immediate(entry_id, merged))

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
