"""The PySpark Python Data Sources `delayed-pending` and `delayed-history`, batch and streaming.

::

    from delayed_pubsub.spark import register
    register(spark)
    history = (spark.read.format("delayed-history")
               .option("redisHost", "localhost:6379").option("consumerID", "myapp").load())
    pending = spark.readStream.format("delayed-pending").option(...).load()

Partitions: each delayed topic's stream is cut into `numPartitions` id ranges
(default: the driver's core count), one Spark task each, so a cluster reads in
parallel. A batch read covers the stream as it was when Spark planned the
query: entries added later wait for the next read.

Streaming: an offset is {delayed topic: last stream id read}; Spark checkpoints
it, so a restarted query resumes after the last id it committed. Offsets are
plain stream ids, so `startingOffsets` may be `earliest` (the default: all that
is still in the stream) or `latest` (only what comes after the start). Note the
pending stream is a live set, not a log: an envelope that fires (and leaves the
stream) between two micro-batches is never seen by a streaming pending query;
what happened to it is in the history.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, ClassVar, Final

from delayed_pubsub.spark import require_extra

require_extra()

import pyarrow as pa  # noqa: E402
from pyspark.sql.datasource import (  # noqa: E402
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)

from delayed_middleware.keys import EngineKeys  # noqa: E402
from delayed_pubsub.spark.options import ReaderOptions, parse_reader_options  # noqa: E402
from delayed_pubsub.spark.rows import (  # noqa: E402
    HISTORY_COLUMNS,
    PENDING_COLUMNS,
    ddl,
    decode_pending,
    history_batch,
    parse_ids_value,
    pending_batch,
    recurring_keys,
)
from delayed_pubsub.spark.streams import RedisStreams, next_id, parse_id, split_range  # noqa: E402

PENDING_SOURCE = "delayed-pending"
HISTORY_SOURCE = "delayed-history"
_FIRST_ID = "0-0"


@dataclass(frozen=True)
class StreamRange(InputPartition):
    """One task's share of a stream: ids in [start, end] of `key`, of delayed topic `delayed_topic`.

    For delayed-pending the task owns the envelopes whose id (first stream id) is in
    [start, end], wherever compaction stores them now.
    """

    delayed_topic: str
    key: str
    start: str
    end: str


@dataclass(frozen=True)
class _Kind:
    """What differs between the two sources: which key, which rows."""

    name: str
    columns: Any
    # Which of a delayed topic's EngineKeys is read (an attrgetter: Spark pickles the readers).
    key_of: Callable[[EngineKeys], str]
    batches: Callable[[RedisStreams, StreamRange, int], Iterator[pa.RecordBatch]]

    def key(self, delayed_topic: str) -> str:
        return self.key_of(EngineKeys.for_topic(delayed_topic))


def _history_batches(redis: RedisStreams, part: StreamRange, batch_size: int) -> Iterator[pa.RecordBatch]:
    for page in redis.read(part.key, part.start, part.end, batch_size):
        yield history_batch(part.delayed_topic, page)


def _pending_batches(redis: RedisStreams, part: StreamRange, batch_size: int) -> Iterator[pa.RecordBatch]:
    """The envelopes whose id is in the partition's range, each once, even while a
    compaction pass re-homes them (lua/compact.lua).

    First the range itself: an entry counts under its own id unless it is a genuine
    copy (moved[origin] == its id), which its origin's owner lists. Then the moved
    hash: an envelope of this range stored elsewhere now and not met in the range is
    read at its current place. In that order a move racing the read is met in one of
    the two, and the ids counted in the first keep the second from listing it again.
    """
    keys = EngineKeys.for_topic(part.delayed_topic)
    lo, hi = parse_id(part.start), parse_id(part.end)
    # Parked envelopes are rare: skip the per-page lookup when there are none.
    any_parked = redis.hlen(keys.parked) > 0
    counted: set[tuple[int, int]] = set()
    for page in redis.read(part.key, part.start, part.end, batch_size):
        own = _own_entries(redis, keys, page)
        counted.update(parse_id(_text(sid)) for sid, _ in own)
        if own:
            yield _pending_rows(redis, keys, part.delayed_topic, own, any_parked)
    for found in redis.hscan(keys.moved, batch_size):
        wanted: dict[tuple[int, int], tuple[str, str]] = {}
        for raw_origin, raw_at in found.items():
            origin = _text(raw_origin)
            try:
                first = parse_id(origin)
            except ValueError:
                continue
            if lo <= first <= hi and first not in counted:
                wanted[first] = (origin, _text(raw_at))
        if not wanted:
            continue
        moved = []
        got = redis.entries(part.key, [at for _, at in wanted.values()])
        for (first, (origin, at)), fields in zip(wanted.items(), got, strict=True):
            if fields is None:
                # Moved again or gone since the scan: follow the moved hash.
                fields = _current_copy(redis, keys, part.key, origin, at)
            if fields is not None:
                counted.add(first)
                moved.append((origin, fields))
        if moved:
            yield _pending_rows(redis, keys, part.delayed_topic, moved, any_parked)


def _text(value: Any) -> str:
    # A forged `origin` may be any bytes: replaced, it matches no id, never fails the read.
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def _own_entries(redis: RedisStreams, keys: EngineKeys, page: Any) -> list[tuple[str, Any]]:
    """The entries of a page that count under their own id: all but genuine compaction copies.

    A copy is genuine if the moved hash points from its `origin` to it. One that does not
    is a forgery (anyone can XADD an `origin` field) unless it left the stream before the
    look-up: a genuine copy re-homed again (its owner finds its new place) or an entry that
    fired meanwhile. Still there after the look-up means it was there during it: a forgery,
    listed under its own id.
    """
    with_origin = [(_text(i), _text(f[_ORIGIN])) for i, f in page if _ORIGIN in f]
    points = dict(zip(with_origin, redis.hmget(keys.moved, [o for _, o in with_origin]), strict=True))
    out = []
    for raw_id, fields in page:
        sid = _text(raw_id)
        if _ORIGIN in fields:
            at = points[(sid, _text(fields[_ORIGIN]))]
            if at is not None and _text(at) == sid:
                continue
            if redis.entry(keys.stream, sid) is None:
                continue
        out.append((sid, fields))
    return out


def _current_copy(
    redis: RedisStreams, keys: EngineKeys, stream: str, origin: str, at: str
) -> dict[bytes, bytes] | None:
    """The fields of envelope `origin`'s copy, found at `at` or where it moved since; None
    once it left the stream (fired or cancelled: the moved hash forgets it then)."""
    while True:
        fields = redis.entry(stream, at)
        if fields is not None:
            return fields
        now = redis.hget(keys.moved, origin)
        if now is None or _text(now) == at:
            return None
        at = _text(now)


def _pending_rows(
    redis: RedisStreams, keys: EngineKeys, delayed_topic: str, entries: Any, any_parked: bool
) -> pa.RecordBatch:
    decoded = decode_pending(entries)
    wanted = recurring_keys(decoded)
    current = {k: parse_ids_value(v) for k, v in zip(wanted, redis.hmget(keys.ids, wanted), strict=True) if v}
    parked: dict[str, str] = {}
    if any_parked:
        ids = [sid for sid, _ in decoded]
        for sid, reason in zip(ids, redis.hmget(keys.parked, ids), strict=True):
            if reason is not None:
                parked[sid] = reason.decode("utf-8", errors="replace")
    return pending_batch(delayed_topic, decoded, current, parked)


_HISTORY_KIND: Final = _Kind(HISTORY_SOURCE, HISTORY_COLUMNS, attrgetter("history"), _history_batches)
_PENDING_KIND: Final = _Kind(PENDING_SOURCE, PENDING_COLUMNS, attrgetter("stream"), _pending_batches)


_ORIGIN = b"origin"


def _plan(
    kind: _Kind, options: ReaderOptions, ends: dict[str, tuple[str, str]], *, from_zero: bool = False
) -> list[StreamRange]:
    parts = options.num_partitions or os.cpu_count() or 1
    out = []
    for topic in options.delayed_topics:
        if topic not in ends:
            continue
        first, last = ends[topic]
        for i, (start, end) in enumerate(split_range(first, last, parts)):
            # A whole read: the first range also owns the envelopes whose first id is
            # below the stream's first entry now (all of them re-homed by compaction).
            out.append(StreamRange(topic, kind.key(topic), _FIRST_ID if from_zero and i == 0 else start, end))
    return out


class _BatchReader(DataSourceReader):
    def __init__(self, kind: _Kind, options: ReaderOptions) -> None:
        self._kind = kind
        self._options = options

    def partitions(self) -> Sequence[InputPartition]:
        ends = {}
        with RedisStreams(self._options.settings) as redis:
            redis.ping()
            for topic in self._options.delayed_topics:
                bounds = redis.bounds(self._kind.key(topic))
                if bounds is not None:
                    ends[topic] = bounds
        planned = _plan(self._kind, self._options, ends, from_zero=True)
        # Spark wants at least one partition: an empty range reads nothing.
        topic = self._options.delayed_topics[0]
        return planned or [StreamRange(topic, self._kind.key(topic), "1-0", "0-0")]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, StreamRange)
        if parse_id(partition.start) > parse_id(partition.end):
            return
        with RedisStreams(self._options.settings) as redis:
            yield from self._kind.batches(redis, partition, self._options.batch_size)


class _StreamReader(DataSourceStreamReader):
    """Offsets: {delayed topic: last id read}; ranges (start, end] per micro-batch."""

    def __init__(self, kind: _Kind, options: ReaderOptions) -> None:
        self._kind = kind
        self._options = options
        self._redis: RedisStreams | None = None

    def _conn(self) -> RedisStreams:
        # Lives in Spark's driver-side Python runner across micro-batches.
        if self._redis is None:
            self._redis = RedisStreams(self._options.settings)
        return self._redis

    def _latest(self) -> dict[str, str]:
        redis = self._conn()
        return {t: redis.last_id(self._kind.key(t)) or _FIRST_ID for t in self._options.delayed_topics}

    def initialOffset(self) -> dict[str, str]:
        if self._options.starting_offsets == "latest":
            return self._latest()
        return dict.fromkeys(self._options.delayed_topics, _FIRST_ID)

    def latestOffset(self, start: dict[str, str] | None = None, limit: Any = None) -> dict[str, str]:
        latest = self._latest()
        if start:
            # Never move backwards (a stream deleted and re-created restarts its ids).
            latest = {t: max(latest[t], start.get(t, _FIRST_ID), key=parse_id) for t in latest}
        return latest

    def partitions(self, start: dict[str, str], end: dict[str, str]) -> Sequence[InputPartition]:
        ends = {}
        for topic in self._options.delayed_topics:
            lo, hi = start.get(topic, _FIRST_ID), end.get(topic, _FIRST_ID)
            if parse_id(hi) > parse_id(lo):
                ends[topic] = (next_id(lo), hi)
        # Each micro-batch owns the envelopes whose first id is in (start, end]: a
        # compaction copy of an earlier one that lands later is not listed again.
        return _plan(self._kind, self._options, ends)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, StreamRange)
        with RedisStreams(self._options.settings) as redis:
            yield from self._kind.batches(redis, partition, self._options.batch_size)

    def commit(self, end: dict[str, str]) -> None:
        # Nothing to release: Redis keeps the entries; the checkpoint keeps the offset.
        pass

    def stop(self) -> None:
        if self._redis is not None:
            self._redis.close()
            self._redis = None


class _Source(DataSource):
    kind: ClassVar[_Kind]

    def __init__(self, options: Any) -> None:
        super().__init__(options)
        # Validated here, on the driver, when the user calls load(): fails before any task.
        self.parsed = parse_reader_options(dict(options))

    @classmethod
    def name(cls) -> str:
        return cls.kind.name

    def schema(self) -> str:
        return ddl(self.kind.columns)

    def reader(self, schema: Any) -> DataSourceReader:
        return _BatchReader(self.kind, self.parsed)

    def streamReader(self, schema: Any) -> DataSourceStreamReader:
        return _StreamReader(self.kind, self.parsed)


class PendingDataSource(_Source):
    """`delayed-pending`: one row per envelope on the app's delayed topic(s)."""

    kind = _PENDING_KIND


class HistoryDataSource(_Source):
    """`delayed-history`: one row per lifecycle event of the app's delayed messages."""

    kind = _HISTORY_KIND


def register(spark: Any) -> None:
    """Register both sources on `spark` (a SparkSession)."""
    spark.dataSource.register(PendingDataSource)
    spark.dataSource.register(HistoryDataSource)
