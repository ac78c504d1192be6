"""A forward walk over one delayed stream that does not meet an envelope twice while compaction moves it."""

from __future__ import annotations

import bisect
from collections.abc import AsyncIterator
from typing import Any

from delayed_middleware.inspection import AnyRedis, shown
from delayed_middleware.keys import EngineKeys


def stream_position(value: bytes | str) -> tuple[int, int]:
    """A stream id `<ms>-<seq>` as a pair that sorts in stream order."""
    ms, _, seq = shown(value).partition("-")
    return int(ms), int(seq or 0)


def public_id(raw_id: Any, fields: Any) -> Any:
    """An entry's envelope id: its stream id, or for a copy compaction made (lua/compact.lua)
    the id it was first stored at (field `origin`), in the type the entry id came in."""
    origin = fields.get(b"origin", fields.get("origin"))
    if origin is None:
        return raw_id
    return origin if isinstance(raw_id, bytes) == isinstance(origin, bytes) else shown(origin)


class StreamWalk:
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
        self._ends.append(stream_position(last))
        self._tops.append(stream_position(top[0][0]))
        self.done = len(rows) < count
        return rows

    async def pages(self, budget: int | None) -> AsyncIterator[Any]:
        """The walk's pages of raw rows, to the stream's end or until `budget` rows are read
        (None: no bound). Afterwards `done` says whether the end was seen: a budget
        that ran out exactly at the end leaves it False."""
        read = 0
        while budget is None or read < budget:
            rows: Any = await self.page(self._count if budget is None else min(self._count, budget - read))
            if not rows:
                return
            read += len(rows)
            yield rows
            if self.done:
                return

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
                if stored is not None and shown(stored) == shown(rows[n][0]):
                    raw_id = rows[n][0]
                    # In the type the entry id came in (bytes or str, by the client's decoding).
                    public = (
                        origin if isinstance(raw_id, bytes) == isinstance(origin, bytes) else shown(origin)
                    )
                    named[n] = (public, rows[n][1])
        return named

    def met_before(self, entry_id: Any, fields: Any) -> bool:
        """True for a copy whose envelope this walk already met where it was copied from."""
        source = fields.get(b"from", fields.get("from"))
        if source is None:
            return False
        try:
            at = stream_position(source)
            here = stream_position(entry_id)
        except ValueError:
            return False  # not ours (written by hand): shown as it is
        k = bisect.bisect_left(self._ends, at)
        return k < len(self._ends) and self._tops[k] < here
