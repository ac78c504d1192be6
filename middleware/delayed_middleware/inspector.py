"""Read-only inspection of one app's delayed messages: what waits, one message, its history, dead letters.

Shards (Redis Cluster, `delayShards`): an app's delayed topic may be split
into several shard streams (keys.shard_topics), each with its own index, ids
hash, parked hash and history. An Inspector made with `shards=N` reads all of
them: listings and counts cover every shard (merged in due order), a lookup by
scheduleId goes to the shard the id hashes to, and an envelope id is named
`<stream id>@<shard>` (as ShardedEngine.schedule returns it and
ShardedEngine.cancel takes it), since each shard stream numbers its entries on
its own. With one shard (a single node) nothing changes: plain stream ids.

What arq's `jobs.Job` is to arq, for operators: the CLI (`delayed-pubsub
pending|inspect|history|dead`), the metrics' pending-per-topic gauge and the
Spark job read the engine's state through here instead of its key layout.
Nothing here writes.

Cost: listing walks the delayed topic with XRANGE in pages (never KEYS, never
the whole stream in one reply), decoding each envelope and looking its due
time up in the ids hash with one pipelined HMGET per page. Roughly O(pending)
with a small constant; callers that run often bound it (`max_entries`).
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from google.protobuf.message import DecodeError
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError

from delayed_middleware.aio import text
from delayed_middleware.deadletters import (
    DL_AT,
    DL_ATTEMPTS,
    DL_CONSUMER,
    DL_PUBSUB,
    DL_REASON,
    DL_SOURCE_TOPIC,
    dead_letter_topics_key,
)
from delayed_middleware.entry import StreamEntry, decode_entry
from delayed_middleware.envelope import Envelope, EnvelopeDecodeError, decode_envelope
from delayed_middleware.errors import InvalidArgumentError, MalformedEntryError
from delayed_middleware.history import HistoryRecord, decode_record
from delayed_middleware.keys import (
    EngineKeys,
    is_stream_id,
    shard_id,
    shard_index,
    shard_topics,
    split_shard_id,
)
from delayed_middleware.kinds import Kind
from delayed_middleware.outbox import OUTBOX_GROUP, HandOffPolicy, OutboxEntry, decode_outbox_entry
from delayed_middleware.pausing import paused_at_ms
from delayed_middleware.retry import retry_key, retry_topics_key
from delayed_middleware.scripts import HIST_WALK
from delayed_pubsub_pb.delayedpubsub.v1 import delayed_pb2

PAGE_SIZE = 500
# A node's client or a Cluster's: the inspector reads every shard through either.
AnyRedis = aioredis.Redis | RedisCluster
# The kind of a fired message waiting in the outbox for its hand-off to a targetPubsub.
HANDOFF = "handoff"
# inspect shows at most this many of a message's newest records.
INSPECT_HISTORY = 50
# How far around an envelope's own stream id its scheduling records are looked for (ms):
# written by the same script, they are within that script's run (a script keeps to ~20 ms) of it.
HISTORY_SLACK_MS = 250
# history_forward of one scheduleId collects at most this many of a shard's records from the
# by-id index before it shows them oldest first; an id with more is read by a scan (it is dense).
INDEXED_FORWARD_MAX = 20_000
# Up to this many parked envelopes are loaded once per count instead of looked up per page.
_PARKED_IN_MEMORY = 10_000
DELIVERY_ATTEMPT = "deliveryAttempt"

# (entries scanned so far, entries on the stream when the scan began)
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class PendingMessage:
    """One delayed message waiting for its due time."""

    stream_id: str
    schedule_id: str
    topic: str
    due_ms: int
    kind: str
    size: int
    attempts: int
    published_at_ms: int
    # The shard stream holding it when the delayed topic has several (keys.shard_topics), else None.
    shard: int | None = None
    # A hand-off (kind "handoff"): the Dapr pub/sub it waits to be handed to.
    pubsub: str = ""
    # A recurring one's stored schedule expression (with its zone, bounds and jitter).
    schedule: str = ""
    # Paused (schedulePause): when, epoch ms; None while it runs.
    paused_at_ms: int | None = None

    @property
    def paused(self) -> bool:
        """True while held by schedulePause: it does not fire until resumed."""
        return self.paused_at_ms is not None

    @property
    def id(self) -> str:
        """How operators name it: the scheduleId when one was given, else the envelope id
        (`<stream id>@<shard>` when the delayed topic has several shards)."""
        if self.schedule_id:
            return self.schedule_id
        return self.stream_id if self.shard is None else shard_id(self.stream_id, self.shard)


@dataclass(frozen=True)
class PendingReport:
    """A listing: the earliest `limit` matches by due time, and counts over every match."""

    messages: tuple[PendingMessage, ...]
    counts: Mapping[str, int]
    matched: int
    scanned: int
    parked: int
    undecodable: int


def _matches(m: PendingMessage, topic: str | None, due_before_ms: int | None) -> bool:
    # The listings' one filter: on `topic` (None: any) and due before `due_before_ms` (None: any time).
    return (topic is None or m.topic == topic) and (due_before_ms is None or m.due_ms < due_before_ms)


@dataclass(frozen=True)
class MessageInfo:
    """One envelope decoded, with its state and its history."""

    message: PendingMessage
    envelope: Envelope
    # pending | paused (schedulePause) | parked | retry (a failed message waiting for its next delivery)
    # | handoff (fired, waiting in the outbox for the sidecar to accept it)
    state: str
    parked_reason: str = ""
    history: tuple[HistoryRecord, ...] = ()

    def preview(self, limit: int = 256) -> str:
        """The payload as text when it is UTF-8, else as hex; cut at `limit` bytes."""
        if self.envelope.is_bulk:
            first = self.envelope.bulk_entries[0].event if self.envelope.bulk_entries else b""
            return f"[bulk of {len(self.envelope.bulk_entries)}] " + payload_preview(first, limit)
        return payload_preview(self.envelope.message, limit)


@dataclass(frozen=True)
class DeadLetterInfo:
    """A message that used up its delivery attempts, as it sits on a dead-letter topic."""

    dead_letter_topic: str
    stream_id: str
    source_topic: str
    reason: str
    attempts: int
    at_ms: int
    entry: StreamEntry = field(repr=False)
    # A hand-off's dead letter: the targetPubsub it was bound for ('' for a subscriber's).
    target_pubsub: str = ""

    @property
    def size(self) -> int:
        return len(self.entry.data)


def payload_preview(data: bytes, limit: int = 256) -> str:
    """Printable view of a payload's first `limit` bytes."""
    head = data[:limit]
    suffix = f"… ({len(data)} bytes)" if len(data) > limit else ""
    try:
        return head.decode("utf-8") + suffix
    except UnicodeDecodeError:
        return "0x" + head.hex() + suffix


