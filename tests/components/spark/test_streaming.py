"""Streaming reads: new entries are picked up, and a restarted query resumes from its checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis

from delayed_middleware.clock import ManualClock
from delayed_middleware.engine import DelayEngine
from delayed_middleware.envelope import Envelope
from delayed_middleware.keys import EngineKeys, delayed_topic
from tests.components.driver import Component
from tests.components.spark.conftest import APP, add_history, fired
from tests.redis_server import RedisServer
from tests.waiting import wait_until_blocking

T0 = 1_800_000_000_000


def history_stream(spark: Any, options: dict[str, str], **extra: str) -> Any:
    return spark.readStream.format("delayed-history").options(**options, **extra).load()


def test_running_query_picks_up_new_events(
    spark: Any, redis_client: redis.Redis, options: dict[str, str]
) -> None:
    add_history(redis_client, [fired("a", 1_000, late) for late in range(10)])
    query = (
        history_stream(spark, options)
        .writeStream.format("memory")
        .queryName("history_live")
        .trigger(processingTime="200 milliseconds")
        .start()
    )
    try:

        def rows() -> int:
            return int(spark.sql("SELECT count(*) AS n FROM history_live").collect()[0]["n"])

        wait_until_blocking(lambda: rows() == 10, "the first 10 events", 90, every_s=0.2)
        add_history(redis_client, [fired("b", 2_000, 7) for _ in range(5)])
        wait_until_blocking(lambda: rows() == 15, "5 more events", 90, every_s=0.2)
        by_topic = {
            r["topic"]: r["n"]
            for r in spark.sql("SELECT topic, count(*) AS n FROM history_live GROUP BY topic").collect()
        }
        assert by_topic == {"a": 10, "b": 5}
    finally:
        query.stop()


def _run_to_end(spark: Any, options: dict[str, str], sink: Path, checkpoint: Path, **extra: str) -> int:
    """Start a query on the checkpoint, process what is there, stop; returns the rows it read."""
    query = (
        history_stream(spark, options, **extra)
        .writeStream.format("parquet")
        .option("path", str(sink))
        .option("checkpointLocation", str(checkpoint))
        .start()
    )
    try:
        query.processAllAvailable()
        return sum(int(p["numInputRows"]) for p in query.recentProgress)
    finally:
        query.stop()


def test_restarted_query_resumes_from_its_checkpoint(
    spark: Any, redis_client: redis.Redis, options: dict[str, str], tmp_path: Path
) -> None:
    sink, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    first = add_history(redis_client, [fired("a", 1_000, n) for n in range(10)])
    assert _run_to_end(spark, options, sink, checkpoint, numPartitions="2") == 10
    # While no query runs, more history arrives.
    later = add_history(redis_client, [fired("a", 1_000, 100 + n) for n in range(5)])
    assert _run_to_end(spark, options, sink, checkpoint, numPartitions="2") == 5
    ids = [r["history_id"] for r in spark.read.parquet(str(sink)).collect()]
    # Everything exactly once across the restart.
    assert sorted(ids) == sorted(first + later)


def test_starting_offsets_latest_skips_what_was_there(
    spark: Any, redis_client: redis.Redis, options: dict[str, str], tmp_path: Path
) -> None:
    add_history(redis_client, [fired("a", 1_000, 1) for _ in range(4)])
    query = (
        history_stream(spark, options, startingOffsets="latest")
        .writeStream.format("memory")
        .queryName("history_latest")
        .trigger(processingTime="200 milliseconds")
        .start()
    )
    try:
        query.processAllAvailable()
        new = add_history(redis_client, [fired("c", 1_000, 2) for _ in range(3)])
        wait_until_blocking(
            lambda: spark.sql("SELECT count(*) AS n FROM history_latest").collect()[0]["n"] == 3,
            "the 3 new events",
            90,
            every_s=0.2,
        )
        got = sorted(r["history_id"] for r in spark.sql("SELECT history_id FROM history_latest").collect())
        assert got == sorted(new)
    finally:
        query.stop()


async def test_pending_stream_sees_new_envelopes(
    spark: Any, component: Callable[[str], Component], props: dict[str, str], options: dict[str, str]
) -> None:
    c = component("delayed")
    await c.init({**props, "enableDelayedMessaging": "true"})
    await c.publish("later", b"{}", {"scheduledSendDelay": "1h", "scheduleId": "s-0"})
    query = (
        spark.readStream.format("delayed-pending")
        .options(**options)
        .load()
        .writeStream.format("memory")
        .queryName("pending_live")
        .trigger(processingTime="200 milliseconds")
        .start()
    )
    try:
        query.processAllAvailable()
        for i in range(1, 4):
            await c.publish("later", b"{}", {"scheduledSendDelay": "1h", "scheduleId": f"s-{i}"})
        query.processAllAvailable()
        ids = sorted(r["id"] for r in spark.sql("SELECT id FROM pending_live").collect())
        assert ids == ["s-0", "s-1", "s-2", "s-3"]
    finally:
        query.stop()


async def test_pending_reads_after_compaction_show_each_envelope_once_under_its_id(
    spark: Any, redis_client: redis.Redis, options: dict[str, str], redis_server: RedisServer
) -> None:
    """Compaction re-homes envelopes to the delayed topic's tail (new stream ids). A running
    stream query already read them: it must not read them again; a batch read and a stream
    query started afterwards read each once, under the id it was published with."""
    clock = ManualClock(T0)
    client = aioredis.Redis(port=redis_server.port)
    engine = DelayEngine(client, EngineKeys.for_topic(delayed_topic(APP)), clock)
    waiting = [Envelope(id="", topic="later", due_ms=T0 + 3_600_000, published_at_ms=T0, message=b"{}")]
    filler = [Envelope(id="", topic="now", due_ms=T0, published_at_ms=T0, message=b"x" * 300)] * 20
    ids = (await engine.schedule((waiting + filler) * 30))[::21]
    while (await engine.fire_due())[0]:
        pass

    def pending_ids(table: str) -> list[str]:
        return sorted(r["id"] for r in spark.sql(f"SELECT id FROM {table}").collect())

    query = (
        spark.readStream.format("delayed-pending").options(**options).load()
        .writeStream.format("memory").queryName("pending_compacted")
        .trigger(processingTime="200 milliseconds").start()
    )  # fmt: skip
    try:
        query.processAllAvailable()
        assert pending_ids("pending_compacted") == sorted(ids)
        assert await engine.compact()
        assert redis_client.hlen(EngineKeys.for_topic(delayed_topic(APP)).moved) == 30
        more = await engine.schedule(waiting * 2)
        query.processAllAvailable()
        assert pending_ids("pending_compacted") == sorted(ids + more)
    finally:
        query.stop()
        await client.aclose()
    batch = spark.read.format("delayed-pending").options(**options, numPartitions="3").load()
    assert sorted(r["id"] for r in batch.collect()) == sorted(ids + more)
    late = (
        spark.readStream.format("delayed-pending").options(**options).load()
        .writeStream.format("memory").queryName("pending_after").start()
    )  # fmt: skip
    try:
        late.processAllAvailable()
        assert pending_ids("pending_after") == sorted(ids + more)
    finally:
        late.stop()
