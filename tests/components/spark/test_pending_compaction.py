"""delayed-pending lists each pending envelope once, under its own id, while a compaction
pass re-homes envelopes to the stream's tail between and during the reader's pages.

The readers are driven here as Spark drives them (partitions(), then read() of each
partition), with the engine's compaction script run between their pages; the last test
reads through a real SparkSession, halfway through a pass."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import redis

from delayed_middleware.keys import EngineKeys, delayed_topic
from delayed_pubsub.spark.datasource import PendingDataSource, StreamRange
from tests.components.spark.conftest import APP, CompactionPass, schedule_waiting
from tests.redis_server import RedisServer

DUE = 1_800_000_000_000
KEYS = EngineKeys.for_topic(delayed_topic(APP))


def ids_of(batches: Iterable[Any]) -> list[str]:
    return [r["id"] for b in batches for r in b.to_pylist()]


def test_batch_read_with_compaction_between_its_pages_lists_every_envelope_once(
    redis_server: RedisServer, redis_client: redis.Redis, options: dict[str, str]
) -> None:
    ids = schedule_waiting(redis_server.port, rounds=6, per_round=10, due_ms=DUE)
    compaction = CompactionPass(redis_client, chunk=10)
    reader = PendingDataSource({**options, "numPartitions": "3", "batchSize": "5"}).reader(None)
    parts = reader.partitions()
    assert len(parts) == 3
    listed: list[str] = []
    moved = 0
    for part in parts:
        for batch in reader.read(part):
            listed += ids_of([batch])
            moved += compaction.step()
    assert moved >= 40  # envelopes of every partition moved, some more than once
    assert sorted(listed) == sorted(ids)
    assert len(listed) == 60


def test_envelopes_moved_after_the_read_began_are_listed_once(
    redis_server: RedisServer, redis_client: redis.Redis, options: dict[str, str]
) -> None:
    """Some envelopes were read at their first place before the pass moved them, the others
    were not yet: the first must not come back from the moved hash, the others must."""
    ids = schedule_waiting(redis_server.port, rounds=1, per_round=10, due_ms=DUE)
    reader = PendingDataSource({**options, "numPartitions": "1", "batchSize": "5"}).reader(None)
    [part] = reader.partitions()
    batches = iter(reader.read(part))
    listed = ids_of([next(batches)])
    compaction = CompactionPass(redis_client, chunk=100)
    assert compaction.whole_pass() == 10
    assert compaction.whole_pass() == 10  # and each moved again: the moved hash points at the second copy
    listed += ids_of(batches)
    assert sorted(listed) == sorted(ids)
    assert redis_client.hlen(KEYS.moved) == 10


def test_an_envelope_that_fires_after_it_moved_is_not_listed_from_its_old_place(
    redis_server: RedisServer, redis_client: redis.Redis, options: dict[str, str]
) -> None:
    ids = schedule_waiting(redis_server.port, rounds=1, per_round=4, due_ms=DUE)
    CompactionPass(redis_client, chunk=100).whole_pass()
    # Gone from the stream as FIRE and CANCEL leave it: entry deleted, move forgotten.
    gone = ids[0]
    at: Any = redis_client.hget(KEYS.moved, gone)
    redis_client.xdel(KEYS.stream, at)
    redis_client.hdel(KEYS.moved, gone)
    reader = PendingDataSource(options).reader(None)
    assert sorted(ids_of(b for p in reader.partitions() for b in reader.read(p))) == sorted(ids[1:])


def test_an_entry_with_a_forged_origin_is_listed_under_its_own_id(
    redis_server: RedisServer, redis_client: redis.Redis, options: dict[str, str]
) -> None:
    """Anyone can XADD an `origin` field: only the moved hash makes an entry a copy."""
    ids = schedule_waiting(redis_server.port, rounds=1, per_round=3, due_ms=DUE)
    first: Any = redis_client.xrange(KEYS.stream, ids[0], ids[0])
    [(_, fields)] = first
    forged_id: Any = redis_client.xadd(KEYS.stream, {**fields, b"origin": ids[1].encode()})
    garbled_id: Any = redis_client.xadd(KEYS.stream, {**fields, b"origin": b"\xff\xfe-1"})
    forged = [forged_id.decode(), garbled_id.decode()]
    reader = PendingDataSource(options).reader(None)

    def listed() -> list[str]:
        return sorted(ids_of(b for p in reader.partitions() for b in reader.read(p)))

    assert listed() == sorted([*ids, *forged])
    # Compaction re-homes the forgeries under their own ids too (it drops the untrusted field).
    assert CompactionPass(redis_client, chunk=100).whole_pass() == 5
    assert listed() == sorted([*ids, *forged])


def test_stream_micro_batches_list_an_envelope_moved_past_their_end_once(
    redis_server: RedisServer, redis_client: redis.Redis, options: dict[str, str]
) -> None:
    """A micro-batch is planned, then the pass moves its envelopes past its end before it
    reads them: it must list them (the next micro-batch meets the copies and skips them)."""
    ids = schedule_waiting(redis_server.port, rounds=3, per_round=10, due_ms=DUE)
    reader: Any = PendingDataSource({**options, "numPartitions": "2", "batchSize": "5"}).streamReader(None)
    start = reader.initialOffset()
    end = reader.latestOffset(start)
    first = reader.partitions(start, end)
    assert CompactionPass(redis_client, chunk=100).whole_pass() == 30
    listed = ids_of(b for p in first for b in reader.read(p))
    later = schedule_waiting(redis_server.port, rounds=1, per_round=5, due_ms=DUE)
    second_end = reader.latestOffset(end)
    second = reader.partitions(end, second_end)
    assert all(isinstance(p, StreamRange) for p in second)
    listed += ids_of(b for p in second for b in reader.read(p))
    reader.stop()
    assert sorted(listed) == sorted(ids + later)
    assert len(listed) == 35


def test_spark_reads_each_envelope_once_halfway_through_a_pass_with_a_forged_copy(
    spark: Any, redis_server: RedisServer, redis_client: redis.Redis, options: dict[str, str]
) -> None:
    ids = schedule_waiting(redis_server.port, rounds=6, per_round=10, due_ms=DUE)
    first: Any = redis_client.xrange(KEYS.stream, ids[0], ids[0])
    [(_, fields)] = first
    forged_id: Any = redis_client.xadd(KEYS.stream, {**fields, b"origin": ids[50].encode()})
    compaction = CompactionPass(redis_client, chunk=30)
    assert compaction.step() == 30  # half the envelopes now sit at the tail, the pass goes on
    rows = spark.read.format("delayed-pending").options(**options, numPartitions="3", batchSize="5").load()
    listed = [(r["id"], r["stream_id"]) for r in rows.collect()]
    assert sorted(i for i, _ in listed) == sorted([*ids, forged_id.decode()])
    assert all(i == sid for i, sid in listed)