def _s(value: bytes | str | None) -> str:
    # An operator's listing shows undecodable bytes replaced rather than failing.
    return text(value, errors="replace")


def _public_id(raw_id: Any, fields: Any) -> Any:
    """An entry's envelope id: its stream id, or for a copy compaction made (lua/compact.lua)
    the id it was first stored at (field `origin`), in the type the entry id came in."""
    origin = fields.get(b"origin", fields.get("origin"))
    if origin is None:
        return raw_id
    return origin if isinstance(raw_id, bytes) == isinstance(origin, bytes) else _s(origin)


def _stream_id(value: bytes | str) -> tuple[int, int]:
    ms, _, seq = _s(value).partition("-")
    return int(ms), int(seq or 0)


class _Walk:
    """A forward walk over one delayed stream, page by page, that knows which compaction
    copies (lua/compact.lua) hold an envelope it already met.

    A pass running meanwhile moves envelopes to the stream's tail, ahead of the walk: one
    met at its old place would be met again at the tail. A copy names the entry it was
    copied from (field `from`); the walk met the envelope there if a page covered that
    place while the entry was still there, that is, before the copy existed: the copy's
    id is above the stream's last id when that page was read. Keeps one (page end, last
    id) pair per page, nothing per message. (An envelope moved twice while the walk goes
    on is judged by its last move only.)"""

    # A page and the stream's last id, read at one moment (one script: atomic on a
    # single node and on Cluster, where a MULTI pipeline is not usable here).
    _PAGE = """
local rows = redis.call('XRANGE', KEYS[1], ARGV[1], '+', 'COUNT', ARGV[2])
local top = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
return {rows, top}
"""

    def __init__(self, redis: AnyRedis, keys: EngineKeys, count: int, after: str | None = None) -> None:
        self._redis = redis
        self._script = redis.register_script(self._PAGE)
        self._stream = keys.stream
        self._moved = keys.moved
        self._count = count
        # `after`: a stream position (a raw entry id) the walk resumes after.
        self._start: Any = "-" if after is None else "(" + after
        self._ends: list[tuple[int, int]] = []
        self._tops: list[tuple[int, int]] = []
        self.done = False

    async def page(self, count: int | None = None) -> Any:
        """The next page (empty at the end), read with the stream's last id in one transaction."""
        count = self._count if count is None else count
        raw, top = await self._script(keys=[self._stream], args=[self._start, count])
        rows = [(i, dict(zip(f[::2], f[1::2], strict=True))) for i, f in raw]
        if not rows:
            self.done = True
            return rows
        last = rows[-1][0]
        self._start = b"(" + last if isinstance(last, bytes) else "(" + last
        self._ends.append(_stream_id(last))
        self._tops.append(_stream_id(top[0][0]))
        self.done = len(rows) < count
        return rows

    async def named(self, rows: Any) -> list[tuple[Any, Any]]:
        """The page's entries this walk did not meet before, each under its envelope's id:
        a copy's `origin` only where the moved hash points at that copy (anyone can write an
        `origin` field; compact.lua trusts it the same way), else the entry's own id."""
        rows = [(i, f) for i, f in rows if not self.met_before(i, f)]
        claimed = [(n, f.get(b"origin", f.get("origin"))) for n, (_, f) in enumerate(rows)]
        claimed = [(n, o) for n, o in claimed if o is not None]
        named = list(rows)
        if claimed:
            at = await self._redis.hmget(self._moved, [o for _, o in claimed])
            for (n, origin), stored in zip(claimed, at, strict=True):
                if stored is not None and _s(stored) == _s(rows[n][0]):
                    raw_id = rows[n][0]
                    # In the type the entry id came in (bytes or str, by the client's decoding).
                    public = origin if isinstance(raw_id, bytes) == isinstance(origin, bytes) else _s(origin)
                    named[n] = (public, rows[n][1])
        return named

    def met_before(self, entry_id: Any, fields: Any) -> bool:
        """True for a copy whose envelope this walk already met where it was copied from."""
        source = fields.get(b"from", fields.get("from"))
        if source is None:
            return False
        try:
            at = _stream_id(source)
            here = _stream_id(entry_id)
        except ValueError:
            return False  # not ours (written by hand): shown as it is
        k = bisect.bisect_left(self._ends, at)
        return k < len(self._ends) and self._tops[k] < here


def _payload_size(env: Envelope) -> int:
    if env.is_bulk:
        return sum(len(e.event) for e in env.bulk_entries)
    return len(env.message)


def _ref(value: bytes | str | None) -> tuple[str, int | None, str]:
    """An ids-hash value: "<stream id> <due ms> <next ms> <next RFC3339> <flag>" ('-' = none)."""
    parts = _s(value).split()
    due = int(parts[1]) if len(parts) > 1 and parts[1].lstrip("-").isdigit() else None
    nxt = parts[2] if len(parts) > 2 and parts[2] != "-" else ""
    return parts[0] if parts else "", due, nxt


async def _each(iterators: tuple[AsyncIterator[PendingMessage], ...]) -> AsyncIterator[PendingMessage]:
    for it in iterators:
        async for m in it:
            yield m


def _left(budget: int | None, used: int) -> int | None:
    # What is left of a row budget (None: no bound).
    return None if budget is None else budget - used


def _retry_message(topic: str, entry_id: str, due: float, entry: StreamEntry, pel: Any) -> PendingMessage:
    """A failed message waiting for its next delivery, kind "retry", as _read_retry read it:
    its id the entry's id on `topic`, `due` the earliest redelivery, `attempts` the
    deliveries so far (the consumer group's PEL count)."""
    return PendingMessage(
        stream_id=entry_id,
        schedule_id="",
        topic=topic,
        due_ms=int(due),
        kind=Kind.RETRY.label,
        size=len(entry.data),
        attempts=int(pel[0]["times_delivered"]) if pel else 0,
        published_at_ms=int(entry_id.split("-")[0]) if is_stream_id(entry_id) else 0,
    )


