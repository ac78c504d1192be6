"""The Inspector's reader of what waits on the delayed topic: scans, paged listings, counts, `pending`.

Cost: listing walks the delayed topic with XRANGE in pages (never KEYS, never
the whole stream in one reply), decoding each envelope and looking its due
time up in the ids hash with one pipelined HMGET per page. Roughly O(pending)
with a small constant; callers that run often bound it (`max_entries`).
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from google.protobuf.message import DecodeError

from delayed_middleware.aio import text
from delayed_middleware.engine.pause import paused_at_ms
from delayed_middleware.envelope import Envelope
from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.handoff_reader import HandoffReader
from delayed_middleware.inspection import (
    DELIVERY_ATTEMPT,
    PendingMessage,
    PendingReport,
    Progress,
    Scope,
    matches,
    shown,
)
from delayed_middleware.keys import is_stream_id, split_shard_id
from delayed_middleware.kinds import Kind
from delayed_middleware.retry_reader import RetryReader
from delayed_middleware.stream_walk import StreamWalk
from delayed_pubsub_pb.delayedpubsub.v1 import delayed_pb2

# Up to this many parked envelopes are loaded once per count instead of looked up per page.
PARKED_IN_MEMORY = 10_000


def payload_size(env: Envelope) -> int:
    """Payload bytes of an envelope (all entries of a bulk one)."""
    if env.is_bulk:
        return sum(len(e.event) for e in env.bulk_entries)
    return len(env.message)


def parse_ref(value: bytes | str | None) -> tuple[str, int | None, str]:
    """An ids-hash value: "<stream id> <due ms> <next ms> <next RFC3339> <flag>" ('-' = none)."""
    parts = shown(value).split()
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


def _raw_size(msg: Any) -> int:
    """Payload bytes of a raw DelayedMessage (all entries of a bulk one)."""
    if not msg.bulkPublish:
        return len(msg.message)
    bulk = delayed_pb2.DelayedBulk.FromString(msg.message)
    return sum(len(e.event) for e in bulk.entries)


def pending_message(
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
    """An envelope on the delayed topic as listed, with its ids-hash entry `ref` (None: none)."""
    # The envelope says whether it recurs (DelayedMessage.kind); a hand-edited
    # or older ids entry with a next occurrence says so too.
    due, kind = due_ms, (Kind.RECURRING if recurring else Kind.ONESHOT).label
    paused_at = None
    if ref is not None:
        ref_id, ref_due, ref_next = parse_ref(ref)
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


class PendingReader:
    """Pending messages of one app: the delayed topic (every shard), and with `pending` its retries
    and hand-offs too (read by the readers passed in)."""

    def __init__(self, scope: Scope, retries: RetryReader, handoffs: HandoffReader) -> None:
        self._scope = scope
        self._redis = scope.redis
        self._retries = retries
        self._handoffs = handoffs

    async def stream_length(self) -> int:
        """Entries on the delayed topic, every shard (pending and parked envelopes)."""
        return sum([int(await self._redis.xlen(k.stream)) for k in self._scope.shards])

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
        for shard, keys in enumerate(self._scope.shards):
            walk = StreamWalk(self._redis, keys, self._scope.page)
            async for rows in walk.pages(_left(max_entries, scanned)):
                scanned += len(rows)
                for message in await self.decode_page(shard, await walk.named(rows), stats):
                    yield message
                if stats is not None:
                    stats["scanned"] += len(rows)
                if progress is not None:
                    progress(scanned, max(total, scanned))

    def _listing_start(self, after: str | None) -> tuple[int, str | None]:
        """The shard and stream position a listing resumes after (a cursor it gave), or (0, None)."""
        if after is None:
            return 0, None
        named = split_shard_id(after, len(self._scope.shards))
        if named is not None:
            return named
        if is_stream_id(after):
            return 0, after
        raise InvalidArgumentError("--after", after, "not a cursor of this listing")

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
        first_shard, start = self._listing_start(after)
        shards = self._scope.shards
        for shard in range(first_shard, len(shards)):
            walk = StreamWalk(
                self._redis, shards[shard], self._scope.page, start if shard == first_shard else None
            )
            while True:
                rows: Any = await walk.page()
                if not rows:
                    break
                kept = [(i, f) for i, f in rows if not walk.met_before(i, f)]
                named_rows = await walk.named(rows)
                raw_of = {
                    shown(public): shown(raw) for (raw, _), (public, _) in zip(kept, named_rows, strict=True)
                }
                for m in await self.decode_page(shard, named_rows, None):
                    own = m.schedule_id or (m.stream_id if m.kind == Kind.RECURRING.label else "")
                    if prefix and not own.startswith(prefix):
                        continue
                    if not matches(m, topic, due_before_ms):
                        continue
                    raw = raw_of.get(m.stream_id, m.stream_id)
                    yield (raw if len(shards) == 1 else f"{raw}@{shard}"), m
                if walk.done:
                    break

    async def decode_page(
        self, shard: int, rows: Any, stats: Counter[str] | None = None
    ) -> list[PendingMessage]:
        """The pending messages among a page of `shard`'s delayed stream, parked and undecodable
        ones left out (counted in `stats`). `rows` are named by their envelopes' ids already
        (StreamWalk.named)."""
        # The listing needs a few fields, not a whole Envelope (metadata and
        # payload copied): the raw protobuf is read directly, ~4x cheaper.
        keys = self._scope.shards[shard]
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
            decoded.append((shown(raw_id), msg, size))
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
                pending_message(
                    sid,
                    ref,
                    schedule_id=msg.scheduleId,
                    topic=msg.topic,
                    due_ms=msg.dueTimeMs,
                    size=size,
                    attempts=attempts,
                    published_at_ms=msg.publishedAtMs,
                    recurring=msg.kind == Kind.RECURRING,
                    shard=self._scope.label(shard),
                    schedule=msg.schedule,
                )
            )
        return out

    def message(self, shard: int, stream_id: str, env: Envelope, ref: bytes | str | None) -> PendingMessage:
        """A decoded envelope of `shard` as listed, with its ids-hash entry `ref`."""
        return pending_message(
            stream_id,
            ref,
            schedule_id=env.schedule_id,
            topic=env.topic,
            due_ms=env.due_ms,
            size=payload_size(env),
            attempts=env.metadata.get(DELIVERY_ATTEMPT, "0"),
            published_at_ms=env.published_at_ms,
            recurring=env.is_recurring,
            shard=self._scope.label(shard),
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
            self._retries.retries(topic=topic, due_before_ms=due_before_ms),
            self._handoffs.handoffs(),
        )
        async for m in _each(waiting):
            if not matches(m, topic, due_before_ms):
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

    async def counts_by_topic(self, max_entries: int | None = None) -> tuple[dict[str, int], bool]:
        """Pending messages per target topic over every shard; False when `max_entries` cut the scan short.

        The fast path of `pending()` (used by the metrics on a timer): only each
        envelope's topic is decoded, and parked envelopes are skipped through
        one HKEYS of the (small) parked hash instead of a lookup per page.
        """
        counts: Counter[str] = Counter()
        scanned = 0
        parse = delayed_pb2.DelayedMessage.FromString
        for keys in self._scope.shards:
            if max_entries is not None and scanned >= max_entries:
                return dict(counts), False
            parked: set[bytes] | None = None
            if int(await self._redis.hlen(keys.parked)) <= PARKED_IN_MEMORY:
                names: Any = await self._redis.hkeys(keys.parked)
                parked = set(names)
            walk = StreamWalk(self._redis, keys, self._scope.page)
            async for page in walk.pages(_left(max_entries, scanned)):
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
