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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from delayed_middleware import envelope as env
from delayed_middleware.delay import DELAY_KEYS, SCHEDULE_ID, Delay, parse_delay
from delayed_middleware.entry import StreamEntry
from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.keys import is_delayed_topic, is_engine_key

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

_DELAY_KEYS = frozenset(DELAY_KEYS)


@dataclass(frozen=True)
class PlanContext:
    """What planning needs to know about the instance and the moment."""

    now_ms: int
    pubsub_name: str
    enabled: bool
    max_delay_ms: int | None = None


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
class PublishPlan:
    immediate: tuple[Immediate, ...] = ()
    delayed: tuple[Delayed, ...] = ()
    failed: tuple[Failed, ...] = ()
    cancels: tuple[str, ...] = field(default=())


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


def _delay(metadata: Mapping[str, str], ctx: PlanContext) -> Delay | None:
    return parse_delay(metadata, now_ms=ctx.now_ms, enabled=ctx.enabled, max_delay_ms=ctx.max_delay_ms)


def _envelope(
    topic: str,
    delay: Delay,
    ctx: PlanContext,
    *,
    message: bytes = b"",
    content_type: str = "",
    metadata: Mapping[str, str] | None = None,
    bulk_entries: Sequence[env.BulkEntry] = (),
) -> env.Envelope:
    return env.Envelope(
        # The envelope's stream entry id already identifies it; a generated id
        # would cost ~34 bytes per pending message for nothing.
        id=delay.schedule_id or "",
        topic=topic,
        due_ms=delay.due_ms,
        published_at_ms=ctx.now_ms,
        message=message,
        content_type=content_type,
        metadata=dict(metadata or {}),
        pubsub_name=ctx.pubsub_name,
        schedule_id=delay.schedule_id or "",
        bulk_entries=tuple(bulk_entries),
    )


def plan_publish(
    topic: str, data: bytes, metadata: Mapping[str, str], content_type: str, ctx: PlanContext
) -> PublishPlan:
    """Plan one Publish; raises InvalidArgumentError for a bad topic or bad metadata."""
    check_topic(topic)
    delay = _delay(metadata, ctx)
    if delay is None:
        return PublishPlan(immediate=(Immediate("", StreamEntry(data, dict(metadata), content_type)),))
    costly = _too_costly(StreamEntry(data, metadata, content_type))
    if costly is not None:
        raise costly
    envelope = _envelope(topic, delay, ctx, message=data, content_type=content_type, metadata=metadata)
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
    MAX_BULK_ENVELOPE_ENTRIES entries (fewer with much metadata, see _cost) and
    MAX_ENVELOPE_BYTES, each firing as one batch; a message too costly to
    fire in one step fails alone (plan_publish refuses it); an entry with
    delay keys of its own becomes an envelope of its own, and a bad value there
    fails that entry alone. A bad request-level value refuses the request.
    """
    check_topic(topic)
    request_delay = _delay(metadata, ctx)
    failed: list[Failed] = []
    now: list[Immediate] = []
    together: list[Immediate] = []
    delayed: list[Delayed] = []
    ids_taken: set[str] = set()
    if request_delay is not None and request_delay.schedule_id:
        ids_taken.add(request_delay.schedule_id)
    for entry_id, entry in entries:
        # The common case, no metadata anywhere, allocates nothing new.
        merged = entry
        if metadata:
            merged = StreamEntry(
                entry.data, {**metadata, **entry.metadata}, entry.content_type, entry.expires_at_ms
            )
        if _DELAY_KEYS.isdisjoint(entry.metadata):
            if request_delay and (costly := _too_costly(merged)) is not None:
                failed.append(Failed(entry_id, str(costly)))
                continue
            (together if request_delay else now).append(Immediate(entry_id, merged))
            continue
        try:
            delay = _delay(merged.metadata, ctx)
        except InvalidArgumentError as err:
            failed.append(Failed(entry_id, str(err)))
            continue
        if delay is None:
            now.append(Immediate(entry_id, merged))
            continue
        if (costly := _too_costly(merged)) is not None:
            failed.append(Failed(entry_id, str(costly)))
            continue
        # An entry of its own is identified by its own scheduleId only: the
        # request's belongs to the batch envelope, and sharing it would make
        # one envelope silently replace the other.
        own_id = entry.metadata.get(SCHEDULE_ID) or None
        if own_id is not None and own_id in ids_taken:
            dup = InvalidArgumentError(SCHEDULE_ID, own_id, "given to two messages of one bulk publish")
            failed.append(Failed(entry_id, str(dup)))
            continue
        if own_id is not None:
            ids_taken.add(own_id)
        envelope = _envelope(
            topic,
            Delay(delay.due_ms, own_id),
            ctx,
            message=merged.data,
            content_type=merged.content_type,
            metadata=merged.metadata,
        )
        delayed.append(Delayed((entry_id,), envelope))
    if together and request_delay is not None:
        parts = _split(together)
        if request_delay.schedule_id and len(parts) > 1:
            raise InvalidArgumentError(
                SCHEDULE_ID,
                request_delay.schedule_id,
                f"a delayed bulk publish with one scheduleId holds at most {MAX_BULK_ENVELOPE_ENTRIES} "
                f"entries (fewer with much metadata) and {MAX_ENVELOPE_BYTES} bytes, got {len(together)} "
                "entries",
            )
        for part in parts:
            bulk = [
                env.BulkEntry(i.entry_id, i.entry.data, i.entry.content_type, dict(i.entry.metadata))
                for i in part
            ]
            envelope = _envelope(topic, request_delay, ctx, metadata=metadata, bulk_entries=bulk)
            delayed.append(Delayed(tuple(i.entry_id for i in part), envelope))
    return PublishPlan(immediate=tuple(now), delayed=tuple(delayed), failed=tuple(failed))


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