def _raw_size(msg: Any) -> int:
    """Payload bytes of a raw DelayedMessage (all entries of a bulk one)."""
    if not msg.bulkPublish:
        return len(msg.message)
    bulk = delayed_pb2.DelayedBulk.FromString(msg.message)
    return sum(len(e.event) for e in bulk.entries)


def _pending(
    stream_id: str,
    ref: bytes | str | None,
    *,
    schedule_id: str,
    topic: str,
    due_ms: int,
    size: int,
    attempts: str,
    published_at_ms: int,
    recurring: bool = False,
    shard: int | None = None,
    schedule: str = "",
) -> PendingMessage:
    # The envelope says whether it recurs (DelayedMessage.kind); a hand-edited
    # or older ids entry with a next occurrence says so too.
    due, kind = due_ms, (Kind.RECURRING if recurring else Kind.ONESHOT).label
    paused_at = None
    if ref is not None:
        ref_id, ref_due, ref_next = _ref(ref)
        # A recurring envelope's current occurrence lives in the ids hash.
        if ref_id == stream_id and ref_due is not None:
            due = ref_due
        if ref_id == stream_id and ref_next:
            kind = Kind.RECURRING.label
        if ref_id == stream_id:
            paused_at = paused_at_ms(text(ref))
    return PendingMessage(
        stream_id=stream_id,
        schedule_id=schedule_id,
        topic=topic,
        due_ms=due,
        kind=kind,
        size=size,
        attempts=int(attempts) if attempts.isdigit() else 0,
        published_at_ms=published_at_ms,
        shard=shard,
        paused_at_ms=paused_at,
        schedule=schedule,
    )


@dataclass(frozen=True, order=True)
class HistoryPosition:
    """Where a record sits in an app's history, every shard merged: (stream id, shard).

    A history stream id is `<ms>-<seq>`, its ms the Redis server's time of
    the write, so positions are ordered in time. The text form (`text`) is
    the cursor an operator pages with: `<ms>-<seq>`, `<ms>-<seq>@<shard>`
    when the delayed topic has several shards."""

    ms: int
    seq: int
    shard: int = 0

    @classmethod
    def of(cls, stream_id: str, shard: int = 0) -> HistoryPosition:
        ms, _, seq = stream_id.partition("-")
        return cls(int(ms), int(seq or 0), shard)

    @classmethod
    def parse(cls, text: str, shards: int) -> HistoryPosition | None:
        """A cursor as `text` writes it (a bare stream id means shard 0); None if it is not one."""
        named = split_shard_id(text, shards)
        if named is not None:
            return cls.of(named[1], named[0])
        if is_stream_id(text):
            return cls.of(text)
        return None

    def text(self, shards: int) -> str:
        local = f"{self.ms}-{self.seq}"
        return shard_id(local, self.shard) if shards > 1 else local


def _start_key(start: str) -> tuple[int, int, int]:
    """An XRANGE start ("-", "<ms>-<seq>", "(<ms>-<seq>") in stream order."""
    if start == "-":
        return (-1, 0, 0)
    exclusive = start.startswith("(")
    position = HistoryPosition.of(start.lstrip("("))
    return (position.ms, position.seq, int(exclusive))


def _exclusive_low(start: str) -> str:
    """An XRANGE start ("-", "<ms>-<seq>", "(<ms>-<seq>") as the entry id the records must
    follow ('' = none): hist_walk.lua's lower bound."""
    if start == "-":
        return ""
    if start.startswith("("):
        return start[1:]
    position = HistoryPosition.of(start)
    if position.seq:
        return f"{position.ms}-{position.seq - 1}"
    return f"{position.ms - 1}-{2**64 - 1}" if position.ms else ""


async def _merge(
    sources: list[AsyncGenerator[tuple[HistoryPosition, HistoryRecord]]], *, reverse: bool
) -> AsyncGenerator[tuple[HistoryPosition, HistoryRecord]]:
    """Merge sorted record streams by position (descending when `reverse`), one item per source held."""
    if len(sources) == 1:
        # One shard: nothing to merge.
        async for item in sources[0]:
            yield item
        return
    heap: list[tuple[tuple[int, int, int], int, tuple[HistoryPosition, HistoryRecord]]] = []
    sign = -1 if reverse else 1

    async def push(i: int) -> None:
        item = await anext(sources[i], None)
        if item is not None:
            p = item[0]
            heapq.heappush(heap, ((sign * p.ms, sign * p.seq, sign * p.shard), i, item))

    for i in range(len(sources)):
        await push(i)
    while heap:
        _, i, item = heapq.heappop(heap)
        yield item
        await push(i)


