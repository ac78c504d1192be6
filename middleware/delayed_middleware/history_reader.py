"""The Inspector's history reader: an app's lifecycle records over every shard, merged, paged, by id.

Records of all shards are ordered by (stream id, shard) (`HistoryPosition`);
a read streams (a page per shard in memory, whatever the history's length).
Records of one scheduleId are found through the by-id index
(lua/hist_walk.lua), those of an envelope id by time around that id.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from delayed_middleware.history import HistoryRecord, decode_record
from delayed_middleware.inspection import MessageInfo, Scope, shown
from delayed_middleware.keys import is_stream_id, shard_id, split_shard_id
from delayed_middleware.kinds import Kind
from delayed_middleware.lua_scripts import HIST_WALK
from delayed_middleware.stream_walk import stream_position

# inspect shows at most this many of a message's newest records.
INSPECT_HISTORY = 50
# How far around an envelope's own stream id its scheduling records are looked for (ms):
# written by the same script, they are within that script's run (a script keeps to ~20 ms) of it.
HISTORY_SLACK_MS = 250
# history_forward of one scheduleId collects at most this many of a shard's records from the
# by-id index before it shows them oldest first; an id with more is read by a scan (it is dense).
INDEXED_FORWARD_MAX = 20_000


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


Positioned = tuple[HistoryPosition, HistoryRecord]


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


async def _merge(sources: list[AsyncGenerator[Positioned]], *, reverse: bool) -> AsyncGenerator[Positioned]:
    """Merge sorted record streams by position (descending when `reverse`), one item per source held."""
    if len(sources) == 1:
        # One shard: nothing to merge.
        async for item in sources[0]:
            yield item
        return
    heap: list[tuple[tuple[int, int, int], int, Positioned]] = []
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


class HistoryReader:
    """Lifecycle records of one app, every shard's history stream merged by position."""

    def __init__(self, scope: Scope) -> None:
        self._scope = scope
        self._redis = scope.redis
        self._page = scope.page

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
        shards = len(self._scope.shards)
        if after is not None:
            at = f"{after.ms}-{after.seq}"
            return [f"({at}" if n <= after.shard else at for n in range(shards)]
        start = f"{since_ms}-0" if since_ms is not None else "-"
        return [start] * shards

    def _history_filter(self, id: str | None) -> tuple[list[int], str | None]:
        """The shards to read and the id their records must carry (None: every record)."""
        shards = len(self._scope.shards)
        named = split_shard_id(id, shards) if id is not None else None
        if named is not None:
            return [named[0]], named[1]
        return list(range(shards)), id

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
    ) -> AsyncGenerator[Positioned]:
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

    async def _indexed_forward(self, shard: int, start: str, id: str) -> AsyncGenerator[Positioned]:
        """One shard's records of `id` (not a stream id) from `start` on, oldest first: read newest
        first through the by-id index down to `start`, then given in order. Beyond
        INDEXED_FORWARD_MAX of them, a scan: memory stays bounded."""
        found: list[Positioned] = []
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

    async def _indexed_newest(self, shard: int, id: str, low: str) -> AsyncGenerator[Positioned]:
        """One shard's records of `id` (not a stream id), newest first, down to the entry id `low`
        (exclusive; '' = all): along the by-id index's chain (lua/hist_walk.lua), a page per call,
        then by a scan where the chain cannot answer (records older than the index, or below a
        record rewritten out of place)."""
        keys = self._scope.shards[shard]
        link = ""
        while True:
            raw: Any = await self._redis.eval(
                HIST_WALK, 2, keys.history, keys.history_index, id, link, low, self._page
            )
            state, link, marker, first = (shown(x) for x in raw[:4])
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
            elif first and stream_position(first) < stream_position(marker):
                below = "(" + marker  # the records before indexing began
        if below is not None:
            stop = "(" + low if low else None
            async for item in self._shard_records(shard, below, id, reverse=True, stop=stop):
                yield item

    async def history_newest(self, limit: int, *, id: str | None = None) -> list[Positioned]:
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
        out: list[Positioned] = []
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
            later: list[Positioned] = []
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

    async def _shard_records(
        self, shard: int, start: str, id: str | None, *, reverse: bool, stop: str | None = None
    ) -> AsyncGenerator[Positioned]:
        """One shard's records from `start` to `stop` (XRANGE start/end, or XREVRANGE end/start when
        `reverse`; the stream's other end when None), paged."""
        key = self._scope.shards[shard].history
        wanted = id.encode() if id is not None else None
        while True:
            if reverse:
                rows: Any = await self._redis.xrevrange(key, start, stop or "-", count=self._page)
            else:
                rows = await self._redis.xrange(key, start, stop or "+", count=self._page)
            if not rows:
                return
            start = "(" + shown(rows[-1][0])
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
        label = self._scope.label(shard)
        if (
            label is None
            or record.kind == Kind.RETRY.label
            or record.schedule_id
            or not is_stream_id(record.id)
        ):
            return record
        return dataclasses.replace(record, id=shard_id(record.id, label))
