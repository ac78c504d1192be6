"""Reading Redis streams by id range, for the Spark readers (synchronous facade).

Stream ids are "<ms>-<seq>"; a range [start, end] is inclusive at both ends, as
XRANGE takes it. Splitting a stream for parallel reads cuts its id space by
time (the ms part), like spark-redis does: no count is needed up front, and a
partition never depends on another's result.

The connection is the component's own (delayed_pubsub.connection.connect), so
single node, Cluster, Sentinel and TLS work here exactly as in the component;
it is asynchronous, so a private event loop drives it from Spark's synchronous
reader methods.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterator, Sequence
from typing import Any, TypeVar, cast

from delayed_pubsub.connection import Connection, connect
from delayed_pubsub.settings import Settings

T = TypeVar("T")

MAX_SEQ = 2**64 - 1
Entries = list[tuple[bytes, dict[bytes, bytes]]]


def parse_id(stream_id: str) -> tuple[int, int]:
    """ "<ms>-<seq>" (or "<ms>") -> (ms, seq); ValueError if it is neither."""
    ms, _, seq = stream_id.partition("-")
    if not (ms.isascii() and ms.isdigit()) or (seq and not (seq.isascii() and seq.isdigit())):
        raise ValueError(f"not a stream id: {stream_id!r}")
    return int(ms), int(seq or 0)


def format_id(ms: int, seq: int) -> str:
    return f"{ms}-{seq}"


def next_id(stream_id: str) -> str:
    """The smallest id greater than `stream_id` (to resume after it without the "(" syntax)."""
    ms, seq = parse_id(stream_id)
    return format_id(ms + 1, 0) if seq >= MAX_SEQ else format_id(ms, seq + 1)


def id_leq(a: str, b: str) -> bool:
    return parse_id(a) <= parse_id(b)


def split_range(first: str, last: str, parts: int) -> list[tuple[str, str]]:
    """Cut [first, last] into at most `parts` contiguous, non-overlapping inclusive ranges.

    The cuts fall on millisecond boundaries, so ids of one millisecond stay in
    one range; fewer ranges come back when the span has fewer milliseconds.
    """
    lo_ms, lo_seq = parse_id(first)
    hi_ms, hi_seq = parse_id(last)
    if (lo_ms, lo_seq) > (hi_ms, hi_seq):
        return []
    span = hi_ms - lo_ms + 1
    parts = max(1, min(parts, span))
    cuts = [lo_ms + span * i // parts for i in range(parts + 1)]
    ranges = []
    for i in range(parts):
        start = format_id(lo_ms, lo_seq) if i == 0 else format_id(cuts[i], 0)
        end = format_id(hi_ms, hi_seq) if i == parts - 1 else format_id(cuts[i + 1] - 1, MAX_SEQ)
        ranges.append((start, end))
    return ranges


class RedisStreams:
    """One connection for one planning step or one partition read; use as a context manager."""

    def __init__(self, settings: Settings) -> None:
        self._loop = asyncio.new_event_loop()
        self._conn: Connection = connect(settings)
        self._timeout = self._conn.call_timeout

    def __enter__(self) -> RedisStreams:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self._run(self._conn.aclose())
        finally:
            self._loop.close()

    def _run(self, coro: Awaitable[T]) -> T:
        async def bounded() -> T:
            async with asyncio.timeout(self._timeout):
                return await coro

        return self._loop.run_until_complete(bounded())

    def ping(self) -> None:
        """BackendUnavailableError naming host:port when Redis does not answer."""
        self._run(self._conn.ping())

    def bounds(self, key: str) -> tuple[str, str] | None:
        """(first id, last id) of a stream, or None when it is empty or missing."""

        async def both() -> tuple[Any, Any]:
            client = self._conn.client
            return await client.xrange(key, count=1), await client.xrevrange(key, count=1)

        first, last = self._run(both())
        if not first or not last:
            return None
        return first[0][0].decode(), last[0][0].decode()

    def last_id(self, key: str) -> str | None:
        got = cast(Entries, self._run(self._conn.client.xrevrange(key, count=1)))
        return got[0][0].decode() if got else None

    def read(self, key: str, start: str, end: str, count: int) -> Iterator[Entries]:
        """Pages of at most `count` entries with ids in [start, end], oldest first."""
        cursor = start
        while True:
            page = cast(Entries, self._run(self._conn.client.xrange(key, min=cursor, max=end, count=count)))
            if page:
                yield page
            if len(page) < count:
                return
            last = page[-1][0].decode()
            if not id_leq(next_id(last), end):
                return
            cursor = next_id(last)

    def hmget(self, key: str, fields: Sequence[str]) -> list[bytes | None]:
        if not fields:
            return []
        return cast(list[bytes | None], self._run(self._conn.client.hmget(key, list(fields))))

    def hlen(self, key: str) -> int:
        return int(self._run(self._conn.client.hlen(key)))

    def hget(self, key: str, field: str) -> bytes | None:
        return cast(bytes | None, self._run(self._conn.client.hget(key, field)))

    def entry(self, key: str, stream_id: str) -> dict[bytes, bytes] | None:
        """The fields of the entry at `stream_id`, or None when there is none (now)."""
        got = cast(Entries, self._run(self._conn.client.xrange(key, min=stream_id, max=stream_id, count=1)))
        return got[0][1] if got else None

    def entries(self, key: str, stream_ids: Sequence[str]) -> list[dict[bytes, bytes] | None]:
        """entry() of each id, in one round trip (a pipeline: one key, so one slot on Cluster)."""
        if not stream_ids:
            return []

        async def run() -> list[Any]:
            pipe = self._conn.client.pipeline(transaction=False)
            for sid in stream_ids:
                pipe.xrange(key, min=sid, max=sid, count=1)
            return await pipe.execute()

        return [got[0][1] if got else None for got in self._run(run())]

    def hscan(self, key: str, count: int) -> Iterator[dict[bytes, bytes]]:
        """The hash's fields and values in HSCAN pages: each field present from the first
        page to the last is in some page (possibly twice)."""
        cursor = 0
        while True:
            cursor, page = cast(
                tuple[int, dict[bytes, bytes]], self._run(self._conn.client.hscan(key, cursor, count=count))
            )
            if page:
                yield page
            if cursor == 0:
                return