class Inspector:
    """Reads one app's (consumerID's) delayed topic (every shard of it), history and dead letters."""

    def __init__(
        self, client: AnyRedis, consumer_id: str, page_size: int = PAGE_SIZE, *, shards: int = 1
    ) -> None:
        self._redis = client
        self.consumer_id = consumer_id
        # Every shard's keys, shard 0 (the single-node `<consumerID>-delayed`) first.
        self.shards = tuple(EngineKeys.for_topic(t) for t in shard_topics(consumer_id, shards))
        self.keys = self.shards[0]
        self._page = page_size

    def _label(self, shard: int) -> int | None:
        # Ids carry their shard only when there is more than one (single node unchanged).
        return None if len(self.shards) == 1 else shard

    def stream_of(self, message: PendingMessage) -> str:
        """The delayed topic (shard stream) that holds `message`'s envelope, or the outbox of a hand-off."""
        keys = self.shards[message.shard or 0]
        return keys.outbox if message.kind == HANDOFF else keys.stream

    async def stream_length(self) -> int:
        """Entries on the delayed topic, every shard (pending and parked envelopes)."""
        return sum([int(await self._redis.xlen(k.stream)) for k in self.shards])

    async def scan(
        self,
        *,
        max_entries: int | None = None,
        progress: Progress | None = None,
        stats: Counter[str] | None = None,
    ) -> AsyncIterator[PendingMessage]:
        """Every pending message (shard by shard, in stream order); parked and undecodable
        ones skipped (counted in `stats` under "parked" / "undecodable" / "scanned")."""
        total = await self.stream_length() if progress is not None else 0
        scanned = 0
        for shard, keys in enumerate(self.shards):
            walk = _Walk(self._redis, keys, self._page)
            async for rows in self._walk_pages(walk, _left(max_entries, scanned)):
                scanned += len(rows)
                for message in await self._decode_page(shard, await walk.named(rows), stats):
                    yield message
                if stats is not None:
                    stats["scanned"] += len(rows)
                if progress is not None:
                    progress(scanned, max(total, scanned))

    async def _walk_pages(self, walk: _Walk, budget: int | None) -> AsyncIterator[Any]:
        """`walk`'s pages of raw rows, to the stream's end or until `budget` rows are read
        (None: no bound). Afterwards `walk.done` says whether the end was seen: a budget
        that ran out exactly at the end leaves it False."""
        read = 0
        while budget is None or read < budget:
            rows: Any = await walk.page(self._page if budget is None else min(self._page, budget - read))
            if not rows:
                return
            read += len(rows)
            yield rows
            if walk.done:
                return

    async def _pages(self, stream: str) -> AsyncIterator[Any]:
        """`stream`'s entries, oldest first, a page (at most PAGE_SIZE rows) at a time."""
        start = "-"
        while True:
            rows: Any = await self._redis.xrange(stream, start, "+", count=self._page)
            if not rows:
                return
            yield rows
            if len(rows) < self._page:
                return
            start = "(" + _s(rows[-1][0])

    async def listing(
        self,
        *,
        prefix: str = "",
        after: str | None = None,
        topic: str | None = None,
        due_before_ms: int | None = None,
    ) -> AsyncGenerator[tuple[str, PendingMessage]]:
        """Pending messages on the delayed topic in stream order (shard by shard), each with its cursor.

        Paging for listings too long to hold: nothing is kept beyond one page
        of PAGE_SIZE entries, so memory stays flat however many are pending.
        `after` is a cursor this gave (`<stream id>`, `<stream id>@<shard>` with
        several shards): the listing resumes right after it. `prefix` keeps the
        messages whose scheduleId (a recurring envelope without one: its
        envelope id) starts with it, the ids a prefix cancel matches. Parked and
        undecodable envelopes are left out; retries and hand-offs are not on
        the delayed topic and are not listed here (`pending` without paging
        shows them). A compaction pass running between two pages may list an
        envelope it moved again on a later page.
        """
        first_shard, start = 0, None
        if after is not None:
            named = split_shard_id(after, len(self.shards))
            if named is not None:
                first_shard, start = named
            elif is_stream_id(after):
                start = after
            else:
                raise InvalidArgumentError("--after", after, "not a cursor of this listing")
        for shard in range(first_shard, len(self.shards)):
            walk = _Walk(self._redis, self.shards[shard], self._page, start if shard == first_shard else None)
            while True:
                rows: Any = await walk.page()
                if not rows:
                    break
                kept = [(i, f) for i, f in rows if not walk.met_before(i, f)]
                named_rows = await walk.named(rows)
                raw_of = {_s(public): _s(raw) for (raw, _), (public, _) in zip(kept, named_rows, strict=True)}
                for m in await self._decode_page(shard, named_rows, None):
                    own = m.schedule_id or (m.stream_id if m.kind == Kind.RECURRING.label else "")
                    if prefix and not own.startswith(prefix):
                        continue
                    if not _matches(m, topic, due_before_ms):
                        continue
                    raw = raw_of.get(m.stream_id, m.stream_id)
                    yield (raw if len(self.shards) == 1 else f"{raw}@{shard}"), m
                if walk.done:
                    break

    async def _decode_page(self, shard: int, rows: Any, stats: Counter[str] | None) -> list[PendingMessage]:
        # `rows` are named by their envelopes' ids already (_Walk.named).
        # The listing needs a few fields, not a whole Envelope (metadata and
        # payload copied): the raw protobuf is read directly, ~4x cheaper.
        keys = self.shards[shard]
        decoded: list[tuple[str, Any, int]] = []
        for raw_id, fields in rows:
            try:
                msg = delayed_pb2.DelayedMessage.FromString(fields.get(b"data", fields.get("data")) or b"")
                size = _raw_size(msg)
            except DecodeError:
                msg = None
            if msg is None or not msg.topic:
                if stats is not None:
                    stats["undecodable"] += 1
                continue
            decoded.append((_s(raw_id), msg, size))
        if not decoded:
            return []
        pipe = self._redis.pipeline(transaction=False)
        pipe.hmget(keys.ids, [msg.scheduleId or sid for sid, msg, _ in decoded])
        pipe.hmget(keys.parked, [sid for sid, _, _ in decoded])
        refs, parked = await pipe.execute()
        out: list[PendingMessage] = []
        for (sid, msg, size), ref, park in zip(decoded, refs, parked, strict=True):
            if park is not None:
                if stats is not None:
                    stats["parked"] += 1
                continue
            attempts = msg.metadata.get(DELIVERY_ATTEMPT, "0")
            out.append(
                _pending(
                    sid,
                    ref,
                    schedule_id=msg.scheduleId,
                    topic=msg.topic,
                    due_ms=msg.dueTimeMs,
                    size=size,
                    attempts=attempts,
                    published_at_ms=msg.publishedAtMs,
                    recurring=msg.kind == Kind.RECURRING,
                    shard=self._label(shard),
                    schedule=msg.schedule,
                )
            )
        return out

    def _message(self, shard: int, stream_id: str, env: Envelope, ref: bytes | str | None) -> PendingMessage:
        return _pending(
            stream_id,
            ref,
            schedule_id=env.schedule_id,
            topic=env.topic,
            due_ms=env.due_ms,
            size=_payload_size(env),
            attempts=env.metadata.get(DELIVERY_ATTEMPT, "0"),
            published_at_ms=env.published_at_ms,
            recurring=env.is_recurring,
            shard=self._label(shard),
            schedule=env.schedule,
        )

    async def pending(
        self,
        *,
        topic: str | None = None,
        due_before_ms: int | None = None,
        limit: int | None = None,
        progress: Progress | None = None,
    ) -> PendingReport:
        """The `limit` earliest-due pending messages (all when None) and counts per topic of every match."""
        stats: Counter[str] = Counter()
        counts: Counter[str] = Counter()
        tie = itertools.count()
        # A max-heap (negated) of the `limit` earliest: memory bounded by limit.
        heap: list[tuple[int, int, PendingMessage]] = []
        kept: list[PendingMessage] = []
        waiting = (
            self.scan(progress=progress, stats=stats),
            # Bounded where it is read (a retry schedule is a sorted set by due time, one per
            # topic); the filter below is the one rule for all three.
            self.retries(topic=topic, due_before_ms=due_before_ms),
            self.handoffs(),
        )
        async for m in _each(waiting):
            if not _matches(m, topic, due_before_ms):
                continue
            counts[m.topic] += 1
            if limit is None:
                kept.append(m)
            elif limit > 0:
                item = (-m.due_ms, -next(tie), m)
                if len(heap) < limit:
                    heapq.heappush(heap, item)
                else:
                    heapq.heappushpop(heap, item)
        if limit is not None:
            kept = [m for _, _, m in heap]
        kept.sort(key=lambda m: (m.due_ms, m.stream_id))
        return PendingReport(
            messages=tuple(kept),
            counts=dict(counts),
            matched=sum(counts.values()),
            scanned=stats["scanned"],
            parked=stats["parked"],
            undecodable=stats["undecodable"],
        )

    async def retries(
        self, *, topic: str | None = None, due_before_ms: int | None = None
    ) -> AsyncIterator[PendingMessage]:
        """Failed messages waiting for their next delivery (retry policy), kind "retry".

        Their id is the entry's id on its topic, `due` the earliest redelivery,
        `attempts` the deliveries so far (the consumer group's PEL count).
        """
        topics: Any = await self._redis.smembers(retry_topics_key(self.consumer_id))
        for name in sorted(_s(t) for t in topics):
            if topic is not None and name != topic:
                continue
            key = retry_key(self.consumer_id, name)
            high = "+inf" if due_before_ms is None else f"({due_before_ms}"
            offset = 0
            while True:
                page: Any = await self._redis.zrangebyscore(
                    key, "-inf", high, start=offset, num=self._page, withscores=True
                )
                if not page:
                    break
                offset += len(page)
                pipe = self._redis.pipeline(transaction=False)
                for member, _ in page:
                    self._read_retry(pipe, name, _s(member))
                replies = await pipe.execute(raise_on_error=False)
                for i, (member, score) in enumerate(page):
                    rows, pel = replies[2 * i], replies[2 * i + 1]
                    if isinstance(rows, Exception) or isinstance(pel, Exception) or not rows:
                        continue  # gone (acked, trimmed): the poller drops its record
                    yield _retry_message(name, _s(member), score, decode_entry(rows[0][1]), pel)
                if len(page) < self._page:
                    break

    async def handoffs(
        self, *, policy: HandOffPolicy | None = None, now_ms: int | None = None
    ) -> AsyncIterator[PendingMessage]:
        """Fired messages bound for a targetPubsub still waiting in an outbox (every shard's), kind "handoff".

        Their id is the scheduleId when one was given, else the outbox entry's
        id (`<id>@<shard>` with several shards); `due` is the next try:
        when it was fired for one not yet tried, else its last try plus the
        hand-off backoff (`policy`, the forwarder's defaults when None);
        `attempts` the tries so far (the outbox group's delivery count). An
        overdue next try means the forwarder is at it (a sidecar that does not
        answer is retried at once, without counting).
        """
        policy = policy or HandOffPolicy()
        now = int(time.time() * 1000) if now_ms is None else now_ms
        for shard, keys in enumerate(self.shards):
            async for rows in self._pages(keys.outbox):
                tries = await self._outbox_tries(keys, _s(rows[0][0]), _s(rows[-1][0]), len(rows))
                for raw_id, fields in rows:
                    message = self._handoff(shard, _s(raw_id), fields, tries, policy, now)
                    if message is not None:
                        yield message

    async def _outbox_tries(
        self, keys: EngineKeys, first: str, last: str, count: int
    ) -> dict[str, tuple[int, int]]:
        """outbox id -> (deliveries, ms since the last one) for the pending entries between two ids."""
        try:
            pel: Any = await self._redis.xpending_range(
                keys.outbox, OUTBOX_GROUP, min=first, max=last, count=count
            )
        except ResponseError:
            return {}  # no group yet: nothing was tried
        return {_s(p["message_id"]): (int(p["times_delivered"]), int(p["time_since_delivered"])) for p in pel}

    def _handoff(
        self,
        shard: int,
        outbox_id: str,
        fields: Any,
        tries: Mapping[str, tuple[int, int]],
        policy: HandOffPolicy,
        now_ms: int,
    ) -> PendingMessage | None:
        try:
            entry = decode_outbox_entry(fields)
        except MalformedEntryError:
            return None  # the forwarder dead-letters it on its next read
        deliveries, idle = tries.get(outbox_id, (0, 0))
        fired_ms = int(outbox_id.split("-")[0]) if is_stream_id(outbox_id) else now_ms
        due = fired_ms if deliveries == 0 else now_ms - idle + policy.delay_ms(deliveries)
        return PendingMessage(
            stream_id=outbox_id,
            # The publisher's scheduleId names it; an envelope id (the envelope is gone) does not.
            schedule_id="" if is_stream_id(entry.id) else entry.id,
            topic=entry.topic,
            due_ms=due,
            kind=HANDOFF,
            size=len(entry.data),
            attempts=deliveries,
            published_at_ms=fired_ms,
            shard=self._label(shard),
            pubsub=entry.pubsub,
        )

    async def _handoff_info(self, id: str) -> MessageInfo | None:
        """A hand-off waiting in an outbox, by scheduleId or outbox entry id (`<id>@<shard>`)."""
        named = split_shard_id(id, len(self.shards))
        async for m in self.handoffs():
            if (
                id in (m.id, m.schedule_id)
                or (named is not None and (m.shard or 0, m.stream_id) == named)
                or (is_stream_id(id) and m.stream_id == id)
            ):
                rows: Any = await self._redis.xrange(self.stream_of(m), m.stream_id, m.stream_id)
                if not rows:
                    return None
                entry: OutboxEntry = decode_outbox_entry(rows[0][1])
                env = Envelope(
                    id=entry.id or m.stream_id,
                    topic=entry.topic,
                    due_ms=m.due_ms,
                    published_at_ms=m.published_at_ms,
                    message=entry.data,
                    content_type=entry.content_type,
                    metadata=dict(entry.metadata),
                    schedule_id=m.schedule_id,
                    target_pubsub=entry.pubsub,
                    expires_at_ms=entry.expires_at_ms,
                )
                return MessageInfo(m, env, HANDOFF)
        return None

    async def counts_by_topic(self, max_entries: int | None = None) -> tuple[dict[str, int], bool]:
        """Pending messages per target topic over every shard; False when `max_entries` cut the scan short.

        The fast path of `pending()` (used by the metrics on a timer): only each
        envelope's topic is decoded, and parked envelopes are skipped through
        one HKEYS of the (small) parked hash instead of a lookup per page.
        """
        counts: Counter[str] = Counter()
        scanned = 0
        parse = delayed_pb2.DelayedMessage.FromString
        for keys in self.shards:
            if max_entries is not None and scanned >= max_entries:
                return dict(counts), False
            parked: set[bytes] | None = None
            if int(await self._redis.hlen(keys.parked)) <= _PARKED_IN_MEMORY:
                names: Any = await self._redis.hkeys(keys.parked)
                parked = set(names)
            walk = _Walk(self._redis, keys, self._page)
            async for page in self._walk_pages(walk, _left(max_entries, scanned)):
                scanned += len(page)
                rows = await walk.named(page)
                skip: set[bytes] | list[Any] = parked if parked is not None else []
                if parked is None and rows:
                    flags = await self._redis.hmget(keys.parked, [r[0] for r in rows])
                    skip = {r[0] for r, f in zip(rows, flags, strict=True) if f is not None}
                for raw_id, fields in rows:
                    if raw_id in skip:
                        continue
                    try:
                        topic = parse(fields.get(b"data", b"")).topic
                    except DecodeError:
                        continue
                    if topic:
                        counts[topic] += 1
            # The budget ran out on this shard: complete only if nothing was left on it.
            if not walk.done and await walk.page(1):
                return dict(counts), False
        return dict(counts), True

    async def get(self, id: str, progress: Progress | None = None) -> MessageInfo | None:
        """One message by scheduleId or envelope id (its id on the delayed topic, `<id>@<shard>` with
        several shards); None if not there.

        InvalidArgumentError when a bare stream id names envelopes on several shards.
        """
        info: MessageInfo | None = None
        named = split_shard_id(id, len(self.shards))
        if named is not None:
            info = await self._load(*named)
        else:
            info = await self._by_key(id)
            if info is None and is_stream_id(id):
                found = [i for i in [await self._load(n, id) for n in range(len(self.shards))] if i]
                if len(found) > 1:
                    raise InvalidArgumentError(
                        "id", id, f"on {len(found)} shards; name one as {id}@<shard> (see `pending`)"
                    )
                info = found[0] if found else None
        if info is None and is_stream_id(id):
            info = await self._retry_info(id)
        if info is None:
            info = await self._handoff_info(id)
        if info is None:
            # Last resort: an envelope whose own id field is `id` (engine v2
            # envelopes may carry one) or a parked one whose ids entry is gone.
            info = await self._find(id, progress)
        if info is None:
            return None
        records = await self.message_history(info)
        return MessageInfo(info.message, info.envelope, info.state, info.parked_reason, tuple(records))

    async def message_history(self, info: MessageInfo, limit: int = INSPECT_HISTORY) -> list[HistoryRecord]:
        """The records of the message `info` describes (oldest first), read by time, not by a scan
        of the whole history.

        A history stream id carries the Redis time of its write, and so does
        the envelope's id on the delayed topic: the script that appends the
        envelope writes its `scheduled` (or `replaced`) record in the same
        step. So its records are read from around its own id (+-HISTORY_SLACK_MS)
        and, when anything can have happened since (it is recurring, parked,
        overdue or waiting for a retry), backwards from the newest record down to
        that window, until `limit` of its records are found. A one-shot that
        waits for a later due time has nothing after its scheduling: one short
        range. Records of earlier messages under the same scheduleId are not
        shown (`history --id` lists every record).
        """
        m = info.message
        shard = m.shard or 0
        local = m.schedule_id or m.stream_id
        born = HistoryPosition.of(m.stream_id).ms
        low, high = f"{max(0, born - HISTORY_SLACK_MS)}-0", f"{born + HISTORY_SLACK_MS}-{2**64 - 1}"
        out = [item async for item in self._shard_records(shard, low, local, reverse=False, stop=high)]
        seconds, micros = await self._redis.time()
        now_ms = int(seconds) * 1000 + int(micros) // 1000
        settled = m.kind == Kind.ONESHOT.label and info.state == "pending" and m.due_ms > now_ms
        if not settled:
            later: list[tuple[HistoryPosition, HistoryRecord]] = []
            newest = self._shard_records(shard, "+", local, reverse=True, stop=f"({high}")
            try:
                async for item in newest:
                    later.append(item)
                    if len(later) >= limit:
                        break
            finally:
                await newest.aclose()
            out += reversed(later)
        return [record for _, record in out[-limit:]]

    async def _by_key(self, key: str) -> MessageInfo | None:
        """The envelope a scheduleId (or a recurring envelope's id) names in an ids hash.

        Its home shard (keys.shard_index, where ShardedEngine puts it) first,
        then the others: a bare recurring envelope id lives where it was spread.
        """
        home = shard_index(key, len(self.shards))
        for shard in [home, *(n for n in range(len(self.shards)) if n != home)]:
            ref = await self._redis.hget(self.shards[shard].ids, key)
            if ref is not None:
                return await self._load(shard, _ref(ref)[0])
        return None

    def _read_retry(self, pipe: Any, topic: str, entry_id: str) -> None:
        """Queues on `pipe` what _retry_message reads of a retry: its entry on `topic`, then its
        record in this app's pending entries list (the deliveries so far)."""
        pipe.xrange(topic, entry_id, entry_id)
        pipe.xpending_range(topic, self.consumer_id, min=entry_id, max=entry_id, count=1)

    async def _retry_info(self, entry_id: str) -> MessageInfo | None:
        """A failed message waiting for redelivery, by its entry id on its topic."""
        topics: Any = await self._redis.smembers(retry_topics_key(self.consumer_id))
        for name in sorted(_s(t) for t in topics):
            score = await self._redis.zscore(retry_key(self.consumer_id, name), entry_id)
            if score is None:
                continue
            pipe = self._redis.pipeline(transaction=False)
            self._read_retry(pipe, name, entry_id)
            rows, pel = await pipe.execute()
            if not rows:
                return None
            entry = decode_entry(rows[0][1])
            message = _retry_message(name, entry_id, score, entry, pel)
            env = Envelope(
                id=entry_id,
                topic=name,
                due_ms=message.due_ms,
                published_at_ms=message.published_at_ms,
                message=entry.data,
                content_type=entry.content_type,
                metadata=dict(entry.metadata),
            )
            return MessageInfo(message, env, "retry")
        return None

    async def _load(self, shard: int, stream_id: str) -> MessageInfo | None:
        # Compaction may have re-homed the envelope: the moved hash says where it is now.
        at = await self._redis.hget(self.shards[shard].moved, stream_id)
        stored = stream_id if at is None else _s(at)
        rows: Any = await self._redis.xrange(self.shards[shard].stream, stored, stored)
        if not rows:
            return None
        return await self._info(shard, stream_id, rows[0][1])

    async def _info(self, shard: int, stream_id: str, fields: Any) -> MessageInfo | None:
        try:
            env = decode_envelope(fields.get(b"data", fields.get("data")) or b"")
        except EnvelopeDecodeError:
            return None
        keys = self.shards[shard]
        pipe = self._redis.pipeline(transaction=False)
        pipe.hget(keys.ids, env.schedule_id or stream_id)
        pipe.hget(keys.parked, stream_id)
        ref, parked = await pipe.execute()
        message = self._message(shard, stream_id, env, ref)
        if parked is not None:
            return MessageInfo(message, env, "parked", _s(parked))
        return MessageInfo(message, env, "paused" if message.paused else "pending")

    async def _find(self, id: str, progress: Progress | None) -> MessageInfo | None:
        total = await self.stream_length() if progress is not None else 0
        scanned = 0
        for shard, keys in enumerate(self.shards):
            async for rows in self._pages(keys.stream):
                scanned += len(rows)
                for raw_id, fields in rows:
                    raw_id = _public_id(raw_id, fields)
                    try:
                        env = decode_envelope(fields.get(b"data", fields.get("data")) or b"")
                    except EnvelopeDecodeError:
                        continue
                    if id in (env.id, env.schedule_id):
                        return await self._info(shard, _s(raw_id), fields)
                if progress is not None:
                    progress(scanned, max(total, scanned))
        return None

    async def history(
        self, *, id: str | None = None, since_ms: int | None = None, limit: int | None = None
    ) -> list[HistoryRecord]:
        """Lifecycle records of every shard, oldest first: of one message (by id or scheduleId) when
        `id` is given; the first `limit` of them. With several shards, a record naming an envelope
        by its stream id names it `<stream id>@<shard>`, as the listing does.

        A list: for small histories and tests. Operators' reads go through
        history_forward / history_newest, which stream."""
        out: list[HistoryRecord] = []
        async for _, record in self.history_forward(id=id, since_ms=since_ms):
            if limit is not None and len(out) >= limit:
                break
            out.append(record)
        return out

    def _history_starts(self, after: HistoryPosition | None, since_ms: int | None) -> list[str]:
        """Each shard's XRANGE start for records after `after` (exclusive) or from `since_ms`.

        Records of all shards are ordered by (stream id, shard): a shard at or
        before the cursor's starts after its stream id, a later shard at it."""
        if after is not None:
            at = f"{after.ms}-{after.seq}"
            return [f"({at}" if n <= after.shard else at for n in range(len(self.shards))]
        start = f"{since_ms}-0" if since_ms is not None else "-"
        return [start] * len(self.shards)

    def _history_filter(self, id: str | None) -> tuple[list[int], str | None]:
        """The shards to read and the id their records must carry (None: every record)."""
        named = split_shard_id(id, len(self.shards)) if id is not None else None
        if named is not None:
            return [named[0]], named[1]
        return list(range(len(self.shards))), id

    @staticmethod
    def _born_ms(local: str | None) -> int:
        """Where the records of an id written as a stream id (an envelope's, or a topic entry's for
        retries) can begin: that id's own time, less the slack of its scheduling script. 0 for
        any other id (a scheduleId may have records from any time)."""
        if local is None or not is_stream_id(local):
            return 0
        return max(0, HistoryPosition.of(local).ms - HISTORY_SLACK_MS)

    async def history_forward(
        self,
        *,
        id: str | None = None,
        after: HistoryPosition | None = None,
        since_ms: int | None = None,
    ) -> AsyncGenerator[tuple[HistoryPosition, HistoryRecord]]:
        """Records oldest first, every shard merged by (stream id, shard), each with its position
        (the cursor to continue after it). Streams: memory is a page per shard, whatever the length."""
        shards, local = self._history_filter(id)
        starts = self._history_starts(after, since_ms)
        born = self._born_ms(local)
        if born:
            # Nothing about it was written before it existed: skip the older history.
            starts = [max(st, f"{born}-0", key=_start_key) for st in starts]
        if local is not None and not is_stream_id(local):
            pages = [self._indexed_forward(n, starts[n], local) for n in shards]
        else:
            pages = [self._shard_records(n, starts[n], local, reverse=False) for n in shards]
        async for item in _merge(pages, reverse=False):
            yield item

    async def _indexed_forward(
        self, shard: int, start: str, id: str
    ) -> AsyncGenerator[tuple[HistoryPosition, HistoryRecord]]:
        """One shard's records of `id` (not a stream id) from `start` on, oldest first: read newest
        first through the by-id index down to `start`, then given in order. Beyond
        INDEXED_FORWARD_MAX of them, a scan: memory stays bounded."""
        found: list[tuple[HistoryPosition, HistoryRecord]] = []
        walk = self._indexed_newest(shard, id, _exclusive_low(start))
        try:
            async for item in walk:
                found.append(item)
                if len(found) > INDEXED_FORWARD_MAX:
                    break
            else:
                for item in reversed(found):
                    yield item
                return
        finally:
            await walk.aclose()
        found.clear()
        async for item in self._shard_records(shard, start, id, reverse=False):
            yield item

    async def _indexed_newest(
        self, shard: int, id: str, low: str
    ) -> AsyncGenerator[tuple[HistoryPosition, HistoryRecord]]:
        """One shard's records of `id` (not a stream id), newest first, down to the entry id `low`
        (exclusive; '' = all): along the by-id index's chain (lua/hist_walk.lua), a page per call,
        then by a scan where the chain cannot answer (records older than the index, or below a
        record rewritten out of place)."""
        keys = self.shards[shard]
        link = ""
        while True:
            raw: Any = await self._redis.eval(
                HIST_WALK, 2, keys.history, keys.history_index, id, link, low, self._page
            )
            state, link, marker, first = (_s(x) for x in raw[:4])
            rows = raw[4:]
            for i in range(0, len(rows), 2):
                flat = rows[i + 1]
                record = decode_record(rows[i], dict(zip(flat[::2], flat[1::2], strict=True)))
                if id in (record.id, record.schedule_id):
                    yield HistoryPosition.of(record.stream_id, shard), self._relabel(shard, record)
            if state != "more":
                break
        below: str | None = None
        if state == "gap":
            below = "(" + link
        elif state in ("start", "none"):
            if not marker:
                below = "+"  # nothing indexed yet: a history written before the index
            elif first and _stream_id(first) < _stream_id(marker):
                below = "(" + marker  # the records before indexing began
        if below is not None:
            stop = "(" + low if low else None
            async for item in self._shard_records(shard, below, id, reverse=True, stop=stop):
                yield item

    async def history_newest(
        self, limit: int, *, id: str | None = None
    ) -> list[tuple[HistoryPosition, HistoryRecord]]:
        """The newest `limit` records (of one message when `id` is given), oldest first.

        Reads every shard backwards from its end and stops at `limit`: memory
        and time follow `limit`, not the history's length (with `id`, the
        records after its newest `limit` ones are still read past)."""
        shards, local = self._history_filter(id)
        born = self._born_ms(local)
        stop = f"{born}-0" if born else None
        if local is not None and not is_stream_id(local):
            pages = [self._indexed_newest(n, local, "") for n in shards]
        else:
            pages = [self._shard_records(n, "+", local, reverse=True, stop=stop) for n in shards]
        out: list[tuple[HistoryPosition, HistoryRecord]] = []
        merged = _merge(pages, reverse=True)
        try:
            while len(out) < limit:
                item = await anext(merged, None)
                if item is None:
                    break
                out.append(item)
        finally:
            await merged.aclose()
            for page in pages:
                await page.aclose()
        out.reverse()
        return out

    async def _shard_records(
        self, shard: int, start: str, id: str | None, *, reverse: bool, stop: str | None = None
    ) -> AsyncGenerator[tuple[HistoryPosition, HistoryRecord]]:
        """One shard's records from `start` to `stop` (XRANGE start/end, or XREVRANGE end/start when
        `reverse`; the stream's other end when None), paged."""
        key = self.shards[shard].history
        wanted = id.encode() if id is not None else None
        while True:
            if reverse:
                rows: Any = await self._redis.xrevrange(key, start, stop or "-", count=self._page)
            else:
                rows = await self._redis.xrange(key, start, stop or "+", count=self._page)
            if not rows:
                return
            start = "(" + _s(rows[-1][0])
            for raw_id, fields in rows:
                # Most records are another message's: compare the raw values before decoding one
                # (bytes, or text from a client that decodes responses).
                if (
                    wanted is not None
                    and wanted not in (fields.get(b"id"), fields.get(b"sid"))
                    and id not in (fields.get("id"), fields.get("sid"))
                ):
                    continue
                record = decode_record(raw_id, fields)
                if id is None or id in (record.id, record.schedule_id):
                    yield HistoryPosition.of(record.stream_id, shard), self._relabel(shard, record)
            if len(rows) < self._page:
                return

    def _relabel(self, shard: int, record: HistoryRecord) -> HistoryRecord:
        # A subscriber retry's record names an entry of its topic, not an envelope.
        label = self._label(shard)
        if (
            label is None
            or record.kind == Kind.RETRY.label
            or record.schedule_id
            or not is_stream_id(record.id)
        ):
            return record
        return dataclasses.replace(record, id=shard_id(record.id, label))

    async def dead_letter_topics(self) -> list[str]:
        """The dead-letter topics this app's subscriptions and hand-offs have written to."""
        members: Any = await self._redis.smembers(dead_letter_topics_key(self.consumer_id))
        return sorted(_s(m) for m in members)

    async def dead_letters(
        self, *, source_topic: str | None = None, progress: Progress | None = None
    ) -> list[DeadLetterInfo]:
        """Dead letters of this app (its consumer group's and its hand-offs'), optionally of one source
        topic (a hand-off's target topic)."""
        out: list[DeadLetterInfo] = []
        for dlt in await self.dead_letter_topics():
            async for rows in self._pages(dlt):
                for raw_id, fields in rows:
                    entry = decode_entry(fields)
                    md = entry.metadata
                    if md.get(DL_CONSUMER) != self.consumer_id:
                        continue  # a dead-letter topic may be shared by several apps
                    if source_topic is not None and md.get(DL_SOURCE_TOPIC) != source_topic:
                        continue
                    out.append(
                        DeadLetterInfo(
                            dead_letter_topic=dlt,
                            stream_id=_s(raw_id),
                            source_topic=md.get(DL_SOURCE_TOPIC, ""),
                            reason=md.get(DL_REASON, ""),
                            attempts=int(md.get(DL_ATTEMPTS, "0") or 0)
                            if md.get(DL_ATTEMPTS, "").isdigit()
                            else 0,
                            at_ms=int(md[DL_AT]) if md.get(DL_AT, "").isdigit() else 0,
                            entry=entry,
                            target_pubsub=md.get(DL_PUBSUB, ""),
                        )
                    )
                if progress is not None:
                    progress(len(out), len(out))
        return out
