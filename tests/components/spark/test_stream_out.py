"""`delayed-pubsub stats --stream-out DIR` as a user runs it: killed with kill -9 while it
streams, restarted on the same directory, its Parquet totals equal the history exactly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pytest
import redis

from tests.components.spark.conftest import APP, add_history, fired, history_key
from tests.redis_server import RedisServer

STARTUP_S = 240  # Spark's start-up on a loaded 2-core machine
T0 = 1_800_000_000_000  # a minute boundary


def _start(redis_server: RedisServer, out: Path, log: Path) -> subprocess.Popen[bytes]:
    script = Path(sys.executable).parent / "delayed-pubsub"
    with log.open("ab") as f:
        return subprocess.Popen(
            [str(script), "stats", "--redis-host", redis_server.address, "--app-id", APP,
             "--stream-out", str(out)],
            stdout=f,
            stderr=f,
            cwd=out.parent,
            start_new_session=True,  # its own process group: kill -9 takes the JVM too
        )  # fmt: skip


def _totals(out: Path) -> Counter[tuple[int | None, str | None, str | None]]:
    """events per (minute ms, topic, event), summed over every batch partition on disk."""
    minutes = out / "minutes"
    if not minutes.exists():
        return Counter()
    table = ds.dataset(str(minutes), format="parquet", partitioning="hive").to_table()
    got: Counter[tuple[int | None, str | None, str | None]] = Counter()
    for row in table.to_pylist():
        minute = None if row["minute"] is None else int(row["minute"].timestamp() * 1000)
        got[(minute, row["topic"], row["event"])] += row["events"]
    return got


def _lateness_sum(out: Path) -> int:
    table = ds.dataset(str(out / "minutes"), format="parquet", partitioning="hive").to_table()
    return sum(v or 0 for v in table.column("lateness_sum_ms").to_pylist())


def _wait(what: str, check: Callable[[], bool], proc: subprocess.Popen[bytes], log: Path, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert proc.poll() is None, f"stats exited with {proc.returncode}: {log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"{what}: not within {within_s} s: {log.read_text()[-2000:]}"
        time.sleep(0.3)


def _uncommit_last_batch(out: Path) -> tuple[int, set[Path]]:
    """The last batch Spark planned (its offsets logged), and the files its partition had.

    If the kill landed mid-batch, Spark replays that batch on restart by itself. If it landed
    between batches, the checkpoint is put in the state a kill -9 leaves when it lands after
    the sink wrote a batch but before Spark logged its commit (a window too narrow to hit by
    timing): the commit is removed, so Spark must run that batch again."""
    cp = out / "_checkpoint"
    last = max(int(p.name) for p in (cp / "offsets").iterdir() if p.name.isdigit())
    if (cp / "commits" / str(last)).exists():
        (cp / "commits" / str(last)).unlink()
        (cp / "commits" / f".{last}.crc").unlink(missing_ok=True)
        assert any((out / "minutes" / f"batch={last}").glob("*.parquet"))
    return last, set((out / "minutes" / f"batch={last}").glob("*.parquet"))


def _kill9(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.mark.timeout(2 * STARTUP_S + 120)
def test_stream_out_resumes_after_kill_9_without_double_counting(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    out, log = tmp_path / "stream", tmp_path / "stats.log"
    expected: Counter[tuple[int | None, str | None, str | None]] = Counter()
    late_total = 0

    def write(n: int, minute: int, topic: str) -> None:
        nonlocal late_total
        recs: list[Mapping[str, Any]] = [fired(topic, T0 + minute * 60_000, late) for late in range(n)]
        add_history(redis_client, recs)
        for r in recs:
            expected[((int(r["at"]) // 60_000) * 60_000, topic, "fired")] += 1
            late_total += int(r["late"])

    write(40, 0, "a")
    write(10, 1, "b")
    proc = _start(redis_server, out, log)
    try:
        _wait("the first batch", lambda: sum(_totals(out).values()) >= 50, proc, log, STARTUP_S)
        # More history keeps arriving while the query runs; kill -9 lands between or inside batches.
        stop = threading.Event()

        def trickle() -> None:
            i = 0
            while not stop.is_set():
                write(7, 2 + i % 3, "c")
                i += 1
                time.sleep(0.4)

        writer = threading.Thread(target=trickle)
        writer.start()
        try:
            _wait("a later batch", lambda: len(list((out / "minutes").glob("batch=*"))) >= 3, proc, log, 60)
            time.sleep(1.3)
        finally:
            _kill9(proc)
            stop.set()
            writer.join()
    finally:
        if proc.poll() is None:
            _kill9(proc)
    replayed, replayed_files = _uncommit_last_batch(out)
    # While it is down, more history arrives.
    write(25, 5, "d")
    assert redis_client.xlen(history_key()) == sum(expected.values())

    proc = _start(redis_server, out, log)
    try:
        want = sum(expected.values())
        _wait("every record", lambda: sum(_totals(out).values()) >= want, proc, log, STARTUP_S)
        time.sleep(5)  # two more triggers: a double count would show now
        assert _totals(out) == expected
        assert _lateness_sum(out) == late_total
        # The replay happened, and rewrote the batch's partition rather than adding to it.
        assert (out / "_checkpoint" / "commits" / str(replayed)).exists()
        assert not replayed_files & set((out / "minutes" / f"batch={replayed}").glob("*.parquet"))
    finally:
        _kill9(proc)
