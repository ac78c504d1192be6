"""Streaming reads: new entries are picked up, and a restarted query resumes from its checkpoint."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from tests.components.driver import Component
from tests.components.spark.conftest import add_history, fired


def history_stream(spark: Any, options: dict[str, str], **extra: str) -> Any:
    return spark.readStream.format("delayed-history").options(**options, **extra).load()


def wait_for(what: str, check: Callable[[], bool], timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.2)


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

        wait_for("the first 10 events", lambda: rows() == 10)
        add_history(redis_client, [fired("b", 2_000, 7) for _ in range(5)])
        wait_for("5 more events", lambda: rows() == 15)
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
        wait_for(
            "the 3 new events",
            lambda: spark.sql("SELECT count(*) AS n FROM history_latest").collect()[0]["n"] == 3,
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
