"""`delayed-pubsub stats --stream-out DIR`: per-minute aggregates of the history, written as
Parquet continuously by a Structured Streaming query that resumes from its checkpoint.

Layout under DIR:

- `minutes/batch=<id>/`: the aggregates of micro-batch <id> (one row per minute, topic and
  event). A minute that spans two batches has a row in each: sum over batches for totals.
- `_checkpoint/`: Spark's offset and commit logs.

Why each batch gets its own partition, written with overwrite: after a crash (kill -9)
Spark replays the last batch whose offsets it logged but did not commit, over exactly the
same history range. The replay rewrites the same `batch=<id>` partition, so nothing is
counted twice and nothing is lost.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

MINUTES_DIR: Final = "minutes"
CHECKPOINT_DIR: Final = "_checkpoint"


def minute_aggregates(history: Any) -> Any:
    """Events per UTC minute of `at`, topic and event, with the lateness sum and count of the
    events that carry one (a malformed record is a row with null minute and event)."""
    from pyspark.sql import functions as F

    return history.groupBy(F.date_trunc("minute", F.col("at")).alias("minute"), "topic", "event").agg(
        F.count(F.lit(1)).alias("events"),
        F.sum("lateness_ms").alias("lateness_sum_ms"),
        F.count("lateness_ms").alias("lateness_count"),
    )


def write_batch(out_dir: Path, batch: Any, batch_id: int) -> None:
    """foreachBatch sink: this batch's aggregates replace `minutes/batch=<batch_id>`."""
    target = out_dir / MINUTES_DIR / f"batch={batch_id}"
    minute_aggregates(batch).coalesce(1).write.mode("overwrite").parquet(str(target))


def start_minutes_query(spark: Any, options: dict[str, str], out_dir: Path, interval_s: int) -> Any:
    """Start the streaming query over the app's history; resumes from `out_dir/_checkpoint`."""
    from delayed_pubsub.spark.datasource import HISTORY_SOURCE

    out_dir.mkdir(parents=True, exist_ok=True)
    return (
        spark.readStream.format(HISTORY_SOURCE)
        .options(**options)
        .load()
        .writeStream.foreachBatch(lambda batch, batch_id: write_batch(out_dir, batch, int(batch_id)))
        .option("checkpointLocation", str(out_dir / CHECKPOINT_DIR))
        .trigger(processingTime=f"{interval_s} seconds")
        .start()
    )
